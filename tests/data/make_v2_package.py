"""Made once, by Orbit 0.1.0 (package format 2: FP8 weights), and kept: tests/test_old_formats.py
checks that every later Orbit still loads this package and computes the same logits as
transformers did, over the same weights dequantized, when it was made. Do not regenerate it for
a new format; add a new one beside it.

    python -m tests.data.make_v2_package
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "packages" / "v2-tiny-llama-fp8-tp2"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from prepare.build import PrepareOptions, prepare_package

    work = Path(tempfile.mkdtemp())
    vocab = {f"w{i}": i for i in range(64)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2").save_pretrained(
        work / "ckpt"
    )
    torch.manual_seed(8)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(work / "ckpt")
    shutil.rmtree(OUT, ignore_errors=True)
    prepare_package(
        work / "ckpt",
        OUT,
        PrepareOptions(
            tp=2, dtype="float32", max_batch=4, kv_page_size=4, max_step_tokens=32, quantize="fp8"
        ),
        progress=False,
    )
    with torch.no_grad():  # the reference runs the FP8 weights, dequantized: each row / (448 / max)
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in LINEARS:
                s = (p.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
                p.copy_((p / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)
        prompt = [1, 17, 5, 42, 9, 33, 60, 3]
        logits = model(torch.tensor([prompt])).logits[0, -1]
    (HERE / "packages" / "v2-tiny-llama-fp8-tp2.reference.json").write_text(
        json.dumps({"prompt": prompt, "last_logits": logits.tolist()})
    )
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
