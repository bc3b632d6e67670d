"""The tensors of one rank's shard: names and shapes, derived from the model spec and TP size.

`orbit prepare` writes exactly these tensors and the loader refuses anything else, so this is
the single statement of how a model is split:

- q, k and v are column-parallel and fused per rank as [q heads | k heads | v heads] of that
  rank's heads; gate and up are fused as [gate | up] of that rank's intermediate slice.
- o and down are row-parallel: each rank holds the columns that match its heads or slice, and
  the partial outputs are summed with an all-reduce.
- The embedding and LM head are split by vocabulary rows, padded to padded_vocab_size.
- Norm weights (and Qwen3's per-head q/k norms) are replicated.
- In a package with FP8 weights (runtime/quant.py), qkv, o, gate_up and down are float8 and
  each has a float32 `weight_scale` beside it, split with its weight: per-row scales follow
  the rows, block scales the blocks, and no rank's slice may cut a block.
"""

from __future__ import annotations

import torch

from runtime.quant import FP8, QUANTIZED_LINEARS, WeightQuant
from runtime.spec import ModelSpec


class ShardingError(ValueError):
    """The model's shapes cannot be split evenly for the requested TP size."""


def valid_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    return [
        n
        for n in range(1, limit + 1)
        if spec.num_heads % n == 0
        and spec.num_kv_heads % n == 0
        and spec.intermediate_size % n == 0
    ]


def check_tp(spec: ModelSpec, tp: int) -> None:
    if tp < 1:
        raise ShardingError(f"--tp must be at least 1, got {tp}.")
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(spec, field)
        if value % tp:
            sizes = ", ".join(map(str, valid_tp_sizes(spec)))
            raise ShardingError(
                f"{field}={value} is not divisible by --tp {tp}; valid TP sizes for this model: "
                f"{sizes}."
            )


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def shard_shapes(spec: ModelSpec, tp: int) -> dict[str, tuple[int, ...]]:
    check_tp(spec, tp)
    h, hd = spec.hidden_size, spec.head_dim
    q_local = spec.num_heads // tp * hd
    kv_local = spec.num_kv_heads // tp * hd
    inter_local = spec.intermediate_size // tp
    vocab_local = spec.padded_vocab_size // tp
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab_local, h)}
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "qkv.weight"] = (q_local + 2 * kv_local, h)
        if spec.qkv_bias:
            shapes[p + "qkv.bias"] = (q_local + 2 * kv_local,)
        if spec.qk_norm:
            shapes[p + "q_norm.weight"] = (hd,)
            shapes[p + "k_norm.weight"] = (hd,)
        shapes[p + "o.weight"] = (h, q_local)
        shapes[p + "mlp_norm.weight"] = (h,)
        shapes[p + "gate_up.weight"] = (2 * inter_local, h)
        shapes[p + "down.weight"] = (h, inter_local)
    shapes["norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_local, h)
    return shapes


def check_block_split(spec: ModelSpec, tp: int, quant: WeightQuant) -> None:
    """Refuse a TP size whose slices would cut an FP8 scale block, naming the first cut."""
    if quant.scheme != "fp8-block":
        return
    rows, cols = quant.block
    hd = spec.head_dim
    cuts = [  # (what, the rank's slice, the block edge it must be a multiple of)
        ("q_proj rows", spec.num_heads // tp * hd, rows),
        ("k_proj and v_proj rows", spec.num_kv_heads // tp * hd, rows),
        ("gate_proj and up_proj rows", spec.intermediate_size // tp, rows),
        ("o_proj columns", spec.num_heads // tp * hd, cols),
        ("down_proj columns", spec.intermediate_size // tp, cols),
    ]
    for what, size, edge in cuts:
        if size % edge:
            raise ShardingError(
                f"each rank's slice of {what} is {size} at --tp {tp}, not a multiple of the "
                f"checkpoint's {rows}x{cols} FP8 scale blocks, so a block would straddle ranks "
                f"or projections; pick a TP size that keeps whole blocks."
            )


def shard_tensors(
    spec: ModelSpec, tp: int, dtype: torch.dtype, quant: WeightQuant | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of one rank's shard: name -> (shape, dtype)."""
    out = {name: (shape, dtype) for name, shape in shard_shapes(spec, tp).items()}
    if quant is None:
        return out
    check_block_split(spec, tp, quant)
    for i in range(spec.num_layers):
        for linear in QUANTIZED_LINEARS:
            name = f"layers.{i}.{linear}.weight"
            shape = out[name][0]
            out[name] = (shape, FP8)
            out[f"layers.{i}.{linear}.weight_scale"] = (quant.scale_shape(*shape), torch.float32)
    return out
