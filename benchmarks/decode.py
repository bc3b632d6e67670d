"""Decode throughput and time to first token of one rank on one GPU, against rooflines
measured in the same run and against transformers' generate() at batch 1 on the same GPU.

    python -m benchmarks.decode --out DIR            # Llama-3.1-8B architecture, random bf16
    python -m benchmarks.decode --shape smollm2 --batches 1,4,24 --prompts 128 --hf-tokens 0 \
        --profile --out DIR                          # SmolLM2-135M's shapes (issue 19's copy runs)

The model is built from a config alone: transformers' model (random init) for the generate()
baseline, then Orbit's shard tensors, shaped by runtime/layout.py as a package's rank-0 shard
is, drawn at random in GPU memory (writing and hashing 16 GB of safetensors would only add
minutes; Package.load_shard(rank, "cuda") is the loading path a rank uses). The rank-level
runner (runtime/cuda_runner.py) is driven as a rank drives it: SeqInput steps, greedy argmax
fed back each step: this measures one rank alone. What the frontend adds (scheduler, ZeroMQ,
the rank's own staging) is measured through the engine by benchmarks/step_overhead.py, on the
same model written as a package by benchmarks/random_package.py.

Rooflines: a decode step must read every weight once (all but the embedding table, of which
it reads one row per sequence) plus each sequence's KV, and write the float32 logits; over the
device-to-device copy bandwidth measured here (bytes read + written per second) that gives the
memory floor; FLOPs (2 per weight per token, plus attention) over the measured bf16 matmul rate
give the compute floor; the roofline is the larger. Prefill likewise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from runtime.runner import SeqInput

LLAMA_31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

# SmolLM2-135M-Instruct's architecture (its GGUF's metadata): the model of issue 19's copy-heavy
# runs, whose steps are bound by kernel launches and latency, not by bytes.
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
SHAPES = {"llama-8b": LLAMA_31_8B, "smollm2": SMOLLM2_135M}


def parse_args(argv):
    from runtime.cuda_runner import CudaRunnerOptions

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="the architecture")
    p.add_argument("--layers", type=int, default=0, help="fewer for a quick check (0: all)")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--prompts", default="128,512,2048", help="TTFT prompt lengths")
    p.add_argument("--context", type=int, default=512, help="tokens in each sequence's cache")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch")
    p.add_argument("--hf-tokens", type=int, default=32, help="generate() tokens timed; 0 skips it")
    p.add_argument("--kv-fraction", type=float, default=0.9)
    p.add_argument("--profile", action="store_true", help="write per-kernel times")
    p.add_argument(
        "--mixed-fa2-min-rows",
        type=int,
        default=CudaRunnerOptions.mixed_fa2_min_rows,
        help="steps of at least this many decode rows beside prompt chunks replay FA2 graphs "
        "(runtime/cuda_runner.py CudaRunnerOptions.mixed_fa2_min_rows; 0: FA3 graphs only)",
    )
    p.add_argument(
        "--mixed",
        default="",
        help="also time a step of this many decode rows (comma-separated counts) at --context "
        "beside prompt chunks filling the 2,048-token budget, against the same chunks alone "
        "and the rows alone (issue 16's steps under load); --batches must reach the count",
    )
    p.add_argument(
        "--fused-decode-max-bucket",
        type=int,
        default=None,
        help="decode buckets attending through Orbit's fused kernel (0: FlashInfer's only; "
        "default: the runner's, CudaRunnerOptions)",
    )
    p.add_argument(
        "--cublas-few-rows",
        action="store_true",
        help="the baseline: products of 2 to 64 rows through cuBLAS, not Orbit's kernels",
    )
    p.add_argument(
        "--late-few-rows",
        action="store_true",
        help="the baseline: few-rows products of small weights launched plainly, not early "
        "(runtime/cuda_ops.py EARLY_LAUNCH_WEIGHTS = 0)",
    )
    p.add_argument(
        "--split-rows",
        type=int,
        default=0,
        help="products of 33 to this many rows (64 at most; 32: none) through the split-K "
        "kernel, bf16 and FP8 alike (runtime/cuda_ops.py SPLIT_ROWS, FP8_SPLIT_ROWS; 0: as "
        "the code has it)",
    )
    p.add_argument(
        "--prefix-attention-max-tokens",
        type=int,
        default=CudaRunnerOptions.prefix_attention_max_tokens,
        help="token buckets of at most this many tokens also get a graph attending through "
        "Orbit's split-context kernel, replayed for one sequence over a long context "
        "(runtime/cuda_runner.py CudaRunnerOptions.prefix_attention_max_tokens; issue 18's "
        "cached turn; 0: off)",
    )
    p.add_argument(
        "--prefill-backend",
        choices=["auto", "fa2"],
        default="auto",
        help="FlashInfer's paged prefill (graphs and eager): auto is the runtime's choice (FA3 "
        "on Hopper over bf16 pages); fa2 its FA2 kernels, which split a long context over "
        "several CTAs (issue 18's cached turn: 64 query tokens over 2,048 cached)",
    )
    return p.parse_args(argv)


def use_prefill_backend(backend: str) -> None:
    """Every FlashInfer prefill wrapper built from now on takes `backend` (not "auto")."""
    from runtime import cuda_attention

    cuda_attention.prefill_backend = lambda device, kv_quant: backend


def use_cublas_for_few_rows() -> None:
    """Products of more than one row through cuBLAS, as before runtime/cuda_ops.py's few-rows
    kernel (and its split-K kernel, when on): the same run's baseline for them."""
    from runtime import cuda_ops

    cuda_ops.HALF_FEW_ROWS = cuda_ops.SPLIT_ROWS = cuda_ops.FP8_SPLIT_ROWS = 1


