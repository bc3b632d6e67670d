"""Paged attention on the GPU, with the `attend(layer, q, k, v, cos, sin)` method the model
calls (the CPU path's ReferenceAttention has the same one).

- FusedDecodeAttention: for decode buckets of a few rows (CudaRunnerOptions says how many, and
  up to which context length the runner replays it). Orbit's own Triton kernel
  (triton_kernels.decode_attention) does a layer's RoPE, the new token's KV write and the
  split-KV attention with its merge in one launch, where the FlashInfer path below takes three
  (RoPE + KV write, attention, merge): at small batches the step is latency-bound, and each
  launch costs more than the KV it reads. It reads the same kind of fixed page buffers as
  DecodeAttention, and it plans nothing on the host: each program derives its slice of the
  context from the row's length.
- DecodeAttention: one per captured decode bucket. Its FlashInfer decode wrapper reads fixed
  metadata buffers (page indptr, indices, last-page lengths) that the runner refills before
  every replay; the kernels captured in the graph read them in place. FlashInfer's plan (how
  the KV is split across thread blocks) depends on the page counts alone, so it is redone on
  the host only when a sequence gains a page or the batch changes, not every step. The
  wrapper runs FlashInfer's tensor-core kernels (its FA2 prefill kernel, with the GQA group's
  query heads packed as rows): on the H200 at 512 tokens of context they take 48 µs per layer
  at batch 64 where the CUDA-core decode kernels take 64, and no longer at batch 1
  (benchmarks/kernels.py, docs/performance.md). Over FP8 pages too: on the H100 (2026-12-07)
  the CUDA-core kernel took 82.8 µs a layer at batch 64 where the tensor-core one took 53.4.
- PrefillGraphAttention: one per captured prefill graph (a token bucket of the package's
  prefill chunk sizes): prefill chunks and mixed steps, through FlashInfer's paged prefill in
  its CUDA-graph mode (FA3 kernels on sm90, as the eager path). The batch is fixed per graph
  at min(max_batch, tokens) sequences; a step's unused ones are empty (no query rows) and its
  padding rows belong to no sequence, so attention neither reads nor writes them. FlashInfer
  sizes its graph-mode plan (the grid and its work lists) from the capture-time plan, which
  has the bucket's full token count, so every later plan of at most that many rows fits.
- PrefixGraphAttention: the prefill graphs' variant for steps of a few sequences over long
  contexts (a turn after a cached prefix), through Orbit's split-context kernel
  (triton_kernels.prefix_attention), which reads each part of a context once for a block of
  new tokens and splits the context over the SMs; nothing planned on the host. Off unless
  CudaRunnerOptions.prefix_attention_max_tokens says which buckets get it.
- PrefillAttention: eager, planned per step, the same kernels: the start-up profile and the
  tests' unpadded reference (CudaGraphRunner.step_eager).

Each first rotates the step's q and k (RoPE) and writes k and v into the paged cache, one
Triton kernel per layer, at the (page, slot) pairs the runner put in its static write buffers;
then attends over the cache.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime import cuda_ops
from runtime.kv_cache import KVCache
from runtime.quant import FP8, KVQuant

# Decode rows over FP8 pages through FlashInfer's tensor-core kernels (True) or its CUDA-core
# decode kernel: a switch for `benchmarks.fp8 --kv8`, which times both.
FP8_DECODE_TENSOR_CORES = True


def prefill_backend(device: torch.device, kv_quant: KVQuant | None) -> str:
    """FA3 kernels on Hopper (sm90), FlashInfer's FA2 ones elsewhere and for FP8 pages
    (kv_quant not None): its FA3 kernels take FP8 keys and values only with FP8 queries."""
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    return "fa3" if hopper and kv_quant is None else "fa2"


def _scales(kv: KVCache, layer: int) -> dict[str, float]:
    """FlashInfer's k_scale / v_scale arguments for a layer (none for unscaled pages)."""
    if kv.quant is None:
        return {}
    k_scale, v_scale = kv.scales(layer)
    return {"k_scale": k_scale, "v_scale": v_scale}


