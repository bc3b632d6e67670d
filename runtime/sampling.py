"""Next-token sampling on the CPU path: greedy, temperature, top-k, top-p, seeded, logprobs.

Seeded draws are stateless: the generator for a token is seeded from (request seed, position),
so a sequence that is preempted and recomputed, or batched with different neighbours, draws the
same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    num_logprobs: int = -1  # -1: none; k >= 0: the chosen token's logprob and the k best


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float  # NaN when not asked
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


def token_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position * 7919 + 0x9E3779B9) % (2**63 - 1)


def sample_one(logits: torch.Tensor, p: SamplingParams, position: int) -> Sampled:
    """logits: [vocab] float32 for the token at `position` (the one being predicted)."""
    if p.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        probs = _filtered_probs(logits / p.temperature, p.top_k, p.top_p)
        g = torch.Generator(device=logits.device).manual_seed(token_seed(p.seed, position))
        token = int(torch.multinomial(probs, 1, generator=g))
    if p.num_logprobs < 0:
        return Sampled(token, float("nan"), ())
    logprobs = torch.log_softmax(logits, dim=-1)
    top = ()
    if p.num_logprobs > 0:
        vals, ids = torch.topk(logprobs, p.num_logprobs)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return Sampled(token, float(logprobs[token]), top)


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> list[Sampled]:
    """logits: [n, vocab]; one SamplingParams and predicted-token position per row."""
    return [sample_one(logits[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