def use_split_k_up_to(rows: int) -> None:
    """Products of 33 to `rows` rows through the split-K kernel, bf16 and FP8 alike, for a run
    to time against the code's choice (cuBLAS for bf16, split-K for FP8); `rows` 32: none
    (the few-rows kernel for FP8)."""
    from runtime import cuda_ops

    if not cuda_ops.HALF_FEW_ROWS <= rows <= 64:
        raise SystemExit(f"--split-rows must be in {cuda_ops.HALF_FEW_ROWS}..64, got {rows}")
    cuda_ops.SPLIT_ROWS = cuda_ops.FP8_SPLIT_ROWS = rows


# ---- ceilings measured in this run ------------------------------------------------------


def median_ms(fn, iters: int = 20) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB of float32
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms / 1e3)


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 matrix product on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms / 1e3)


# ---- the model --------------------------------------------------------------------------


def shape_config(shape: str = "llama-8b", layers: int = 0) -> dict:
    """The architecture's config, with `layers` layers where that is not 0."""
    config = SHAPES[shape]
    return {**config, "num_hidden_layers": layers or config["num_hidden_layers"]}


def hf_config(layers: int = 0, shape: str = "llama-8b"):
    from transformers import LlamaConfig

    return LlamaConfig(**shape_config(shape, layers))


def transformers_generate_rate(config, new_tokens: int) -> float:
    """Decode tokens/s of transformers' generate() at batch 1 (greedy, default cache), from
    the difference of a 1-token and an (n+1)-token call after a 128-token prompt; NaN for
    n = 0 (skipped: loading the reference takes a minute of a short device lease)."""
    if new_tokens == 0:
        return float("nan")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.randint(config.vocab_size, (1, 128), device="cuda")
    _generate_s(model, ids, 4)  # warm-up
    rate = new_tokens / (_generate_s(model, ids, new_tokens + 1) - _generate_s(model, ids, 1))
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rate


def _generate_s(model, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def random_shard(spec) -> dict[str, torch.Tensor]:
    """Rank 0's shard tensors (runtime/layout.py shapes), random bf16 on the GPU."""
    from runtime.layout import shard_shapes

    torch.manual_seed(0)
    out = {}
    for name, shape in shard_shapes(spec, 1).items():
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        out[name] = t.normal_(1.0, 0.1) if "norm" in name else t.normal_(0.0, 0.02)
    return out


def build_runner(spec, tensors, args, quant=None, kv_quant=None, max_seq_len=4096):
    from runtime.cuda_runner import CudaGraphRunner, CudaRunnerOptions
    from runtime.layers import TPGroup
    from runtime.model import build_model
    from runtime.spec import Capacities, default_decode_buckets, default_prefill_chunks

    max_batch = max(int(b) for b in args.batches.split(","))
    caps = Capacities(
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        kv_page_size=16,
        decode_batch_buckets=default_decode_buckets(max_batch),
        prefill_chunk_sizes=default_prefill_chunks(2048),
    )
    model = build_model(spec, tensors, TPGroup(), caps.max_seq_len, "cuda", quant)
    t0 = time.perf_counter()
    options = CudaRunnerOptions(
        kv_fraction=args.kv_fraction,
        fused_decode_max_bucket=CudaRunnerOptions.fused_decode_max_bucket
        if args.fused_decode_max_bucket is None
        else args.fused_decode_max_bucket,
        exact_verify_max_bucket=getattr(args, "exact_verify_max_bucket", 0),
        kv_quant=kv_quant,
        mixed_fa2_min_rows=getattr(
            args, "mixed_fa2_min_rows", CudaRunnerOptions.mixed_fa2_min_rows
        ),
        prefix_attention_max_tokens=getattr(
            args, "prefix_attention_max_tokens", CudaRunnerOptions.prefix_attention_max_tokens
        ),
    )
    runner = CudaGraphRunner(model, caps, options)
    t1 = time.perf_counter()
    runner.capture()
    t2 = time.perf_counter()
    return runner, {"size_and_warm_up_s": t1 - t0, "capture_s": t2 - t1}


def fill_kv_randn(runner) -> None:
    """N(0, 1) values into every KV page, bf16 or FP8 (which takes no normal_()), a slice at a
    time: a bf16 temporary of a whole layer may not fit beside a large pool."""
    for layer in runner.kv.layers:
        for part in layer.split(1024):
            part.copy_(torch.randn(part.shape, device=part.device, dtype=torch.bfloat16))


# ---- measurements -----------------------------------------------------------------------


def weight_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "embed.weight")


