"""Cut one rank's tensors out of a checkpoint, following runtime/layout.py."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from prepare.source import SourceError, TensorSource
from runtime.spec import ModelSpec


def _rows(src: TensorSource, name: str, rank: int, parts: int, dim: int = 0) -> torch.Tensor:
    size = src.shape(name)[dim]
    step = size // parts
    return src.slice(name, dim, rank * step, (rank + 1) * step)


def _vocab_rows(src: TensorSource, name: str, spec: ModelSpec, rank: int, tp: int) -> torch.Tensor:
    """Rank's slice of a [vocab, hidden] tensor, zero rows past the real vocabulary."""
    per_rank = spec.padded_vocab_size // tp
    start, stop = rank * per_rank, (rank + 1) * per_rank
    real_stop = min(stop, spec.vocab_size)
    out = torch.zeros(per_rank, spec.hidden_size, dtype=torch.float32)
    if real_stop > start:
        out[: real_stop - start] = src.slice(name, 0, start, real_stop).float()
    return out


def rank_tensors(
    src: TensorSource, spec: ModelSpec, rank: int, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for one rank, reading only that rank's slices."""
    yield "embed.weight", _vocab_rows(src, "model.embed_tokens.weight", spec, rank, tp)
    for i in range(spec.num_layers):
        s, o = f"model.layers.{i}.", f"layers.{i}."
        a = s + "self_attn."
        yield (
            o + "attn_norm.weight",
            src.slice(s + "input_layernorm.weight", 0, 0, spec.hidden_size),
        )
        yield (
            o + "qkv.weight",
            torch.cat([_rows(src, a + f"{p}_proj.weight", rank, tp) for p in "qkv"]),
        )
        if spec.qkv_bias:
            yield (
                o + "qkv.bias",
                torch.cat([_rows(src, a + f"{p}_proj.bias", rank, tp) for p in "qkv"]),
            )
        if spec.qk_norm:
            yield o + "q_norm.weight", src.slice(a + "q_norm.weight", 0, 0, spec.head_dim)
            yield o + "k_norm.weight", src.slice(a + "k_norm.weight", 0, 0, spec.head_dim)
        yield o + "o.weight", _rows(src, a + "o_proj.weight", rank, tp, dim=1)
        yield (
            o + "mlp_norm.weight",
            src.slice(s + "post_attention_layernorm.weight", 0, 0, spec.hidden_size),
        )
        yield (
            o + "gate_up.weight",
            torch.cat([_rows(src, s + f"mlp.{p}_proj.weight", rank, tp) for p in ("gate", "up")]),
        )
        yield o + "down.weight", _rows(src, s + "mlp.down_proj.weight", rank, tp, dim=1)
    yield "norm.weight", src.slice("model.norm.weight", 0, 0, spec.hidden_size)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", _vocab_rows(src, "lm_head.weight", spec, rank, tp)


def check_source_names(src: TensorSource, spec: ModelSpec) -> None:
    """Refuse a checkpoint that lacks a tensor the spec needs, naming the first one missing."""
    names = src.names()
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        needed.append("lm_head.weight")
    for i in range(spec.num_layers):
        a = f"model.layers.{i}.self_attn."
        needed += [a + f"{p}_proj.weight" for p in "qkvo"]
        needed += [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        if spec.qkv_bias:
            needed += [a + f"{p}_proj.bias" for p in "qkv"]
        if spec.qk_norm:
            needed += [a + "q_norm.weight", a + "k_norm.weight"]
    for name in needed:
        if name not in names:
            raise SourceError(f"the checkpoint has no tensor {name!r}, which this model needs.")
