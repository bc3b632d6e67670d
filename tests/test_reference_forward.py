"""The prepared package through the reference TP forward matches transformers (float32)."""

from __future__ import annotations

import pytest
import torch

from tests.tp_harness import run_tp

MAX_NEW = 32


def _reference(checkpoint, prompts, gguf=None):
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf} if gguf else {}
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, **kw).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(ids).logits[0, -1]
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
            )
            out.append((logits, gen[0, len(p) :].tolist()))
    return out


def _prompts(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    texts = ["The capital of France is", "Tensor parallelism splits every layer " * 5]
    return [tok(t).input_ids for t in texts]


def _check(results, reference):
    for got, (ref_logits, ref_ids) in zip(results, reference):
        logits = torch.tensor(got["logits"])
        rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        assert rel <= 1e-4, f"relative logit error {rel:.2e}"
        assert got["ids"] == ref_ids


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_family_matches_transformers(
    family, tiny_checkpoints, tokenizer_dir, package_cache, tmp_path
):
    ckpt = tiny_checkpoints[family]
    prompts = _prompts(tokenizer_dir)
    reference = _reference(ckpt, prompts)
    for tp in (1, 2):
        pkg = package_cache(ckpt, tp, max_batch=4, kv_page_size=8)
        _check(run_tp(pkg, tp, prompts, MAX_NEW, chunk=7, tmp=tmp_path), reference)


def test_smollm2_gguf_matches_transformers(smollm2_path, package_cache, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    prompts = [tok("The capital of France is").input_ids]
    reference = _reference(smollm2_path.parent, prompts, gguf=smollm2_path.name)
    for tp in (1, 3):
        pkg = package_cache(smollm2_path, tp, max_batch=4, max_seq_len=512)
        _check(run_tp(pkg, tp, prompts, MAX_NEW, chunk=4, tmp=tmp_path), reference)
