"""The CUDA execution path of a rank: the same `step(seqs) -> logits` as ReferenceRunner, every
step replayed from a CUDA graph.

How it works
------------
Start-up (build_cuda_runner below does all of it for a rank, in this order):

1. `CudaGraphRunner(model, capacities, options)`: the model's weights are already on the GPU
   (Package.load_shard(rank, device) + build_model). The constructor allocates every static
   buffer once (pinned host staging, their device mirrors, the float32 logits buffer, the
   FlashInfer workspace), runs one eager forward at the largest step over a scratch cache
   (warm-up: Triton and FlashInfer kernels load, NCCL communicators form; and profiling: the
   activation peak), then sizes the KV page pool from the memory left (runtime/kv_sizing.py)
   and allocates it. `kv_plan.num_pages` is what the scheduler may hand out.
2. `capture()`: for every prefill token bucket (capacities.prefill_chunk_sizes) and every
   decode bucket (capacities.decode_batch_buckets; small ones twice, with FlashInfer's and
   with Orbit's fused decode attention), largest first, into one shared memory pool: plan
   attention for padding, run the forward once on a side stream, then capture it. The TP
   all-reduces (and, in decode graphs, the LM head's all-gather) are inside each graph; each
   graph writes its result into a static buffer, so no graph's memory outlives a replay.
3. `step(seqs)` per step.

A decode step (every sequence brings one token) pads the batch to the smallest bucket that
holds it, writes the inputs (token ids, positions, KV write slots, page tables) into pinned
staging buffers, copies them to the device asynchronously (the whole small int64 staging
buffer in one copy: a strided slice would need temporaries), plans the bucket's attention
(FlashInfer's decode wrapper, on the host, when its page counts changed; Orbit's fused kernel
for small buckets plans nothing) and replays the bucket's graph.
Padding rows read token 0 at position 0 and write their KV into the runner's own padding
page (page id `kv_plan.num_pages`, never handed to the scheduler), so they never touch a real
sequence's cache; every kernel works row by row (GEMMs, norms, attention), so padding rows
cannot change a real row's result. A decode batch larger than the largest bucket raises
BucketError: it is never run eagerly in silence.

A step of decode rows and verification rows (speculative decoding: a row of m tokens that
samples after each) runs as a decode step too, each verification row as m one-token rows of
its sequence at consecutive positions (its tokens' KV written before any row attends). Up to
CudaRunnerOptions.exact_verify_max_bucket rows (ranks started with --exact-verification) it
replays the bucket's exact graph, captured inside cuda_ops.exact_rows(): every product of 1 to
32 rows through the few-rows kernel at one tile (a row's dot products the same alone or among
32), FlashInfer's per-row norms, and FusedDecodeAttention(exact=True) (a KV-writing kernel
first, then the fused kernel reading only, the context split as for one row); one-token steps
replay the same graphs, so each row's logits and KV are bit for bit those of one-row steps,
and greedy output with speculation is the output without it (tests/gpu:
test_verification_rows_equal_one_row_steps_bit_for_bit). Otherwise, and with FP8 pages, it
replays FlashInfer's decode graph of the bucket, whose few-rows products round differently
from the one-row GEMV.

Any other step (prefill chunks, or a mix of prefill chunks and decode rows) is padded to the
smallest token bucket that holds its tokens and replayed from that bucket's graph: padding
rows (token 0, position 0, KV into the padding page) belong to no sequence, and the graph's
fixed number of sequences, min(max_batch, bucket), is filled with empty ones
(runtime/cuda_attention.py, PrefillGraphAttention). Where those graphs attend through FA3,
a step with many decode rows beside its prompt chunks replays the bucket's second graph, which
attends through FA2 (CudaRunnerOptions.mixed_fa2_min_rows), and a step of one sequence's few
new tokens over a long context (a turn after a cached prefix) replays a graph attending
through Orbit's split-context kernel (PrefixGraphAttention, prefix_attention_max_tokens).
The graph ends at the final norm; the LM head then runs eagerly on the sampling rows only
(one GEMM and, for TP > 1, one all-gather), so a graph need not carry max_batch rows of
logits. A step beyond the package's per-step token budget or max batch raises BucketError.

Memory: after `capture()`, steps allocate no new device memory: replays touch only the graphs'
pool and the static buffers; the eager LM head of prefill steps reuses the caching allocator's
blocks, within the peak the start-up profile measured and the pool sizing reserved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from runtime import cuda_attention, cuda_ops
from runtime.cuda_attention import (
    DecodeAttention,
    FusedDecodeAttention,
    PrefillAttention,
    PrefillGraphAttention,
    PrefixGraphAttention,
)
from runtime.kv_cache import KVCache, KVCacheShape, page_dtype
from runtime.kv_sizing import KVPoolPlan, plan_kv_pool
from runtime.layers import TPGroup
from runtime.matmul import Fp8Matmul
from runtime.model import Transformer, build_model
from runtime.package import Package
from runtime.quant import KVQuant
from runtime.runner import SeqInput
from runtime.spec import Capacities, token_bucket

log = logging.getLogger(__name__)

# FlashInfer's per-wrapper integer workspace (allocated by each wrapper, outside our control).
_WRAPPER_INT_WORKSPACE_BYTES = 8 << 20


class BucketError(ValueError):
    """A step that the package's prepared buckets and capacities cannot run."""


