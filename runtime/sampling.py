"""Next-token sampling on the CPU path: greedy, temperature, top-k, top-p, seeded, logprobs.

Seeded draws are stateless: the generator for a token is seeded from (request seed, position),
so a sequence that is preempted and recomputed, or batched with different neighbours, draws the
same tokens.

Every value the frontend lets through is numerically safe (runtime/cuda_sampling.py does the
same): a temperature below GREEDY_BELOW_TEMPERATURE is greedy (dividing float32 logits by it
could overflow to inf); top-p always keeps the most likely token, so a top_p that rounds to 0 in
float32 samples that token; a top_k of 0 or at least the vocabulary size is off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Temperatures below this are greedy, on the CPU and GPU paths alike. 1e-5 is vLLM's threshold:
# float32 logits divided by it stay far from overflow (|logit| < 1e33).
GREEDY_BELOW_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / the golden ratio


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or >= the vocabulary size: off
    seed: int = 0  # read as an unsigned 64-bit value
    num_logprobs: int = -1  # -1: none; k >= 0: the chosen token's logprob and the k best


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float  # NaN when not asked
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_BELOW_TEMPERATURE


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit values that spreads every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_seed(seed: int, position: int) -> int:
    """The generator seed of the token at `position`: a non-negative 63-bit value (what
    torch.Generator and the GPU kernel take). `seed` is read as unsigned 64-bit (a negative
    value as its two's complement); distinct seeds give unrelated streams."""
    mixed = _mix64(seed & _MASK64)
    return _mix64((mixed + (position + 1) * _GOLDEN_GAMMA) & _MASK64) >> 1


def sample_one(logits: torch.Tensor, p: SamplingParams, position: int) -> Sampled:
    """logits: [vocab] float32 for the token at `position` (the one being predicted)."""
    if is_greedy(p):
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
        vals, ids = torch.topk(logprobs, min(p.num_logprobs, logprobs.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return Sampled(token, float(logprobs[token]), top)


def top_p_drop(sorted_probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """[..., V] probabilities sorted descending -> True where top-p drops the token: all but the
    smallest prefix whose mass reaches top_p. The first token always stays, whatever top_p."""
    drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
    drop[..., 0] = False
    return drop


def _filtered_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        sorted_probs = sorted_probs.masked_fill(top_p_drop(sorted_probs, top_p), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> list[Sampled]:
    """logits: [n, vocab]; one SamplingParams and predicted-token position per row."""
    return [sample_one(logits[i], p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
