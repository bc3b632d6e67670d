"""Next-token sampling on the GPU, one batch at a time, with the CPU path's semantics
(runtime/sampling.py): greedy (a temperature below GREEDY_BELOW_TEMPERATURE) is the exact argmax
of the float32 logits; temperature, top-k (off at 0 or >= the vocabulary) and top-p (the most
likely token always stays) filter as there; a seeded draw depends only on (request seed,
position), through the same token_seed.

The draw: the filtered distribution's token j wins the race argmax_j p_j / E_j, E_j ~ Exp(1)
(one Triton kernel, runtime/triton_kernels.py), with the uniforms from Philox keyed by
token_seed(seed, position) and j alone. FlashInfer's samplers key Philox by the output row as
well, so a request's draw would change with its batch slot; its fused temperature softmax is
used (flashinfer.sampling.softmax). Top-k masks with torch.topk (FlashInfer's top-k module did
not compile in 8 minutes on the lent machine); top-p keeps the same smallest prefix as the CPU
path, by a sort.
"""

from __future__ import annotations

import torch

from runtime.sampling import Sampled, SamplingParams, is_greedy, token_seed, top_p_drop


@torch.inference_mode()
def sample(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> list[Sampled]:
    """logits: [n, vocab] float32 on the GPU; one SamplingParams and predicted-token position
    per row. One device-to-host transfer per call."""
    token_ids = sample_tokens(logits, params, positions).tolist()
    logprobs = _logprobs(logits, params, token_ids)
    return [Sampled(t, *logprobs.get(i, (float("nan"), ()))) for i, t in enumerate(token_ids)]


@torch.inference_mode()
def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> torch.Tensor:
    """The sampled token ids [n] (int64), left on the GPU: nothing here waits for the GPU
    (the host-side parameters go up in small asynchronous copies, `_up`), so the caller can
    queue the next step before the tokens are read."""
    tokens = logits.argmax(dim=-1)  # [n]; rows that sample overwrite theirs below
    drawn_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if drawn_rows:
        rows = _up(drawn_rows, torch.int64, logits.device)
        sub = [params[i] for i in drawn_rows]
        seeds = [token_seed(p.seed, positions[i]) for i, p in zip(drawn_rows, sub)]
        tokens.index_copy_(0, rows, _draw(logits.index_select(0, rows), sub, seeds))
    return tokens


@torch.inference_mode()
def warm_up(vocab_size: int, device: torch.device) -> None:
    """Draw once with every option before the first request, so that the draw's kernels
    (the Triton race, FlashInfer's softmax, top-k, top-p, logprobs) are compiled and loaded
    now: on the H200 a server's first sampled step took 0.4 s without this."""
    logits = torch.zeros(2, vocab_size, device=device)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=1),
        SamplingParams(temperature=1.0, seed=2, num_logprobs=2),
    ]
    sample(logits, params, [0, 0])  # reads the tokens back: the kernels have run


def _up(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list on the device without waiting for the GPU. torch.tensor(..., device=)
    copies from pageable memory and synchronizes the stream: a sampled step's launch then
    waited for its own forward pass, and the rank reported the step before it that much later.
    (The pinned block is not reused before the copy is done: torch's host allocator tracks it.)"""
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _draw(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> torch.Tensor:
    from runtime import triton_kernels

    probs = filtered_probs(logits, params)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    seeds_t = _up(seeds, torch.int64, logits.device)
    triton_kernels.exponential_race(probs, seeds_t, out)
    return out


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[m, V] float32 -> probabilities after temperature, top-k and top-p (rows not
    renormalised after top-p: the race needs only proportions)."""
    from flashinfer.sampling import softmax

    dev, vocab = logits.device, logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = _up(ks, torch.int64, dev)
        top = torch.topk(logits, max(ks), dim=-1).values  # [m, max k], descending
        kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    temps = _up([p.temperature for p in params], torch.float32, dev)
    probs = softmax(logits, temperature=temps)
    if any(p.top_p < 1.0 for p in params):
        top_p = _up([p.top_p for p in params], torch.float32, dev)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = top_p_drop(sorted_probs, top_p[:, None])
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
    """Row -> (chosen token's logprob, the k best as (id, logprob)) for rows that ask."""
    wanted = [i for i, p in enumerate(params) if p.num_logprobs >= 0]
    if not wanted:
        return {}
    rows = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[token_ids[i]] for i in wanted], device=rows.device))
    k = min(max(params[i].num_logprobs for i in wanted), logprobs.shape[-1])
    vals, ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    chosen, vals, ids = chosen[:, 0].tolist(), vals.tolist(), ids.long().tolist()
    out = {}
    for j, i in enumerate(wanted):
        n = params[i].num_logprobs
        out[i] = (chosen[j], tuple(zip(ids[j][:n], vals[j][:n])))
    return out