@dataclass(frozen=True)
class CudaRunnerOptions:
    kv_fraction: float = 0.9  # share of the memory left after weights and reserves for KV pages
    max_kv_pages: int = 0  # cap on the pool (0: none); tests and benchmarks keep it small
    workspace_bytes: int = 256 << 20  # FlashInfer float workspace, shared by every wrapper
    reserve_margin_bytes: int = 512 << 20  # kept free beyond the measured activation peaks
    # Decode buckets of at most this many rows also get a graph whose attention is Orbit's
    # one-kernel decode (FusedDecodeAttention), replayed while every row's context (the new
    # token included) is at most fused_decode_max_context tokens, or over FP8 pages
    # fused_decode_fp8_max_context; FlashInfer's kernels are faster beyond. Measured on an H100
    # (2026-12-07, docs/performance.md): alone, the kernel won or tied at 8-256 rows of
    # 256-4,096 tokens over bf16 pages, but in the 8B's whole step only up to 64 rows (graph
    # replay 8.01 against 8.24 ms at 64 rows of 512 tokens, 15.34 against 15.13 at 256); over
    # FP8 pages, which it widens to float16, it lost from 1,024 tokens at 16-64 rows (64 rows
    # of 512 tokens 45.1 against 54.7 µs a layer, of 1,024 84.8 against 80.4). At 8 rows over
    # bf16 pages FlashInfer wins beyond 2,048 (H200). A max bucket of 0 turns it off.
    fused_decode_max_bucket: int = 64
    fused_decode_max_context: int = 2048
    fused_decode_fp8_max_context: int = 768
    # Decode buckets of at most this many rows also get an exact graph, replayed for one-token
    # steps and verification rows (speculative decoding) alike, which computes every row as
    # it would alone (cuda_ops.exact_rows: the few-rows kernel at one tile for 1 to 32 rows,
    # FusedDecodeAttention(exact=True)), so greedy output with speculation is token for token
    # the output without it. Needs bf16 weights and model-dtype pages (asked for without them,
    # capture() refuses with a ValueError: never quietly inexact); replayed up to
    # fused_decode_max_context. 0: off (verification rows take FlashInfer's decode graph and
    # the few-rows products, one-token steps the GEMV). Off unless the ranks run with
    # --exact-verification (ranks/worker.py cuda_runner_options): one-token steps give up the
    # GEMV (H200, 2026-12-06: SmolLM2-135M 0.86 ms against 0.60, the 8B 4.63 against 4.3),
    # and a 17-token verification costs 1.14x and 1.21x their one-token step
    # (docs/performance.md).
    exact_verify_max_bucket: int = 0
    # Where prefill graphs attend through FA3 (Hopper, model-dtype pages), token buckets that
    # can hold this many one-token rows also get a graph attending through FA2, replayed for
    # steps with at least that many decode rows beside their prompt chunks: FA3 gives each
    # one-token row a query tile of its own. Beside 1,792 prompt tokens of the 8B (H100,
    # 2026-12-06, `benchmarks.decode --mixed`, ms FA3 / FA2): 252 rows 77.5 / 59.3, 64 rows
    # 55.7 / 53.1, 32 rows 51.4 / 52.3; prompts alone are 1-5% faster through FA3. 0: off.
    mixed_fa2_min_rows: int = 48
    # Where prefill graphs attend through FA3, token buckets of at most this many tokens also
    # get a graph attending through Orbit's split-context kernel (PrefixGraphAttention),
    # replayed for steps of at most prefix_attention_max_seqs sequences whose longest context
    # reaches prefix_attention_min_context tokens: a turn after a cached prefix, whose few new
    # tokens FA3 gives a few CTAs that each walk the whole context. H100, 2026-12-07, the 8B's
    # cached turn (64 new tokens after 2,048): attention 27.5 against FA3's 34.5 µs a layer,
    # the step 7.67 against 7.98 ms (`benchmarks.decode --profile`); alone, 16 new tokens over
    # 2,064 22.1 against 34.3, but 4 sequences of 64 over 2,112 76.2 against 36.5, hence one
    # sequence. Over FP8 pages (FA2's graphs) the kernel lost (29.1 against 27.5). 0: off.
    prefix_attention_max_tokens: int = 64
    prefix_attention_max_seqs: int = 1
    prefix_attention_min_context: int = 1024
    kv_quant: KVQuant | None = None  # FP8 KV pages with these scales; None: the model's dtype
    # Bytes per page of another pool indexed by the same page ids, allocated after this one
    # (rank 0's draft model, ranks/drafting.py): the pool is sized as if its pages held both.
    shared_page_bytes: int = 0


