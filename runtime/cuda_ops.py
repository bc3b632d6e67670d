"""Fused CUDA kernels behind the model's layers (runtime/layers.py picks them for half-precision
CUDA tensors): FlashInfer's RMSNorm and fused add + RMSNorm, and Triton kernels for RoPE,
SiLU-and-multiply and the paged KV write. FlashInfer and Triton are imported on first use, so
this module loads on machines that have neither (the CPU reference path never calls it).

Each function allocates its output with the caching allocator; inside a captured CUDA graph
that memory comes from the graph's pool, so replays allocate nothing.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    from flashinfer.norm import rmsnorm

    return rmsnorm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rmsnorm(residual) * weight."""
    from flashinfer.norm import fused_add_rmsnorm

    fused_add_rmsnorm(x, residual, weight, eps)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, hq, hd], k [T, hkv, hd] (views of the fused qkv output) -> rotated contiguous
    copies, which is also the layout FlashInfer's attention reads q in."""
    from runtime import triton_kernels

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        triton_kernels.rope(q, k, q_out, k_out, cos, sin)
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] = [gate | up] -> silu(gate) * up, [T, I]."""
    from runtime import triton_kernels

    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        triton_kernels.silu_mul(gate_up, out)
    return out


def store_kv(
    cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Write k, v [T, hkv, hd] into cache [P, 2, page_size, hkv, hd] at (pages[t], offsets[t])."""
    from runtime import triton_kernels

    if k.shape[0]:
        triton_kernels.store_kv(cache, k, v, pages, offsets)
