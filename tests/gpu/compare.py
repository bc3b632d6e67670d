"""Comparisons shared by the GPU tests, and the tolerance they hold the CUDA path to."""

from __future__ import annotations

import copy
import random

import torch

from tests.gpu import steps

BF16_REL_TOL = 1e-2  # relative logit error of a bf16 path against another implementation


def bf16_bounds(errors: dict[str, float]) -> tuple[float, float]:
    """(bound on Orbit vs float32, bound on Orbit vs transformers bf16): 1e-2, or, on a model
    where transformers' own bf16 logits already sit further than that from its float32 ones
    (deep random-weight models), as accurate as transformers (1.25x its error) and within two
    independent bf16 errors of it."""
    own = errors["transformers_bf16_vs_fp32"]
    return max(BF16_REL_TOL, 1.25 * own), max(BF16_REL_TOL, 2 * own)


PROMPT_LENS = (200, 77, 131)


def random_prompts(vocab: int, lengths=PROMPT_LENS, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@torch.no_grad()
def transformers_logits(hf, sequences, dtype) -> list[torch.Tensor]:
    """transformers on the GPU in `dtype`, over the weights rounded to bf16 (Orbit's). Only
    the parameters are cast: model.to(bfloat16) would also round the RoPE inverse
    frequencies (a buffer), which moves every angle by up to position * 2^-9 rad."""
    model = copy.deepcopy(hf)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).to(dtype)
    model.to("cuda")
    return [model(torch.tensor([s], device="cuda")).logits[0].float().cpu() for s in sequences]


def check_greedy(gpu, ref, gpu_logits, ref_logits, tol: float = BF16_REL_TOL) -> int:
    """Asserts the bf16 bound over the steps and that the first divergence (if any) is a
    near-tie of the reference; returns how many leading tokens agree."""
    assert steps.rel_error(torch.stack(gpu_logits), torch.stack(ref_logits)) <= tol
    agree = next((t for t, (a, b) in enumerate(zip(gpu, ref)) if a != b), len(gpu))
    if agree < len(gpu):
        g, r = gpu_logits[agree], ref_logits[agree]
        margin = (r[ref[agree]] - r[gpu[agree]]).item()
        assert margin <= 2 * (g - r).abs().max().item(), "greedy diverged without a near-tie"
    return agree


def logits_vs_transformers(hf, spec, runner, num_new: int, seed: int) -> dict[str, float]:
    """Three prompts prefilled in shared chunks, then num_new teacher-forced decode steps in
    one batch. Relative error ||ours - ref|| / ||ref|| over all those logit rows together
    (and the worst single row) against transformers in bf16 and in float32 (both over Orbit's
    bf16 weights), and of transformers bf16 against float32: the spread any bf16
    implementation shows on this model."""
    prompts = random_prompts(spec.vocab_size, seed=seed)
    conts = random_prompts(spec.vocab_size, lengths=(num_new,) * 3, seed=seed + 1)
    ours = steps.teacher_forced(runner, prompts, conts, steps.page_tables(3, 512))
    full = [p + c for p, c in zip(prompts, conts)]
    rows = [(i, len(prompts[i]) - 1 + t) for i in range(3) for t in range(num_new + 1)]
    ours = torch.stack([ours[i][pos - len(prompts[i]) + 1] for i, pos in rows])
    ref16, ref32 = (
        torch.stack([ref[i][pos] for i, pos in rows])
        for ref in (transformers_logits(hf, full, d) for d in (torch.bfloat16, torch.float32))
    )

    def errors(a, b) -> tuple[float, float]:
        return steps.rel_error(a, b), max(steps.rel_error(x, y) for x, y in zip(a, b))

    out = {}
    for name, (a, b) in {
        "orbit_vs_transformers_bf16": (ours, ref16),
        "orbit_vs_transformers_fp32": (ours, ref32),
        "transformers_bf16_vs_fp32": (ref16, ref32),
    }.items():
        out[name], out[name + "_worst_row"] = errors(a, b)
    return out