class RankSettings(Protocol):
    """What build_cuda_runner reads of a rank's configuration (ranks/config.py)."""

    rank: int
    kv_pages: int  # 0: size the pool from free memory; else at most this many pages


def build_cuda_runner(
    pkg: Package,
    group: TPGroup,
    settings: RankSettings,
    kv_fraction: float = 0.9,
    kv_dtype: str = "auto",
) -> tuple[CudaGraphRunner, int]:
    """A rank's whole CUDA start-up on its current device (torch.cuda.set_device first):
    load the shard straight to the GPU, build the model, size and allocate the KV pool, warm
    up, capture the decode graphs. Returns the runner and the pages the scheduler may use."""
    device = torch.device("cuda", torch.cuda.current_device())
    tensors = pkg.load_shard(settings.rank, device)
    model = build_model(pkg.spec, tensors, group, pkg.capacities.max_seq_len, device, pkg.quant)
    options = CudaRunnerOptions(
        kv_fraction=kv_fraction, max_kv_pages=settings.kv_pages, kv_quant=pkg.kv_quant(kv_dtype)
    )
    runner = CudaGraphRunner(model, pkg.capacities, options)
    runner.capture()
    return runner, runner.kv_plan.num_pages


# Rows of the int64 staging buffer: one value per token row of the step. _FED: the row of the
# fed tokens (feed()) that replaces the token id, or -1.
_IDS, _POS, _PAGE, _SLOT, _SAMPLE, _FED = range(6)


