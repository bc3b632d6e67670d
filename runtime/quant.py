"""FP8 weight schemes: what a package's quantized linear layers hold and how to read them.

Two layouts, both float8_e4m3fn weights whose real value is weight * scale:
- "fp8-channel": one float32 scale per output row (compressed-tensors "channel", and "tensor"
  written as that scale repeated, which is exact; `orbit prepare --quantize fp8` makes these);
- "fp8-block": one float32 scale per (block_rows x block_cols) block (DeepSeek / HF "fp8" with
  `weight_block_size`, whose `weight_scale_inv` is this multiplier despite its name).
Only qkv, o, gate_up and down are quantized; the embedding, LM head and norms keep the
package's dtype, as the published FP8 checkpoints keep them.

And FP8 KV pages (KVQuant, below): e4m3 keys and values with one scale per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto import package_pb2

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# The products a weight scheme applies to, by their shard names (runtime/layout.py).
QUANTIZED_LINEARS = ("qkv", "o", "gate_up", "down")
SCHEMES = ("fp8-channel", "fp8-block")


@dataclass(frozen=True)
class WeightQuant:
    scheme: str  # one of SCHEMES
    block: tuple[int, int] = (0, 0)  # (rows, cols) of a scale's block; fp8-block only

    @classmethod
    def from_proto(cls, q: package_pb2.Quantization) -> WeightQuant | None:
        if not q.weights:
            return None
        return cls(q.weights, (q.block_rows, q.block_cols))

    def to_proto(self) -> package_pb2.Quantization:
        return package_pb2.Quantization(
            weights=self.scheme, block_rows=self.block[0], block_cols=self.block[1]
        )

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        if self.scheme == "fp8-channel":
            return (rows,)
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an FP8 weight and its scale (either scheme, by its shape) stand for."""
    w = weight.float()
    if scale.dim() == 1:
        return w * scale[:, None]
    rows, cols = w.shape
    br, bc = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w * full


def quantize(weight: torch.Tensor, quant: WeightQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale) for a dense weight: each row (or block) scaled so that its
    largest magnitude lands on FP8_MAX, rounded to nearest by the cast."""
    w = weight.float()
    if quant.scheme == "fp8-channel":
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    rows, cols = w.shape
    br, bc = quant.block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.view(nr * br, nc * bc)[:rows, :cols].to(FP8).contiguous(), scale


# FP8 KV pages: a stored key (value) is the real one divided by its layer's k (v) scale,
# saturated to +-FP8_MAX and rounded to nearest; readers multiply back. One scale per layer
# because that is what FlashInfer's kernels take (a float folded into the softmax scale and
# the output), and what calibrated checkpoints carry (compressed-tensors kv_cache_scheme).
KV_FP8 = "fp8-e4m3"
KV_DTYPES = ("auto", "fp8", "model")  # orbit serve --kv-dtype


@dataclass(frozen=True)
class KVQuant:
    k_scales: tuple[float, ...]  # one per layer
    v_scales: tuple[float, ...]

    @classmethod
    def unit(cls, num_layers: int) -> KVQuant:
        """Scale 1.0 everywhere: what vLLM and SGLang use for an uncalibrated model. Keys and
        values of the models we serve stay far inside +-448 (docs/package-format.md)."""
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @classmethod
    def recorded(cls, q: package_pb2.Quantization, num_layers: int) -> KVQuant:
        """The package's scales, or unit ones where it records none."""
        if not q.kv_k_scales:
            return cls.unit(num_layers)
        return cls(tuple(q.kv_k_scales), tuple(q.kv_v_scales))


def kv_quant_for(q: package_pb2.Quantization, num_layers: int, kv_dtype: str) -> KVQuant | None:
    """What a rank's KV pages hold for `orbit serve --kv-dtype` (one of KV_DTYPES): None for
    the package's dtype, else FP8 with the package's scales."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")
    if kv_dtype == "model" or (kv_dtype == "auto" and q.kv_cache != KV_FP8):
        return None
    return KVQuant.recorded(q, num_layers)


def store_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) as it is stored in an FP8 page whose layer scale is `scale`."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