class FusedDecodeAttention:
    """Decode attention for a batch bucket of `bucket` rows, one new token each, in one kernel
    a layer. `exact`: rows that may read one another's new tokens (a verification row as
    one-token rows of its sequence), each attending exactly as a one-row step would: every
    row's k and v are written first (a second kernel, the same rounding), and the context is
    split as for one row, so a row's chunks and the order of its sums are a lone row's."""

    def __init__(
        self,
        kv: KVCache,
        bucket: int,
        max_pages_per_seq: int,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        scale: float,
        num_q_heads: int,
        workspace,
        exact: bool = False,
    ):
        """workspace: from shared_workspace, with room for this bucket's splits."""
        device = write_pages.device
        s = kv.shape
        self.kv, self.bucket, self.scale = kv, bucket, scale
        self.write_pages, self.write_offsets = write_pages, write_offsets  # [bucket] int64 views
        # Filled by the runner before every replay: [bucket + 1], [bucket * pages], [bucket]
        self.indptr_buf = torch.zeros(bucket + 1, dtype=torch.int32, device=device)
        self.indices_buf = torch.zeros(bucket * max_pages_per_seq, dtype=torch.int32, device=device)
        self.last_len_buf = torch.ones(bucket, dtype=torch.int32, device=device)
        self.exact = exact
        self.splits = self.splits_for(bucket, s.kv_heads, device, exact)
        self.workspace = workspace

    @staticmethod
    def splits_for(bucket: int, kv_heads: int, device, exact: bool = False) -> int:
        from runtime import triton_kernels

        return triton_kernels.decode_splits(1 if exact else bucket, kv_heads, device)

    @staticmethod
    def shared_workspace(grids, kv_heads: int, group: int, head_dim: int, device):
        """One workspace for every fused and exact decode graph, which never run at once (each
        graph's kernels leave its counters at zero): room for the partial states and counters of
        the largest of grids ((bucket, splits) pairs): for the 8B's 9 buckets up to 64 rows 4 MB,
        where one a graph took 34 MB (168 MB for its 21 up to 256)."""
        from runtime import triton_kernels

        entries = max(bucket * splits for bucket, splits in grids)
        return triton_kernels.decode_workspace(entries, kv_heads, group, head_dim, 1, device)

    def plan(self, indptr: np.ndarray, num_indices: int, last_page_len: np.ndarray) -> None:
        """Nothing to plan: the kernel reads the row lengths from the device buffers."""

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q [bucket, hq, hd]; k, v [bucket, hkv, hd]; cos, sin [bucket, hd]. Returns
        [bucket, hq, hd]."""
        from runtime import triton_kernels

        cache, scales = self.kv.layers[layer], self.kv.scales(layer)
        if self.exact:
            pages, offsets = self.write_pages, self.write_offsets
            triton_kernels.rope_store_kv(
                q, k, v, q, cache, cos, sin, pages, offsets, scales, kv_only=True
            )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        triton_kernels.decode_attention(
            q,
            k,
            v,
            cos,
            sin,
            cache,
            self.indptr_buf,
            self.indices_buf,
            self.last_len_buf,
            self.write_pages,
            self.write_offsets,
            out,
            self.workspace,
            self.scale,
            self.splits,
            scales,
            store_new=not self.exact,
        )
        return out


class DecodeAttention:
    """Decode attention for a batch bucket of `bucket` rows, one new token each."""

    def __init__(
        self,
        kv: KVCache,
        bucket: int,
        max_pages_per_seq: int,
        workspace: torch.Tensor,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        scale: float,
        num_q_heads: int,
    ):
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper

        device = workspace.device
        self.kv, self.bucket, self.scale = kv, bucket, scale
        self.num_q_heads = num_q_heads
        self.write_pages, self.write_offsets = write_pages, write_offsets  # [bucket] int64 views
        # The wrapper's fixed buffers, filled by the runner:
        # [bucket + 1], [bucket * pages], [bucket]
        self.indptr_buf = torch.zeros(bucket + 1, dtype=torch.int32, device=device)
        self.indices_buf = torch.zeros(bucket * max_pages_per_seq, dtype=torch.int32, device=device)
        self.last_len_buf = torch.ones(bucket, dtype=torch.int32, device=device)
        self._planned_indptr: np.ndarray | None = None
        self.wrapper = BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=kv.dtype != FP8 or FP8_DECODE_TENSOR_CORES,
            paged_kv_indptr_buffer=self.indptr_buf,
            paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_len_buf,
            backend="fa2",
        )

    def plan(self, indptr: np.ndarray, num_indices: int, last_page_len: np.ndarray) -> None:
        """Outside the graph, after the runner queued this step's page indices, indptr and
        last-page lengths into the buffers. indptr [bucket + 1] and last_page_len [bucket]
        int32 on the host."""
        if self._planned_indptr is not None and np.array_equal(indptr, self._planned_indptr):
            return  # same page counts: the split planned last time still holds
        s = self.kv.shape
        # Copies: indptr and last_page_len are views of the runner's pinned staging buffer,
        # which the next step overwrites; from pinned memory the wrapper's copies would be
        # asynchronous and could read the next step's values. From pageable memory they are
        # staged at once.
        self.wrapper.plan(
            torch.from_numpy(indptr.copy()),
            self.indices_buf[:num_indices],
            torch.from_numpy(last_page_len.copy()),
            self.num_q_heads,
            s.kv_heads,
            s.head_dim,
            s.page_size,
            q_data_type=self.kv.model_dtype,
            kv_data_type=self.kv.dtype,
            sm_scale=self.scale,
        )
        self._planned_indptr = indptr.copy()

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q [bucket, hq, hd]; k, v [bucket, hkv, hd]; cos, sin [bucket, hd]. Returns
        [bucket, hq, hd]."""
        cache = self.kv.layers[layer]
        q = cuda_ops.rope_and_store_kv(
            q, k, v, cos, sin, cache, self.write_pages, self.write_offsets, self.kv.scales(layer)
        )
        return self.wrapper.run(q, cache, **_scales(self.kv, layer))


