"""FP8 weights against bf16 on one GPU, same model, same run: decode tokens/s at batch 1 and
64, TTFT of a 2,048-token prompt, the logits' distance, and a tile sweep of the FP8 GEMV.

    python -m benchmarks.fp8 --out DIR [--layers 32] [--scheme fp8-channel|fp8-block] [--kv8]

The Llama-3.1-8B architecture with random weights drawn on the GPU (benchmarks/decode.py's
random_shard); its linear layers are quantized to FP8 (runtime/quant.py, as `orbit prepare
--quantize fp8` does) and the bf16 baseline runs the *dequantized* weights, so both compute
the same function and their logits can be compared: the bf16 runner is the dequantized-bf16
reference. Rooflines use the copy bandwidth measured here over each model's weight bytes.
With --kv8 two more runs take the FP8 weights over FP8 KV pages (unit scales, as `orbit serve
--kv-dtype fp8` without calibrated ones), the whole FP8 deployment against bf16: fp8_kv8_tc
with FlashInfer's tensor-core decode kernels, fp8_kv8_cudacore with its CUDA-core ones
(cuda_attention.FP8_DECODE_TENSOR_CORES); their rooflines still count bf16 pages.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from benchmarks.decode import (
    build_runner,
    copy_bandwidth,
    decode_graph_profiles,
    fill_kv_randn,
    hf_config,
    matmul_rate,
    measure_decode,
    measure_ttft,
    random_shard,
    use_split_k_up_to,
)
from runtime.runner import SeqInput

LINEARS = ("qkv", "o", "gate_up", "down")


def fp8_shard(tensors: dict, scheme: str):
    """(the FP8 shard, the bf16 shard of its dequantized weights, the WeightQuant)."""
    from runtime.quant import WeightQuant, dequantize, quantize

    quant = WeightQuant(scheme, (128, 128) if scheme == "fp8-block" else (0, 0))
    fp8, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w8, scale = quantize(t, quant)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale"] = w8, scale
            deq[name] = dequantize(w8, scale).to(torch.bfloat16)
            del w8, scale
        else:
            fp8[name] = deq[name] = t
    return fp8, deq, quant


def logits_for(runner, prompt: list[int], steps: int) -> torch.Tensor:
    """Prefill logits of the prompt's last 1 token and `steps` teacher-forced decode steps."""
    pages = list(range(-(-(len(prompt) + steps) // runner.page_size)))
    rows = [runner.step([SeqInput(prompt, 0, pages, True)])[0]]
    for t in range(steps):
        token = prompt[t % len(prompt)]
        rows.append(runner.step([SeqInput([token], len(prompt) + t, pages, True)])[0])
    return torch.stack(rows).float().cpu()


def compare_runs(result: dict, logits: dict, batches: str) -> None:
    """Into result: the FP8 run's logits against the bf16 run's (relative distance of the
    prefill row and of the decode rows, greedy agreement) and its decode speedup per batch
    over the slower of the two bf16 runs ("bf16", "bf16_again")."""
    diff = logits["fp8"] - logits["bf16"]
    result["logits_rel_error"] = {
        "prefill_row": (diff[0].norm() / logits["bf16"][0].norm()).item(),
        "decode_rows": (diff[1:].norm() / logits["bf16"][1:].norm()).item(),
        "greedy_agree": (logits["fp8"].argmax(-1) == logits["bf16"].argmax(-1))
        .float()
        .mean()
        .item(),
    }
    for i, b in enumerate(batches.split(",")):
        base = min(result[k]["decode"][i]["tokens_per_s"] for k in ("bf16", "bf16_again"))
        result[f"speedup_batch{b}"] = result["fp8"]["decode"][i]["tokens_per_s"] / base
        for name in [k for k in result if k.startswith("fp8_kv8")]:
            result[f"speedup_{name}_batch{b}"] = result[name]["decode"][i]["tokens_per_s"] / base


def _graph_us(fn, launches: int = 20) -> float:
    """Microseconds per launch of fn, launched `launches` times inside one CUDA graph (so the
    host's launch cost, which exceeds a small GEMV's time, is out of the measurement)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * launches)


TILES = [(1, 8, 4), (2, 8, 2), (2, 8, 4), (2, 16, 2), (4, 8, 2), (4, 16, 2), (2, 4, 4)]


def gemv_sweep(bw: float) -> list[dict]:
    """Each tile of the one-row GEMV over the 8B shapes, FP8 (per-row scales) and bf16, timed
    inside CUDA graphs: GB/s of weights read and the fraction of the copy bandwidth."""
    from runtime import triton_kernels
    from runtime.quant import FP8

    out = []
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        for dtype in (FP8, torch.bfloat16):
            w = torch.randn(n, k, device="cuda").to(dtype)
            scale = torch.rand(n, device="cuda") if dtype == FP8 else None
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            for tile in TILES:
                try:
                    us = _graph_us(
                        lambda: triton_kernels.gemv_rows(x, w, None, y, tile, w_scale=scale)
                    )
                except Exception as e:  # a tile that does not compile (registers) is skipped
                    out.append(
                        {"n": n, "k": k, "dtype": str(dtype), "tile": tile, "error": str(e)[:80]}
                    )
                    continue
                nbytes = n * k * w.element_size()
                out.append(
                    {
                        "n": n,
                        "k": k,
                        "dtype": str(dtype),
                        "tile": tile,
                        "us": us,
                        "of_copy": nbytes / (us * 1e-6) / bw,
                    }
                )
            del w
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--scheme", default="fp8-channel", choices=["fp8-channel", "fp8-block"])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompts", default="2048")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--kv-fraction", type=float, default=0.3)
    p.add_argument("--fused-decode-max-bucket", type=int, default=None)
    p.add_argument("--sweep", action="store_true", help="also the FP8 GEMV tile sweep")
    p.add_argument("--sweep-only", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="per-kernel times of each run's decode graphs (profile-bf16.txt, profile-fp8.txt)",
    )
    p.add_argument(
        "--split-rows",
        type=int,
        default=0,
        help="products of 33 to this many rows through the split-K kernel, bf16 and FP8 alike "
        "(32: none, FP8 through the few-rows kernel; 0: as the code has it)",
    )
    p.add_argument(
        "--unfused-quantize",
        action="store_true",
        help="FP8 products of many rows quantize their input in a launch of its own "
        "(cuda_ops.FUSE_QUANTIZE off), for a run to time the fusion against",
    )
    p.add_argument(
        "--kv8",
        action="store_true",
        help="two more runs: the FP8 weights over FP8 KV pages, tensor-core and CUDA-core decode",
    )
    args = p.parse_args(argv)
    if args.split_rows:
        use_split_k_up_to(args.split_rows)
    if args.unfused_quantize:
        from runtime import cuda_ops

        cuda_ops.FUSE_QUANTIZE = False
    from prepare.model_spec import model_spec_from_config
    from runtime import cuda_attention
    from runtime.quant import KVQuant

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = model_spec_from_config(hf_config(args.layers), 1)
    bw, flops = copy_bandwidth(), matmul_rate()
    result = {"device": torch.cuda.get_device_name(), "args": vars(args), "copy_TBps": bw / 1e12}
    if args.sweep_only:
        for row in gemv_sweep(bw):
            print(row)
        return 0
    fp8, deq, quant = fp8_shard(random_shard(spec), args.scheme)
    torch.manual_seed(5)
    prompt = torch.randint(spec.vocab_size, (512,)).tolist()
    logits = {}
    runs = [("bf16", deq, None, None), ("fp8", fp8, quant, None), ("bf16_again", deq, None, None)]
    if args.kv8:
        kv8 = KVQuant.unit(spec.num_layers)
        runs[2:2] = [("fp8_kv8_tc", fp8, quant, kv8), ("fp8_kv8_cudacore", fp8, quant, kv8)]
    tensor_cores = cuda_attention.FP8_DECODE_TENSOR_CORES
    for name, tensors, q, kv_quant in runs:
        cuda_attention.FP8_DECODE_TENSOR_CORES = (
            name.endswith("_tc") if name.startswith("fp8_kv8") else tensor_cores
        )
        runner, start = build_runner(spec, tensors, args, quant=q, kv_quant=kv_quant)
        fill_kv_randn(runner)
        r = {"start_up": start, "weight_GB": _weight_bytes(tensors) / 1e9}
        r["kv_pages"] = runner.kv_plan.num_pages
        r["decode"] = [
            measure_decode(runner, spec, tensors, int(b), args, bw, flops)
            for b in args.batches.split(",")
        ]
        if args.profile and name != "bf16_again":  # before other steps change its inputs
            text = "\n\n".join(decode_graph_profiles(runner, args.batches))
            (out / f"profile-{name}.txt").write_text(text)
        r["ttft"] = [
            measure_ttft(runner, spec, tensors, int(n), bw, flops) for n in args.prompts.split(",")
        ]
        if name in ("bf16", "fp8"):
            logits[name] = logits_for(runner, prompt, 16)
        result[name] = r
        print(name, json.dumps(r, indent=1), flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    compare_runs(result, logits, args.batches)
    if args.sweep:
        del fp8, deq
        gc.collect()
        torch.cuda.empty_cache()
        result["gemv_sweep"] = gemv_sweep(bw)
    (out / f"fp8-{args.scheme}.json").write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k not in ("bf16", "fp8", "bf16_again", "gemv_sweep")
                and not k.startswith("fp8_kv8_")
            },
            indent=1,
        )
    )
    for row in result.get("gemv_sweep", []):
        print(row)
    return 0


def _weight_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n != "embed.weight")


if __name__ == "__main__":
    sys.exit(main())
