"""GPU sampling (runtime/cuda_sampling.py) against the CPU path's semantics."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run through the device tool)", allow_module_level=True)

from runtime import sampling
from runtime.cuda_sampling import filtered_probs, sample
from runtime.sampling import SamplingParams

VOCAB = 32000


def test_greedy_is_the_exact_argmax():
    torch.manual_seed(0)
    logits = torch.randn(64, VOCAB) * 3
    logits[5, 100] = logits[5, 200] = logits[5].max() + 1  # a tie: the first index wins
    params = [SamplingParams(temperature=0)] * 64
    got = [s.token_id for s in sample(logits.cuda(), params, list(range(64)))]
    cpu = [s.token_id for s in sampling.sample(logits, params, list(range(64)))]
    assert got == cpu == logits.argmax(-1).tolist()


def test_seeded_draws_do_not_depend_on_the_batch_slot():
    torch.manual_seed(1)
    row = torch.randn(VOCAB).cuda()
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42)
    alone = sample(row[None], [p], [17])[0].token_id
    others = torch.randn(7, VOCAB).cuda()
    batch = torch.cat([others[:3], row[None], others[3:]])
    mixed = [SamplingParams(temperature=1.0, seed=i) for i in range(3)] + [p]
    mixed += [SamplingParams(temperature=0)] * 4
    assert sample(batch, mixed, [5, 6, 7, 17, 8, 9, 10, 11])[3].token_id == alone
    assert sample(row[None], [p], [18])[0].token_id is not None  # another position draws anew


def test_draws_follow_the_filtered_distribution():
    """20000 draws (one per position) from a known 8-token distribution under top-k 6 and
    top-p 0.8: tokens outside the kept set never appear, kept ones within 5 sigma."""
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.03, 0.02])
    logits = probs.log()
    p = SamplingParams(temperature=1.0, top_k=6, top_p=0.8, seed=3)
    n = 20000
    rows = logits[None].expand(n, -1).contiguous().cuda()
    tokens = torch.tensor([s.token_id for s in sample(rows, [p] * n, list(range(n)))])
    counts = torch.bincount(tokens, minlength=8).double()
    kept = torch.tensor([0.30, 0.20, 0.15, 0.12, 0, 0, 0, 0]).double()  # prefix reaching 0.8
    expected = kept / kept.sum() * n
    assert counts[4:].sum() == 0
    sigma = (expected * (1 - kept / kept.sum())).sqrt()
    assert ((counts[:4] - expected[:4]).abs() <= 5 * sigma[:4]).all(), counts.tolist()


def test_filtered_probs_match_the_cpu_filter():
    torch.manual_seed(2)
    logits = torch.randn(4, 1000) * 2
    params = [
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.5),
        SamplingParams(temperature=0.5),
    ]
    got = filtered_probs(logits.cuda(), params).cpu()
    for i, p in enumerate(params):
        ref = sampling._filtered_probs(logits[i] / p.temperature, p.top_k, p.top_p)
        torch.testing.assert_close(got[i] / got[i].sum(), ref, atol=1e-5, rtol=1e-4)


def test_logprobs_match_the_cpu_path():
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=0, num_logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, num_logprobs=0),
    ]
    got = sample(logits.cuda(), params, [1, 2, 3])
    cpu = sampling.sample(logits, params, [1, 2, 3])
    for g, c in zip(got, cpu):
        assert g.token_id == c.token_id
        assert [t for t, _ in g.top] == [t for t, _ in c.top]
        if c.logprob == c.logprob:  # not NaN
            assert abs(g.logprob - c.logprob) < 1e-4