class CudaGraphRunner:
    """One rank's model on one GPU: every step replayed from a captured graph."""

    def __init__(
        self,
        model: Transformer,
        capacities: Capacities,
        options: CudaRunnerOptions = CudaRunnerOptions(),
    ):
        self.model, self.caps, self.options = model, capacities, options
        self.device = model.norm.weight.device
        self.dtype = model.norm.weight.dtype
        if self.device.type != "cuda" or self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"CudaGraphRunner needs a bfloat16/float16 model on CUDA, got {self.dtype} on "
                f"{self.device}; the CPU path is ReferenceRunner."
            )
        capability = torch.cuda.get_device_capability(self.device)
        if options.kv_quant is not None and capability < (8, 9):
            # Orbit's KV-writing kernels store e4m3 through Triton, which has it from sm89 on.
            raise ValueError(
                f"FP8 KV pages need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"this one is {capability[0]}.{capability[1]}. Serve with --kv-dtype model."
            )
        spec, self.tp = model.spec, model.embed.group.size
        self.page_size = capacities.kv_page_size
        self.scale = spec.head_dim**-0.5
        self.num_q_heads = spec.num_heads // self.tp
        self.buckets = tuple(sorted(capacities.decode_batch_buckets))
        self.prefill_buckets = tuple(sorted(capacities.prefill_chunk_sizes))
        self.max_tokens = max(capacities.max_step_tokens, capacities.max_batch)
        self.max_indices = capacities.max_batch * capacities.max_pages_per_seq
        # through the module, so that a benchmark's choice of backend holds here too
        fa3 = cuda_attention.prefill_backend(self.device, options.kv_quant) == "fa3"
        least = options.mixed_fa2_min_rows
        self.mixed_buckets = tuple(
            t
            for t in self.prefill_buckets
            if fa3 and least and min(capacities.max_batch, t) >= least
        )
        self.prefix_buckets = tuple(
            t for t in self.prefill_buckets if fa3 and t <= options.prefix_attention_max_tokens
        )
        self._alloc_static()
        reserve = self._profile() + options.reserve_margin_bytes
        num_wrappers = len(self.buckets) + len(self.prefill_buckets) + len(self.mixed_buckets) + 1
        reserve += num_wrappers * _WRAPPER_INT_WORKSPACE_BYTES
        page_bytes = self._kv_shape(1).bytes(page_dtype(self.dtype, options.kv_quant))
        self.kv_plan = self._size_pool(page_bytes + options.shared_page_bytes, reserve)
        self.pad_page = self.kv_plan.num_pages
        self.kv = self._kv_cache(self.kv_plan.num_pages + 1)
        self._prefill = PrefillAttention(self.kv, self._workspace, self.scale, self.num_q_heads)
        self._decode: dict[int, DecodeAttention] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._fused: dict[int, FusedDecodeAttention] = {}
        self._fused_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._exact: dict[int, FusedDecodeAttention] = {}
        self._exact_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._last_decode: dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_attn: dict[int, PrefillGraphAttention] = {}
        self._prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._mixed_attn: dict[int, PrefillGraphAttention] = {}
        self._mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._prefix_attn: dict[int, PrefixGraphAttention] = {}
        self._prefix_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        log.info(
            "KV pool: %d pages of %d tokens (%.1f GiB)",
            self.kv_plan.num_pages,
            self.page_size,
            (self.kv_plan.num_pages + 1) * page_bytes / 2**30,
        )

    # ---- start-up -----------------------------------------------------------------------

    def _kv_shape(self, num_pages: int) -> KVCacheShape:
        return KVCacheShape.for_spec(self.model.spec, self.tp, num_pages, self.page_size)

    def _kv_cache(self, num_pages: int) -> KVCache:
        shape = self._kv_shape(num_pages)
        return KVCache(shape, self.dtype, self.device, self.options.kv_quant)

    def _alloc_static(self) -> None:
        dev = self.device
        self._host_i64 = torch.zeros((6, self.max_tokens), dtype=torch.int64, pin_memory=True)
        # [page indices (max_indices) | last-page lengths of a decode batch (max_batch) |
        #  its page indptr (max_batch + 1)]
        self._host_i32 = torch.zeros(
            self.max_indices + 2 * self.caps.max_batch + 1, dtype=torch.int32, pin_memory=True
        )
        self._np_i64, self._np_i32 = self._host_i64.numpy(), self._host_i32.numpy()
        self._dev_i64 = torch.zeros((6, self.max_tokens), dtype=torch.int64, device=dev)
        self._fed = torch.zeros(self.caps.max_batch, dtype=torch.int64, device=dev)
        self._dev_i32 = torch.zeros(self.max_indices, dtype=torch.int32, device=dev)
        self._copied = torch.cuda.Event()  # the last host->device copy of the staging buffers
        self._copied.record()
        self._logits = torch.zeros(  # [max_batch, vocab] float32: the decode graphs' output
            (self.caps.max_batch, self.model.spec.vocab_size), dtype=torch.float32, device=dev
        )
        self._hidden = torch.zeros(  # [max_tokens, hidden]: the prefill graphs' output
            (self.max_tokens, self.model.spec.hidden_size), dtype=self.dtype, device=dev
        )
        self._workspace = torch.zeros(self.options.workspace_bytes, dtype=torch.uint8, device=dev)
        # the fused and exact decode graphs' partial states, before the pool is sized
        shape = self._kv_shape(1)
        group = self.num_q_heads // shape.kv_heads
        grids = [
            (b, FusedDecodeAttention.splits_for(b, shape.kv_heads, dev, exact))
            for exact, largest in (
                (False, self.options.fused_decode_max_bucket),
                (True, self.options.exact_verify_max_bucket),
            )
            for b in self.buckets
            if b <= largest
        ]
        self._fused_workspace = None
        if grids:
            self._fused_workspace = FusedDecodeAttention.shared_workspace(
                grids, shape.kv_heads, group, shape.head_dim, dev
            )
        # the split-context graphs' partial states, before the pool is sized (tens of MB)
        self._prefix_workspace = None
        if self.prefix_buckets:
            grids = [
                PrefixGraphAttention.grid(t, self._prefix_batch(t), shape.kv_heads, dev)
                for t in self.prefix_buckets
            ]
            self._prefix_workspace = PrefixGraphAttention.shared_workspace(
                grids, shape.kv_heads, group, shape.head_dim, dev
            )

    def _prefix_batch(self, tokens: int) -> int:
        """The sequences of the split-context graph of a token bucket."""
        return min(self.caps.max_batch, tokens, self.options.prefix_attention_max_seqs)

    @torch.inference_mode()
    def _profile(self) -> int:
        """Run the largest step (max_step_tokens tokens over as many sampling sequences as the
        batch allows) over a scratch cache; returns its activation peak in bytes."""
        num_tokens = self.caps.max_step_tokens
        num_seqs = min(self.caps.max_batch, num_tokens)
        lengths = [num_tokens // num_seqs] * num_seqs
        lengths[0] += num_tokens - sum(lengths)
        seqs, next_page = [], 0
        for n in lengths:
            pages = list(range(next_page, next_page + -(-n // self.page_size)))
            next_page += len(pages)
            seqs.append(SeqInput([1] * n, 0, pages, sample=True))
        scratch = self._kv_cache(next_page)
        attn = PrefillAttention(scratch, self._workspace, self.scale, self.num_q_heads)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self._prefill_forward(seqs, attn)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del scratch, attn
        torch.cuda.empty_cache()
        # The graphs' pool holds about this peak (the largest prefill graph's activations;
        # decode graphs are smaller), and the eager LM head and step_eager may need it again.
        return 2 * peak

    def _size_pool(self, page_bytes: int, reserve_bytes: int) -> KVPoolPlan:
        free_bytes, _ = torch.cuda.mem_get_info(self.device)
        return plan_kv_pool(
            page_bytes,
            free_bytes,
            reserve_bytes,
            self.options.kv_fraction,
            min_pages=self.caps.max_pages_per_seq,
            max_pages=self.options.max_kv_pages,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per prefill token bucket and per decode bucket, largest first,
        sharing one memory pool (each writes its result to a static buffer, so no graph's
        memory outlives its replay)."""
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved()
        kinds = [(t, "") for t in self.prefill_buckets] + [(t, "fa2") for t in self.mixed_buckets]
        kinds += [(t, "prefix") for t in self.prefix_buckets]
        for tokens, kind in sorted(kinds, reverse=True):
            pages, slots = self._dev_i64[_PAGE, :tokens], self._dev_i64[_SLOT, :tokens]
            if kind == "prefix":
                attn = PrefixGraphAttention(
                    self.kv,
                    tokens,
                    self._prefix_batch(tokens),
                    self.caps.max_pages_per_seq,
                    pages,
                    slots,
                    self.scale,
                    self._prefix_workspace,
                )
            else:
                attn = PrefillGraphAttention(
                    self.kv,
                    tokens,
                    min(self.caps.max_batch, tokens),
                    self.caps.max_pages_per_seq,
                    self._workspace,
                    pages,
                    slots,
                    self.scale,
                    self.num_q_heads,
                    kind,
                )
            # FlashInfer sizes its graph-mode plan from this first one, which must have all
            # `tokens` rows: sequences of at most max_seq_len tokens over the padding page.
            lengths = [
                min(self.caps.max_seq_len, tokens - start)
                for start in range(0, tokens, self.caps.max_seq_len)
            ]
            dummy = [
                SeqInput([0] * n, 0, [self.pad_page] * -(-n // self.page_size), False)
                for n in lengths
            ]
            if kind == "prefix":  # (plans nothing from it: as many sequences as it holds)
                dummy = dummy[: attn.batch]
            self._plan_prefill_graph(dummy, tokens, attn)
            graph = self._capture(lambda t=tokens, a=attn: self._prefill_graph_forward(t, a), pool)
            attns, graphs = {
                "": (self._prefill_attn, self._prefill_graphs),
                "fa2": (self._mixed_attn, self._mixed_graphs),
                "prefix": (self._prefix_attn, self._prefix_graphs),
            }[kind]
            attns[tokens], graphs[tokens] = attn, graph
        exact_max = self._exact_max_bucket()
        for bucket in sorted(self.buckets, reverse=True):
            pages, slots = self._dev_i64[_PAGE, :bucket], self._dev_i64[_SLOT, :bucket]
            max_pages = self.caps.max_pages_per_seq
            attn = DecodeAttention(
                self.kv,
                bucket,
                max_pages,
                self._workspace,
                pages,
                slots,
                self.scale,
                self.num_q_heads,
            )
            self._decode[bucket] = attn
            self._graphs[bucket] = self._capture_decode(bucket, attn, pool)
            fused_args = (self.kv, bucket, max_pages, pages, slots, self.scale)
            fused_args += (self.num_q_heads, self._fused_workspace)
            if bucket <= self.options.fused_decode_max_bucket:
                fused = FusedDecodeAttention(*fused_args)
                self._fused[bucket] = fused
                self._fused_graphs[bucket] = self._capture_decode(bucket, fused, pool)
            if bucket <= exact_max:
                exact = FusedDecodeAttention(*fused_args, exact=True)
                self._exact[bucket] = exact
                with cuda_ops.exact_rows():
                    self._exact_graphs[bucket] = self._capture_decode(bucket, exact, pool)
        torch.cuda.synchronize()
        log.info(
            "captured prefill graphs for token buckets %s and decode graphs for batch buckets "
            "%s (%.0f MiB of graph memory)",
            list(self.prefill_buckets),
            list(self.buckets),
            (torch.cuda.memory_reserved() - before) / 2**20,
        )

    @property
    def exact_rows(self) -> int:
        """Decode steps of up to this many rows replay an exact graph (0: none captured)."""
        return max(self._exact, default=0)

    def _exact_max_bucket(self) -> int:
        """The largest bucket that gets an exact verification graph (0: none). Asked for where
        it cannot be exact, it is refused rather than quietly left out."""
        opts = self.options
        if not opts.exact_verify_max_bucket:
            return 0
        if opts.kv_quant is not None:  # not yet checked on a GPU with FP8 pages
            raise ValueError(
                "exact verification needs KV pages of the model's dtype, not FP8; pass "
                "--kv-dtype model or drop --exact-verification"
            )
        if any(  # the few-rows kernel's exact tile is bf16's
            isinstance(getattr(m, "mm", None), Fp8Matmul) for m in self.model.modules()
        ):
            raise ValueError(
                "exact verification takes bf16 weights; this package's are FP8: drop "
                "--exact-verification"
            )
        return opts.exact_verify_max_bucket

    def _capture_decode(
        self, bucket: int, attn: DecodeAttention | FusedDecodeAttention, pool
    ) -> torch.cuda.CUDAGraph:
        self._plan_decode([], bucket, attn)  # all padding rows
        return self._capture(lambda: self._decode_forward(bucket, attn), pool)

    @staticmethod
    def _capture(forward, pool) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            forward()
        return graph

    def feed(self, tokens: torch.Tensor) -> None:
        """Tokens (on this GPU, [n <= max_batch]) that later steps' rows name by
        SeqInput.fed_row: a step's samples, copied in stream order, so the next step can be
        launched before they reach the host."""
        self._fed[: tokens.shape[0]].copy_(tokens, non_blocking=True)

    def last_decode_graph(self, bucket: int) -> torch.cuda.CUDAGraph:
        """The graph that the last decode step of this bucket replayed, over that step's inputs
        still: benchmarks replay it alone to time the GPU side."""
        return self._last_decode[bucket]

    # ---- steps --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Float32 logits [sampling rows <= max_batch, vocab] on the GPU (each sampling
        sequence's last num_samples tokens), in the order of seqs. A decode
        step returns a view of the graphs' output buffer: valid until the next step."""
        if not self._graphs:
            raise RuntimeError("CudaGraphRunner.step before capture(); call capture() first.")
        if all(len(s.token_ids) == 1 for s in seqs):
            return self._decode_step(seqs)
        rows = _decode_rows(seqs)
        if rows is not None and len(rows) <= self.buckets[-1]:
            # Verification rows as one-token rows of their sequences: every row's KV is
            # written before any row attends, which FlashInfer's decode graph and the exact
            # graph do (a KV-writing kernel, then attention) and the fused one does not (a
            # program would read the context other programs of the same launch write).
            return self._decode_step(rows, verification=True)
        return self._prefill_step(seqs)

    @torch.inference_mode()
    def step_eager(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Any step run eagerly and unpadded, FlashInfer's prefill planned for it alone: the
        tests' uncaptured counterpart of the graphs."""
        return self._prefill_forward(seqs, self._prefill)

    def _decode_step(self, seqs: list[SeqInput], verification: bool = False) -> torch.Tensor:
        if not seqs:
            raise BucketError("a step needs at least one sequence.")
        bucket = next((b for b in self.buckets if b >= len(seqs)), None)
        if bucket is None:
            raise BucketError(
                f"decode batch of {len(seqs)} sequences exceeds the largest captured bucket "
                f"({self.buckets[-1]}, the package's max_batch); the scheduler must split it."
            )
        opts = self.options
        fp8 = opts.kv_quant is not None
        max_context = opts.fused_decode_fp8_max_context if fp8 else opts.fused_decode_max_context
        short = max(s.start_pos + 1 for s in seqs) <= max_context
        if verification or self._exact:
            attns, graphs = self._exact, self._exact_graphs
        else:
            attns, graphs = self._fused, self._fused_graphs
        if not (short and bucket in attns):
            attns, graphs = self._decode, self._graphs
        self._plan_decode(seqs, bucket, attns[bucket])
        graphs[bucket].replay()
        self._last_decode[bucket] = graphs[bucket]
        if all(s.sample for s in seqs):
            return self._logits[: len(seqs)]
        rows = [i for i, s in enumerate(seqs) if s.sample]
        return self._logits[rows]

    def _plan_decode(
        self, seqs: list[SeqInput], bucket: int, attn: DecodeAttention | FusedDecodeAttention
    ) -> None:
        """Stage one decode batch padded to `bucket` rows, copy it to the device (page indices,
        indptr and last-page lengths straight into the bucket's attention buffers), plan
        attention."""
        ps, st, idx = self.page_size, self._np_i64, self._np_i32
        self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        at_len, at_ptr = self.max_indices, self.max_indices + self.caps.max_batch
        last_len = self._np_i32[at_len : at_len + bucket]
        last_len[:] = 1
        indptr = self._np_i32[at_ptr : at_ptr + bucket + 1]
        indptr[0] = 0
        used = 0
        for i, s in enumerate(seqs):
            pos = s.start_pos
            num_pages = self._check_pages(s, pos + 1)
            st[_IDS, i], st[_POS, i], st[_FED, i] = s.token_ids[0], pos, s.fed_row
            st[_PAGE, i], st[_SLOT, i] = s.page_table[pos // ps], pos % ps
            idx[used : used + num_pages] = s.page_table[:num_pages]
            used += num_pages
            indptr[i + 1], last_len[i] = used, pos + 1 - (num_pages - 1) * ps
        for i in range(len(seqs), bucket):  # padding rows: token 0 at position 0, padding page
            st[_IDS, i], st[_POS, i], st[_PAGE, i], st[_SLOT, i] = 0, 0, self.pad_page, 0
            st[_FED, i] = -1
            idx[used] = self.pad_page
            used += 1
            indptr[i + 1] = used
        self._dev_i64.copy_(self._host_i64, non_blocking=True)
        attn.indices_buf[:used].copy_(self._host_i32[:used], non_blocking=True)
        attn.last_len_buf.copy_(self._host_i32[at_len : at_len + bucket], non_blocking=True)
        attn.indptr_buf.copy_(self._host_i32[at_ptr : at_ptr + bucket + 1], non_blocking=True)
        self._copied.record()
        attn.plan(indptr, used, last_len)

    def _decode_forward(self, bucket: int, attn: DecodeAttention | FusedDecodeAttention) -> None:
        """The captured region: static inputs in, the static logits buffer out."""
        ids = self._token_ids(bucket)
        hidden = self.model(ids, self._dev_i64[_POS, :bucket], attn)
        self._logits[:bucket].copy_(self.model.lm_head(hidden))

    def _token_ids(self, num_tokens: int) -> torch.Tensor:
        """The step's token ids, fed rows taken from the fed tokens on the device."""
        fed_row = self._dev_i64[_FED, :num_tokens]
        fed = self._fed.index_select(0, fed_row.clamp(min=0))
        return torch.where(fed_row >= 0, fed, self._dev_i64[_IDS, :num_tokens])

    def _prefill_step(self, seqs: list[SeqInput]) -> torch.Tensor:
        """A prefill or mixed step, replayed from the smallest token bucket that holds it."""
        num_tokens = self._check_step(seqs)
        tokens = token_bucket(self.prefill_buckets, num_tokens)
        attns, graphs = self._prefill_attn, self._prefill_graphs
        if tokens in self._prefix_graphs and self._long_context(seqs, self._prefix_attn[tokens]):
            attns, graphs = self._prefix_attn, self._prefix_graphs
        elif tokens in self._mixed_graphs and self._mixed(seqs):
            attns, graphs = self._mixed_attn, self._mixed_graphs
        num_sample = self._plan_prefill_graph(seqs, tokens, attns[tokens])
        graphs[tokens].replay()
        return self._sampled_logits(self._hidden, num_sample)

    def _long_context(self, seqs: list[SeqInput], attn: PrefixGraphAttention) -> bool:
        """Whether a step is few sequences over a long context, for the split-context graph
        of its bucket (CudaRunnerOptions.prefix_attention_*)."""
        longest = max(s.start_pos + len(s.token_ids) for s in seqs)
        return len(seqs) <= attn.batch and longest >= self.options.prefix_attention_min_context

    def _mixed(self, seqs: list[SeqInput]) -> bool:
        """Whether a step carries enough one-token rows to take the FA2 graph of its bucket
        (CudaRunnerOptions.mixed_fa2_min_rows)."""
        least = self.options.mixed_fa2_min_rows
        return sum(len(s.token_ids) == 1 for s in seqs) >= least

    def _plan_prefill_graph(
        self, seqs: list[SeqInput], tokens: int, attn: PrefillGraphAttention
    ) -> int:
        """Stage a step padded to `tokens` rows and attn.batch sequences, plan its attention;
        returns how many rows sample."""
        staged = self._stage(seqs, tokens, attn.batch, attn.indices_buf)
        qo_indptr, kv_indptr, last_len, used, num_sample = staged
        attn.plan(qo_indptr, kv_indptr, last_len, used)
        return num_sample

    def _prefill_graph_forward(self, tokens: int, attn: PrefillGraphAttention) -> None:
        """The captured region of a prefill graph: static inputs in, static hidden states out."""
        hidden = self.model(self._token_ids(tokens), self._dev_i64[_POS, :tokens], attn)
        self._hidden[:tokens].copy_(hidden)

    def _prefill_forward(self, seqs: list[SeqInput], attn: PrefillAttention) -> torch.Tensor:
        num_tokens = self._check_step(seqs)
        staged = self._stage(seqs, num_tokens, len(seqs), self._dev_i32)
        qo_indptr, kv_indptr, last_len, used, num_sample = staged
        dev = self._dev_i64
        attn.plan(
            torch.from_numpy(qo_indptr),
            torch.from_numpy(kv_indptr),
            self._dev_i32[:used],
            torch.from_numpy(last_len),
            dev[_PAGE, :num_tokens],
            dev[_SLOT, :num_tokens],
        )
        hidden = self.model(self._token_ids(num_tokens), dev[_POS, :num_tokens], attn)
        return self._sampled_logits(hidden, num_sample)

    def _sampled_logits(self, hidden: torch.Tensor, num_sample: int) -> torch.Tensor:
        """The LM head (run eagerly) over the rows staged as sampling rows."""
        if not num_sample:  # every rank plans the same step, so all skip the LM head together
            return torch.empty((0, self.model.spec.vocab_size), device=self.device)
        rows = self._dev_i64[_SAMPLE, :num_sample]
        return self.model.logits(hidden.index_select(0, rows))

    def _check_step(self, seqs: list[SeqInput]) -> int:
        num_tokens = sum(len(s.token_ids) for s in seqs)
        if not seqs or num_tokens > self.caps.max_step_tokens or len(seqs) > self.caps.max_batch:
            raise BucketError(
                f"a step of {len(seqs)} sequences and {num_tokens} tokens is outside the "
                f"package's capacities ({self.caps.max_batch} sequences, "
                f"{self.caps.max_step_tokens} tokens per step)."
            )
        return num_tokens

    def _stage(
        self, seqs: list[SeqInput], rows: int, batch: int, indices: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
        """Write a step's token rows (padded to `rows` with padding rows: token 0 at position
        0, KV written to the padding page) and its sequences (padded to `batch` with empty
        ones over the padding page) into the staging buffers, and copy them to the device:
        the page indices into `indices`. Returns (qo_indptr, kv_indptr, last-page lengths,
        number of page indices, number of sampling rows)."""
        ps, st, idx = self.page_size, self._np_i64, self._np_i32
        qo_indptr = np.zeros(batch + 1, dtype=np.int32)
        kv_indptr = np.zeros(batch + 1, dtype=np.int32)
        last_len = np.ones(batch, dtype=np.int32)
        self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        row = used = num_sample = 0
        for i, s in enumerate(seqs):
            n, ctx = len(s.token_ids), s.start_pos + len(s.token_ids)
            num_pages = self._check_pages(s, ctx)
            pos = np.arange(s.start_pos, ctx)
            pages = np.asarray(s.page_table[:num_pages], dtype=np.int64)
            st[_IDS, row : row + n], st[_POS, row : row + n] = s.token_ids, pos
            st[_FED, row : row + n] = s.fed_row
            st[_PAGE, row : row + n], st[_SLOT, row : row + n] = pages[pos // ps], pos % ps
            idx[used : used + num_pages] = pages
            row, used = row + n, used + num_pages
            m = s.num_logits
            if m == 1:
                st[_SAMPLE, num_sample] = row - 1
            elif m:  # a verification row samples after each of its last m tokens
                st[_SAMPLE, num_sample : num_sample + m] = np.arange(row - m, row)
            num_sample += m
            qo_indptr[i + 1], kv_indptr[i + 1] = row, used
            last_len[i] = ctx - (num_pages - 1) * ps
        if row < rows:  # (only graph steps pad: the start-up profile runs before pad_page)
            st[_IDS, row:rows], st[_POS, row:rows], st[_FED, row:rows] = 0, 0, -1
            st[_PAGE, row:rows], st[_SLOT, row:rows] = self.pad_page, 0
        for i in range(len(seqs), batch):
            idx[used] = self.pad_page
            used += 1
            qo_indptr[i + 1], kv_indptr[i + 1] = row, used
        self._dev_i64.copy_(self._host_i64, non_blocking=True)
        indices[:used].copy_(self._host_i32[:used], non_blocking=True)
        self._copied.record()
        return qo_indptr, kv_indptr, last_len, used, num_sample

    def _check_pages(self, s: SeqInput, context_len: int) -> int:
        num_pages = -(-context_len // self.page_size)
        if context_len > self.caps.max_seq_len:
            raise BucketError(
                f"a sequence reaching {context_len} tokens exceeds the package's max_seq_len "
                f"({self.caps.max_seq_len})."
            )
        if len(s.page_table) < num_pages:
            raise ValueError(
                f"page table of {len(s.page_table)} pages cannot hold {context_len} tokens "
                f"({num_pages} pages of {self.page_size})."
            )
        return num_pages


def _decode_rows(seqs: list[SeqInput]) -> list[SeqInput] | None:
    """A step of decode and verification rows as one-token rows (a verification row of m
    tokens: m rows of its sequence at consecutive positions, each sampling, in order, which is
    the order of its logits); None when a row is a prompt chunk."""
    rows = []
    for s in seqs:
        n = len(s.token_ids)
        if n == 1:
            rows.append(s)
        elif s.sample and s.num_samples == n and s.fed_row < 0:
            rows += [
                SeqInput([t], s.start_pos + j, s.page_table, True)
                for j, t in enumerate(s.token_ids)
            ]
        else:
            return None
    return rows