class PrefillGraphAttention:
    """Causal attention of a step's new tokens over their sequences' cached context, captured:
    at most `tokens` query rows over exactly `batch` sequences (the unused ones empty)."""

    def __init__(
        self,
        kv: KVCache,
        tokens: int,
        batch: int,
        max_pages_per_seq: int,
        workspace: torch.Tensor,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        scale: float,
        num_q_heads: int,
        backend: str = "",
    ):
        """backend: FlashInfer's ("fa2", "fa3"); empty: prefill_backend's choice."""
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        device = workspace.device
        self.kv, self.tokens, self.batch, self.scale = kv, tokens, batch, scale
        self.num_q_heads = num_q_heads
        self.write_pages, self.write_offsets = write_pages, write_offsets  # [tokens] int64 views
        self.indices_buf = torch.zeros(batch * max_pages_per_seq, dtype=torch.int32, device=device)
        self.wrapper = BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indptr_buf=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buf=self.indices_buf,
            paged_kv_last_page_len_buf=torch.zeros(batch, dtype=torch.int32, device=device),
            backend=backend or prefill_backend(device, kv.quant),
        )

    def plan(
        self,
        qo_indptr: np.ndarray,
        kv_indptr: np.ndarray,
        last_page_len: np.ndarray,
        num_indices: int,
    ) -> None:
        """Outside the graph, after the runner queued the page indices into indices_buf.
        qo_indptr, kv_indptr [batch + 1] and last_page_len [batch] int32 on the host."""
        s = self.kv.shape
        self.wrapper.plan(
            torch.from_numpy(qo_indptr),
            torch.from_numpy(kv_indptr),
            self.indices_buf[:num_indices],
            torch.from_numpy(last_page_len),
            self.num_q_heads,
            s.kv_heads,
            s.head_dim,
            s.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.kv.model_dtype,
            kv_data_type=self.kv.dtype,
        )

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q [tokens, hq, hd]; k, v [tokens, hkv, hd]; cos, sin [tokens, hd]. Returns
        [tokens, hq, hd], whose padding rows hold whatever the graph's memory held."""
        cache = self.kv.layers[layer]
        q = cuda_ops.rope_and_store_kv(
            q, k, v, cos, sin, cache, self.write_pages, self.write_offsets, self.kv.scales(layer)
        )
        return self.wrapper.run(q, cache, **_scales(self.kv, layer))


