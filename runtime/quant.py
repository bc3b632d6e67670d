"""FP8 weight schemes: what a package's quantized linear layers hold and how to read them.

Two layouts, both float8_e4m3fn weights whose real value is weight * scale:
- "fp8-channel": one float32 scale per output row (compressed-tensors "channel", and "tensor"
  written as that scale repeated, which is exact; `orbit prepare --quantize fp8` makes these);
- "fp8-block": one float32 scale per (block_rows x block_cols) block (DeepSeek / HF "fp8" with
  `weight_block_size`, whose `weight_scale_inv` is this multiplier despite its name).
Only qkv, o, gate_up and down are quantized; the embedding, LM head and norms keep the
package's dtype, as the published FP8 checkpoints keep them.
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
