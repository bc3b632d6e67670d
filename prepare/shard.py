"""Cut one rank's tensors out of a checkpoint, following runtime/layout.py."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from prepare.source import SourceError, TensorSource
from prepare.source_quant import SourceQuant
from runtime.quant import FP8, WeightQuant, quantize
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
        rows = src.slice(name, 0, start, real_stop)
        if rows.dtype == FP8:
            raise SourceError(
                f"{name} is FP8 in the checkpoint; Orbit keeps the embedding and LM head in the "
                "package dtype and reads FP8 checkpoints that leave them unquantized (as "
                "compressed-tensors' `ignore: [lm_head]` does)."
            )
        out[: real_stop - start] = rows.float()
    return out


class LinearCutter:
    """One rank's part of a linear layer: the weight alone for a dense package, or the FP8
    weight and its scale in the package's scheme. A checkpoint already in that scheme is copied
    bit for bit, scales sliced along with their rows, columns or blocks; a dense tensor (a
    dense checkpoint with --quantize, or a layer a quantized checkpoint left unquantized) is
    quantized here, slice by slice."""

    def __init__(self, src: TensorSource, target: WeightQuant | None, source: SourceQuant | None):
        self.src, self.target, self.source = src, target, source

    def column(self, names: list[str], rank: int, tp: int) -> dict[str, torch.Tensor]:
        """[names[0] rows | names[1] rows | ...] of this rank, each split evenly by rows."""
        parts = []
        for name in names:
            step = self.src.shape(name)[0] // tp
            parts.append(self._piece(name, 0, rank * step, (rank + 1) * step))
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def row(self, name: str, rank: int, tp: int) -> dict[str, torch.Tensor]:
        """This rank's columns of name."""
        step = self.src.shape(name)[1] // tp
        return self._piece(name, 1, rank * step, (rank + 1) * step)

    def _piece(self, name: str, dim: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        w = self.src.slice(name, dim, start, stop)
        if self.target is None:
            return {"weight": w}
        if w.dtype != FP8:
            if dim == 1 and self.target.scheme == "fp8-channel":
                # scale each row over all its columns, as a TP 1 package does, so every TP
                # size holds the same FP8 values
                rows = self.src.shape(name)[0]
                w8, scale = quantize(self.src.slice(name, 0, 0, rows), self.target)
                return {"weight": w8[:, start:stop].contiguous(), "weight_scale": scale}
            w8, scale = quantize(w, self.target)
            return {"weight": w8, "weight_scale": scale}
        if self.source is None:
            raise SourceError(f"{name} is float8 but the checkpoint's config names no FP8 scheme.")
        scale_name = name.removesuffix("weight") + self.source.scale_suffix
        if scale_name not in self.src.names():
            raise SourceError(f"the checkpoint has no scale {scale_name!r} for its FP8 {name!r}.")
        return {"weight": w, "weight_scale": self._scale(scale_name, w.shape, dim, start, stop)}

    def _scale(self, name: str, shape, dim: int, start: int, stop: int) -> torch.Tensor:
        full = self.src.shape(name)
        if self.target.scheme == "fp8-channel":
            if len(full) == 0 or (len(full) == 1 and full[0] == 1) or full == (1, 1):
                return self.src.read(name).float().reshape(1).expand(shape[0]).clone()
            if dim == 1:  # a row-parallel slice keeps every row, so every row's scale
                return self.src.read(name).float().reshape(-1)
            return self.src.slice(name, 0, start, stop).float().reshape(-1)
        edge = self.target.block[dim]
        return self.src.slice(name, dim, start // edge, -(-stop // edge)).float()


def rank_tensors(
    src: TensorSource,
    spec: ModelSpec,
    rank: int,
    tp: int,
    linears: LinearCutter | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for one rank, reading only that rank's slices; linears decides the
    layout of qkv, o, gate_up and down (dense, as the checkpoint, by default)."""
    linears = linears or LinearCutter(src, None, None)

    def each(name: str, parts: dict[str, torch.Tensor]):
        for key, t in parts.items():
            yield f"{name}.{key}", t

    yield "embed.weight", _vocab_rows(src, "model.embed_tokens.weight", spec, rank, tp)
    for i in range(spec.num_layers):
        s, o = f"model.layers.{i}.", f"layers.{i}."
        a = s + "self_attn."
        yield (
            o + "attn_norm.weight",
            src.slice(s + "input_layernorm.weight", 0, 0, spec.hidden_size),
        )
        yield from each(
            o + "qkv", linears.column([a + f"{p}_proj.weight" for p in "qkv"], rank, tp)
        )
        if spec.qkv_bias:
            yield (
                o + "qkv.bias",
                torch.cat([_rows(src, a + f"{p}_proj.bias", rank, tp) for p in "qkv"]),
            )
        if spec.qk_norm:
            yield o + "q_norm.weight", src.slice(a + "q_norm.weight", 0, 0, spec.head_dim)
            yield o + "k_norm.weight", src.slice(a + "k_norm.weight", 0, 0, spec.head_dim)
        yield from each(o + "o", linears.row(a + "o_proj.weight", rank, tp))
        yield (
            o + "mlp_norm.weight",
            src.slice(s + "post_attention_layernorm.weight", 0, 0, spec.hidden_size),
        )
        yield from each(
            o + "gate_up",
            linears.column([s + f"mlp.{p}_proj.weight" for p in ("gate", "up")], rank, tp),
        )
        yield from each(o + "down", linears.row(s + "mlp.down_proj.weight", rank, tp))
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