class PrefixGraphAttention:
    """Causal attention of a step's new tokens over their sequences' cached context through
    Orbit's split-context kernel (triton_kernels.prefix_attention), captured: the prefill
    graphs' variant for steps of a few sequences over long contexts, such as a turn after a
    cached prefix, where FlashInfer's prefill walks each head's context in one CTA
    (CudaRunnerOptions.prefix_attention_max_tokens). It takes the same plan as
    PrefillGraphAttention, for `tokens` rows over `batch` sequences, and only copies it to the
    device: each program of the kernel finds its own sequence and block."""

    Q_TOKENS = 16  # new tokens a program: 64 rows with the 8B's groups of four query heads
    # Tokens a split of the context holds at least, for graphs of one block of new tokens and
    # of more. H100, 2026-12-07 (`benchmarks.kernels --part prefix`), at the 8B's heads: 16
    # new tokens over 2,064 16.7 µs a layer with 256, 22.1 with 512, 20.4 with 128 (FA3 34.3);
    # 64 new over 2,112 27.4 with 512, 32.5 with 256, 36.2 with 128 (FA3 34.8). Fewer blocks
    # leave room for more splits; more splits cost the last one a longer merge.
    MIN_CHUNK_ONE_BLOCK = 256
    MIN_CHUNK = 512

    def __init__(
        self,
        kv: KVCache,
        tokens: int,
        batch: int,
        max_pages_per_seq: int,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        scale: float,
        workspace: tuple[torch.Tensor, ...],
    ):
        """workspace: from shared_workspace, with room for this graph's grid."""
        device = write_pages.device
        self.kv, self.tokens, self.batch, self.scale = kv, tokens, batch, scale
        self.write_pages, self.write_offsets = write_pages, write_offsets  # [tokens] int64 views
        i32 = {"dtype": torch.int32, "device": device}
        self.indices_buf = torch.zeros(batch * max_pages_per_seq, **i32)
        self.qo_indptr_buf = torch.zeros(batch + 1, **i32)
        self.kv_indptr_buf = torch.zeros(batch + 1, **i32)
        self.last_len_buf = torch.ones(batch, **i32)
        self.blocks, self.splits = self.grid(tokens, batch, kv.shape.kv_heads, device)
        self.min_chunk = self.MIN_CHUNK_ONE_BLOCK if tokens <= self.Q_TOKENS else self.MIN_CHUNK
        self.workspace = workspace

    @classmethod
    def grid(cls, tokens: int, batch: int, kv_heads: int, device) -> tuple[int, int]:
        """(query blocks, splits) of the kernel's grid in a graph of `tokens` rows over `batch`
        sequences: blocks enough for any step that fits, the context split as for a step of
        one sequence, the case this variant is replayed for."""
        from runtime import triton_kernels

        blocks = triton_kernels.prefix_blocks(tokens, batch, cls.Q_TOKENS)
        return blocks, triton_kernels.prefix_splits(tokens, cls.Q_TOKENS, kv_heads, device)

    @classmethod
    def shared_workspace(cls, grids, kv_heads: int, group: int, head_dim: int, device):
        """One workspace for every graph of this kind, which never run at once: room for the
        partial states and counters of the largest of grids ((blocks, splits) pairs)."""
        from runtime import triton_kernels

        entries = max(blocks * splits for blocks, splits in grids)
        return triton_kernels.prefix_workspace(
            entries, kv_heads, group, head_dim, 1, cls.Q_TOKENS, device
        )

    def plan(
        self,
        qo_indptr: np.ndarray,
        kv_indptr: np.ndarray,
        last_len: np.ndarray,
        num_indices: int,
    ) -> None:
        """Outside the graph, after the runner queued the page indices into indices_buf.
        The copies are queued, not waited for (a blocking copy would wait for the step in
        flight); from pageable memory CUDA stages them at once, so the arrays are free after."""
        for buf, host in (
            (self.qo_indptr_buf, qo_indptr),
            (self.kv_indptr_buf, kv_indptr),
            (self.last_len_buf, last_len),
        ):
            buf.copy_(torch.from_numpy(host), non_blocking=True)

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q [tokens, hq, hd]; k, v [tokens, hkv, hd]; cos, sin [tokens, hd]. Returns
        [tokens, hq, hd], whose padding rows hold whatever the graph's memory held."""
        from runtime import triton_kernels

        cache, scales = self.kv.layers[layer], self.kv.scales(layer)
        q = cuda_ops.rope_and_store_kv(
            q, k, v, cos, sin, cache, self.write_pages, self.write_offsets, scales
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        triton_kernels.prefix_attention(
            q, cache, self.qo_indptr_buf, self.kv_indptr_buf, self.indices_buf,
            self.last_len_buf, out, self.workspace, self.scale, self.splits, self.blocks,
            kv_scales=scales, q_tokens=self.Q_TOKENS, min_chunk=self.min_chunk,
        )  # fmt: skip
        return out


class PrefillAttention:
    """Causal attention of each sequence's new tokens over its whole cached context."""

    def __init__(self, kv: KVCache, workspace: torch.Tensor, scale: float, num_q_heads: int):
        from flashinfer import BatchPrefillWithPagedKVCacheWrapper

        self.kv, self.scale, self.num_q_heads = kv, scale, num_q_heads
        self.write_pages: torch.Tensor | None = None
        self.write_offsets: torch.Tensor | None = None
        self.wrapper = BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", backend=prefill_backend(workspace.device, kv.quant)
        )

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        last_page_len: torch.Tensor,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
    ) -> None:
        """Index tensors int32 (CPU or GPU); write_pages/offsets [num_tokens] int64 on the GPU."""
        s = self.kv.shape
        self.write_pages, self.write_offsets = write_pages, write_offsets
        self.wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            last_page_len,
            self.num_q_heads,
            s.kv_heads,
            s.head_dim,
            s.page_size,
            causal=True,
            sm_scale=self.scale,
            q_data_type=self.kv.model_dtype,
            kv_data_type=self.kv.dtype,
        )

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q [T, hq, hd]; k, v [T, hkv, hd]; cos, sin [T, hd]. Returns [T, hq, hd]."""
        cache = self.kv.layers[layer]
        q = cuda_ops.rope_and_store_kv(
            q, k, v, cos, sin, cache, self.write_pages, self.write_offsets, self.kv.scales(layer)
        )
        return self.wrapper.run(q, cache, **_scales(self.kv, layer))
