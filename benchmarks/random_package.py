"""Write the benchmark's model (Llama-3.1-8B architecture, random bf16 weights, no download) as
an Orbit package, through the path users take: a Hugging Face checkpoint, then `orbit prepare`.

    python -m benchmarks.random_package --out DIR --tokenizer TOKENIZER_DIR [--layers 32]
        [--max-batch 64] [--quantize fp8] [--kv-dtype fp8]

The tokenizer only has to be a saved Hugging Face tokenizer (the benchmarks feed token ids
directly, so its vocabulary need not match the model's). The checkpoint is written next to the
package and removed afterwards; weights are drawn on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.decode import hf_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=64, help="the package's largest decode batch")
    p.add_argument("--hidden-size", type=int, default=0, help="0: the 8B's (a draft: smaller)")
    p.add_argument("--intermediate-size", type=int, default=0, help="0: the 8B's")
    p.add_argument("--heads", type=int, default=0, help="query heads; 0: the 8B's")
    p.add_argument("--quantize", default="", choices=["", "fp8"], help="orbit prepare --quantize")
    p.add_argument("--kv-dtype", default="", choices=["", "fp8"], help="orbit prepare --kv-dtype")
    p.add_argument("--prefill-buckets", default="", help="orbit prepare --prefill-buckets")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer, LlamaForCausalLM

    from prepare.build import PrepareOptions, prepare_package

    t0 = time.perf_counter()
    ckpt = args.out.with_name(args.out.name + ".checkpoint")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = hf_config(args.layers)
    if args.hidden_size:  # the 8B's vocabulary and KV heads, narrower: a draft for it
        config.hidden_size = args.hidden_size
        config.intermediate_size = args.intermediate_size or 4 * args.hidden_size
        config.num_attention_heads = args.heads or config.num_attention_heads
        config.head_dim = args.hidden_size // config.num_attention_heads
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    for name, param in model.named_parameters():  # small weights keep activations finite
        if "norm" not in name:
            param.data.normal_(0.0, 0.02)
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(ckpt)
    del model
    t1 = time.perf_counter()
    opts = PrepareOptions(
        tp=args.tp, dtype="bfloat16", max_seq_len=4096, max_batch=args.max_batch,
        quantize=args.quantize, kv_dtype=args.kv_dtype,
        prefill_buckets=tuple(int(b) for b in args.prefill_buckets.split(",") if b),
    )  # fmt: skip
    prepare_package(ckpt, args.out, opts, progress=False)
    shutil.rmtree(ckpt)
    print(f"checkpoint {t1 - t0:.0f} s, prepare {time.perf_counter() - t1:.0f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