def kv_bytes_per_token(spec) -> int:
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2


def measure_decode(runner, spec, tensors, batch: int, args, bw: float, flops: float) -> dict:
    ps = runner.page_size
    per_seq = -(-(args.context + args.steps + 8) // ps)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    tokens = torch.randint(spec.vocab_size, (batch,)).tolist()

    def one(pos: int) -> None:
        nonlocal tokens
        logits = runner.step([SeqInput([t], pos, tab, True) for t, tab in zip(tokens, tables)])
        tokens = logits.argmax(dim=-1).tolist()

    for s in range(8):
        one(args.context + s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(args.steps):
        one(args.context + 8 + s)
    loop_s = (time.perf_counter() - t0) / args.steps
    bucket = next(b for b in runner.buckets if b >= batch)
    graph_s = median_ms(runner.last_decode_graph(bucket).replay, 50) / 1e3
    avg_ctx = args.context + 8 + args.steps / 2
    mem_bytes = (
        weight_bytes(tensors)
        + batch * avg_ctx * kv_bytes_per_token(spec)
        + batch * spec.vocab_size * 4
    )
    params = weight_bytes(tensors) / 2  # bf16
    step_flops = batch * (
        2 * params + 4 * avg_ctx * spec.num_heads * spec.head_dim * spec.num_layers
    )
    floor_s = max(mem_bytes / bw, step_flops / flops)
    return {
        "batch": batch,
        "bucket": bucket,
        "context": args.context,
        "tokens_per_s": batch / loop_s,
        "step_ms": loop_s * 1e3,
        "graph_replay_ms": graph_s * 1e3,
        "host_overhead_frac": max(0.0, 1 - graph_s / loop_s),
        "roofline_tokens_per_s": batch / floor_s,
        "roofline_frac": floor_s / loop_s,
        "bound": "memory" if mem_bytes / bw >= step_flops / flops else "compute",
        "bytes_per_step": mem_bytes,
    }


def measure_ttft(runner, spec, tensors, length: int, bw: float, flops: float) -> dict:
    """Time to the first token's logits of one `length`-token prompt: through the prefill
    graphs (what serving runs) and, for comparison, the eager unpadded path."""
    pages = list(range(-(-length // runner.page_size)))
    prompt = torch.randint(spec.vocab_size, (length,)).tolist()

    def median_s(step) -> float:
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            int(step([SeqInput(prompt, 0, pages, True)])[0].argmax())
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    ttft, eager = median_s(runner.step), median_s(runner.step_eager)
    attn = 2 * length * length * spec.head_dim * spec.num_heads * spec.num_layers
    lm_head = spec.padded_vocab_size * spec.hidden_size * 2  # bf16 bytes of the LM head
    params = (weight_bytes(tensors) - lm_head) / 2  # bf16; the LM head runs for one token
    prefill_flops = 2 * params * length + attn
    floor = max(prefill_flops / flops, weight_bytes(tensors) / bw)
    return {
        "prompt_tokens": length,
        "ttft_ms": ttft * 1e3,
        "eager_ttft_ms": eager * 1e3,
        "roofline_ms": floor * 1e3,
        "roofline_frac": floor / ttft,
    }


def decode_graph_profiles(runner, batches: str) -> list[str]:
    """Per-kernel GPU time of the decode graphs that hold these batches (comma-separated),
    5 replays each, over the inputs of the last measured step."""
    from torch.profiler import ProfilerActivity, profile

    parts = []
    sizes = sorted({int(b) for b in batches.split(",")})
    buckets = dict.fromkeys(next(b for b in runner.buckets if b >= n) for n in sizes)
    for bucket in buckets:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.last_decode_graph(bucket).replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        parts.append(f"decode graph, bucket {bucket}, 5 replays\n{table}")
    return parts


def profile_text(runner, spec, tensors, args) -> str:
    """Per-kernel GPU time of the measured batches' decode graphs (their inputs are the last
    measured step's), CPU + GPU time of one 128-token prefill step (graph replay and the
    eager LM head), and the steps of `_profiled_steps`."""
    from torch.profiler import ProfilerActivity, profile

    parts = decode_graph_profiles(runner, args.batches)
    prompt = torch.randint(spec.vocab_size, (128,)).tolist()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step([SeqInput(prompt, 0, list(range(8)), True)])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    parts.append(f"prefill, 128 tokens\n{table}")
    for name, seq in _profiled_steps(runner, spec):
        parts.append(_step_profile(runner, name, seq, profile, ProfilerActivity))
    return "\n\n".join(parts)


def _profiled_steps(runner, spec) -> list[tuple[str, SeqInput]]:
    """One-sequence steps whose GPU time is a target's floor: issue 18's cached request (64
    new tokens over a 2,048-token prefix already in the cache), the same 64 tokens alone, and
    issue 19's verification row (the last token and 16 proposals at position 512)."""

    def seq(new: int, cached: int, num_samples: int = 1) -> SeqInput:
        pages = list(range(-(-(cached + new) // runner.page_size)))
        ids = torch.randint(spec.vocab_size, (new,)).tolist()
        return SeqInput(ids, cached, pages, True, num_samples=num_samples)

    return [
        ("64 new tokens after 2,048 cached", seq(64, 2048)),
        ("64 tokens alone", seq(64, 0)),
        ("verification row of 17 tokens at 512", seq(17, 512, 17)),
    ]


def _step_profile(runner, name: str, seq: SeqInput, profile, activity) -> str:
    """A step's wall time and GPU time (CUDA events around runner.step, median of 10: staging
    and attention planning included), then its kernels over 5 more steps."""
    t = _step_ms(runner, [seq])
    head = f"{name}: wall {t['wall_ms']:.3f} ms, CUDA events {t['gpu_ms']:.3f} ms"
    if len(seq.token_ids) > 1 and seq.num_samples == 1:  # a prefill step: its host staging
        tokens = next(b for b in runner.prefill_buckets if b >= len(seq.token_ids))
        attn, plans = runner._prefill_attn[tokens], []
        for _ in range(11):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():  # as runner.step stages: its buffers are inference tensors
                runner._plan_prefill_graph([seq], tokens, attn)  # stage and plan, no replay
            plans.append(time.perf_counter() - t0)
        head += (
            f", of which staging + FlashInfer's plan {statistics.median(plans[1:]) * 1e3:.3f} ms"
        )
    with profile(activities=[activity.CUDA]) as prof:
        for _ in range(5):
            runner.step([seq])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    return f"{head}; 5 steps\n{table}"


def _step_ms(runner, seqs: list[SeqInput]) -> dict:
    """Median wall and CUDA-event time of runner.step(seqs) over 10 steps after one."""
    walls, gpus = [], []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        runner.step(seqs)
        end.record()
        end.synchronize()
        walls.append(time.perf_counter() - t0)
        gpus.append(start.elapsed_time(end) / 1e3)
    return {
        "wall_ms": statistics.median(walls[1:]) * 1e3,
        "gpu_ms": statistics.median(gpus[1:]) * 1e3,
    }


def measure_mixed(runner, spec, rows: int, context: int, budget: int = 2048) -> dict:
    """A step as chunked prefill builds them under load: `rows` decode rows at `context`
    tokens beside 448-token prompt chunks filling the rest of the token budget, timed against
    the chunks alone and the rows alone (each a step of its own)."""
    ps = runner.page_size
    chunk = 448
    prompts = (budget - rows) // chunk
    per_row, per_prompt = -(-(context + 1) // ps), -(-chunk // ps)
    decode = [
        SeqInput([int(t)], context, list(range(i * per_row, (i + 1) * per_row)), True)
        for i, t in enumerate(torch.randint(spec.vocab_size, (rows,)))
    ]
    first = rows * per_row
    chunks = [
        SeqInput(
            torch.randint(spec.vocab_size, (chunk,)).tolist(),
            0,
            list(range(first + i * per_prompt, first + (i + 1) * per_prompt)),
            True,
        )
        for i in range(prompts)
    ]
    result = {
        "decode_rows": rows,
        "context": context,
        "prompt_chunks": f"{prompts} x {chunk}",
        "mixed": _step_ms(runner, decode + chunks),
        "chunks_alone": _step_ms(runner, chunks),
        "rows_alone": _step_ms(runner, decode),
    }
    apart = result["chunks_alone"]["gpu_ms"] + result["rows_alone"]["gpu_ms"]
    result["mixed_over_apart_gpu"] = result["mixed"]["gpu_ms"] / apart
    return result


def print_table(result: dict) -> None:
    hf = result["transformers_generate_batch1_tokens_per_s"]
    print(
        f"\ncopy bandwidth {result['copy_bandwidth_TBps']:.2f} TB/s, bf16 matmul "
        f"{result['matmul_TFLOPs']:.0f} TFLOP/s, transformers generate() batch 1: {hf:.1f} tok/s"
    )
    print(
        f"{'batch':>5} {'tok/s':>9} {'roofline':>9} {'of roof':>7} {'bound':>7} {'step ms':>8} "
        f"{'graph ms':>8} {'host':>6} {'x HF b1':>8}"
    )
    for d in result["decode"]:
        print(
            f"{d['batch']:>5} {d['tokens_per_s']:>9.1f} {d['roofline_tokens_per_s']:>9.1f} "
            f"{d['roofline_frac']:>7.1%} {d['bound']:>7} {d['step_ms']:>8.2f} "
            f"{d['graph_replay_ms']:>8.2f} {d['host_overhead_frac']:>6.1%} "
            f"{d['tokens_per_s'] / hf:>8.1f}"
        )
    print(f"{'prompt':>6} {'TTFT ms':>8} {'roofline':>8} {'of roof':>7} {'eager ms':>8}")
    for t in result["ttft"]:
        print(
            f"{t['prompt_tokens']:>6} {t['ttft_ms']:>8.2f} {t['roofline_ms']:>8.2f} "
            f"{t['roofline_frac']:>7.1%} {t['eager_ttft_ms']:>8.2f}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cublas_few_rows:
        use_cublas_for_few_rows()
    if args.split_rows:
        use_split_k_up_to(args.split_rows)
    if args.prefill_backend != "auto":
        use_prefill_backend(args.prefill_backend)
    from prepare.model_spec import model_spec_from_config
    from runtime import cuda_ops

    if args.late_few_rows:
        cuda_ops.EARLY_LAUNCH_WEIGHTS = 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(args.layers, args.shape)
    spec = model_spec_from_config(config, 1)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "config": shape_config(args.shape, args.layers),
        "args": vars(args),
    }
    bw, flops = copy_bandwidth(), matmul_rate()
    result.update(copy_bandwidth_TBps=bw / 1e12, matmul_TFLOPs=flops / 1e12)
    result["transformers_generate_batch1_tokens_per_s"] = transformers_generate_rate(
        config, args.hf_tokens
    )
    tensors = random_shard(spec)
    runner, result["start_up"] = build_runner(spec, tensors, args)
    result["weight_bytes"] = weight_bytes(tensors)
    result["kv_pool"] = {
        "num_pages": runner.kv_plan.num_pages,
        "pool_GiB": runner.kv_plan.pool_bytes / 2**30,
        "reserve_GiB": runner.kv_plan.reserve_bytes / 2**30,
    }
    for layer in runner.kv.layers:  # never time attention over zeros
        layer.normal_()
    result["decode"] = [
        measure_decode(runner, spec, tensors, int(b), args, bw, flops)
        for b in args.batches.split(",")
    ]
    result["ttft"] = [
        measure_ttft(runner, spec, tensors, int(n), bw, flops) for n in args.prompts.split(",")
    ]
    if args.mixed:
        result["mixed"] = [
            measure_mixed(runner, spec, int(rows), args.context) for rows in args.mixed.split(",")
        ]
        print(json.dumps(result["mixed"], indent=1))
    (out / "decode.json").write_text(json.dumps(result, indent=2))
    if args.profile:
        (out / "profile.txt").write_text(profile_text(runner, spec, tensors, args))
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
