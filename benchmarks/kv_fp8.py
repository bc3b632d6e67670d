"""FP8 KV pages against bf16 pages on one GPU, same model, same run: the pages each pool
holds, decode tokens/s at batch 64 (and 1) at 4,096-token contexts, TTFT of a 2,048-token
prompt, and the logits' distance.

    python -m benchmarks.kv_fp8 --out DIR [--layers 32] [--context 4096]

The Llama-3.1-8B architecture with random bf16 weights drawn on the GPU (benchmarks/decode.py's
random_shard). Both pools are sized the same way (--kv-fraction of what is free after the
weights and reserves), so their page counts compare what fits. The FP8 run uses unit scales
(what `orbit serve --kv-dtype fp8` uses for a package without calibrated ones); the cache is
filled with N(0, 1) values first, as benchmarks/fp8.py does, so every step reads real numbers.
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
    fill_kv_randn,
    hf_config,
    measure_decode,
    measure_ttft,
    random_shard,
)
from benchmarks.fp8 import compare_runs, logits_for


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompts", default="2048")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--kv-fraction", type=float, default=0.9)
    p.add_argument("--fused-decode-max-bucket", type=int, default=None)
    args = p.parse_args(argv)
    from prepare.model_spec import model_spec_from_config
    from runtime.quant import KVQuant

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = model_spec_from_config(hf_config(args.layers), 1)
    tensors = random_shard(spec)
    torch.manual_seed(5)
    prompt = torch.randint(spec.vocab_size, (512,)).tolist()
    result = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    logits = {}
    longest = max(args.context + args.steps + 16, *map(int, args.prompts.split(",")))
    max_seq_len = 1 << (longest - 1).bit_length()
    runs = (("bf16", None), ("fp8", KVQuant.unit(spec.num_layers)), ("bf16_again", None))
    for name, kv_quant in runs:
        runner, start = build_runner(
            spec, tensors, args, kv_quant=kv_quant, max_seq_len=max_seq_len
        )
        fill_kv_randn(runner)
        r = {"start_up": start, "kv_pages": runner.kv_plan.num_pages}
        r["kv_page_bytes"] = runner.kv_plan.page_bytes
        r["decode"] = [
            measure_decode(runner, spec, tensors, int(b), args, 1.0, 1.0)
            for b in args.batches.split(",")
        ]
        for row in r["decode"]:  # decode.py's rooflines assume bf16 pages: not used here
            for key in ("roofline_tokens_per_s", "roofline_frac", "bound", "bytes_per_step"):
                row.pop(key)
        r["ttft"] = [
            measure_ttft(runner, spec, tensors, int(n), 1.0, 1.0)["ttft_ms"]
            for n in args.prompts.split(",")
        ]
        if name != "bf16_again":
            for layer in runner.kv.layers:
                layer.zero_()
            logits[name] = logits_for(runner, prompt, 16)
        result[name] = r
        print(name, json.dumps(r, indent=1), flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    compare_runs(result, logits, args.batches)
    result["pages_ratio"] = result["fp8"]["kv_pages"] / result["bf16"]["kv_pages"]
    (out / "kv-fp8.json").write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.items() if k not in ("bf16", "fp8", "bf16_again")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
