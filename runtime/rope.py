"""Rotary position embeddings (NeoX half-rotation layout, as transformers' Llama/Qwen use)."""

from __future__ import annotations

import math

import torch

from runtime.spec import ModelSpec


def inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    hd = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = spec.rope_scaling
    if rs.type == "linear":
        return inv / rs.factor
    if rs.type == "llama3":
        return _llama3(
            inv,
            rs.factor,
            rs.low_freq_factor,
            rs.high_freq_factor,
            rs.original_max_position_embeddings,
        )
    return inv


def _llama3(
    inv: torch.Tensor, factor: float, low: float, high: float, old_ctx: int
) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by factor, short ones kept, and the band between
    # is interpolated smoothly.
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_table(spec: ModelSpec, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_positions, head_dim], float32."""
    inv = inverse_frequencies(spec)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, head_dim] in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
