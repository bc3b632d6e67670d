"""How a linear layer multiplies: one small object per kind of weight and device, chosen once
when the model is built from its package (matmul_for), so the layers never branch on dtype.

Each kind offers the three products the model makes: `linear` (x W^T + b), `norm_linear` (the
residual add and RMSNorm, then the product; one kernel for a single row on CUDA) and
`silu_mul_linear` (SiLU-and-multiply, then the product; one kernel for a single row on CUDA).
A single row is a decode step at batch 1, where the GEMV's weight-read rate is everything;
more rows take tensor-core GEMMs.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from runtime import cuda_ops
from runtime.quant import WeightQuant, dequantize

log = logging.getLogger(__name__)


class ReferenceMatmul:
    """Plain PyTorch: the CPU path and float32 runs, the reference the others are tested
    against. FP8 weights reach it already dequantized (matmul_for)."""

    def linear(self, x, layer):
        return F.linear(x, layer.weight, layer.bias)

    def silu_mul_linear(self, gate_up, layer):
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, layer)

    def norm_linear(self, norm, x, residual, layer):
        h, residual = norm.add_forward(x, residual)
        return self.linear(h, layer), residual


class HalfMatmul:
    """bf16/fp16 weights on CUDA: one row through Orbit's GEMV, up to 32 through its few-rows
    kernel, more through cuBLAS (runtime/cuda_ops.py)."""

    def linear(self, x, layer):
        return cuda_ops.linear(x, layer.weight, layer.bias)

    def silu_mul_linear(self, gate_up, layer):
        return cuda_ops.silu_and_mul_linear(gate_up, layer.weight)

    def norm_linear(self, norm, x, residual, layer):
        if cuda_ops.fuses_norm(x, residual):
            return cuda_ops.norm_linear(
                x, residual, norm.weight, norm.eps, layer.weight, layer.bias
            )
        h, residual = norm.add_forward(x, residual)
        return self.linear(h, layer), residual


class Fp8Matmul:
    """FP8 weights on Hopper-class CUDA GPUs. One row: the GEMV reads the FP8 weight and
    applies its scales after the dot products (the fusions of HalfMatmul kept). More rows:
    the activations are quantized per token (per token and block of columns for block
    scales) and multiplied on the FP8 tensor cores, the scales applied in the epilogue; with
    per-token scales the add + RMSNorm or SiLU-mul before a product quantizes as it goes."""

    def __init__(self, quant: WeightQuant):
        self.block = quant.block if quant.scheme == "fp8-block" else None

    def _many(self, x, layer):
        if self.block is None:
            return cuda_ops.fp8_rowwise_mm(x, layer.weight, layer.weight_scale, layer.bias)
        return cuda_ops.fp8_block_mm(x, layer.weight, layer.weight_scale, self.block, layer.bias)

    def _quantized(self, xq, xs, layer, dtype):
        return cuda_ops.fp8_rowwise_mm_quantized(
            xq, xs, layer.weight, layer.weight_scale, layer.bias, dtype
        )

    def _fuses_quantize(self, x, residual=None) -> bool:
        # per-token scales only: block scales quantize per 128 columns, a launch of their own
        return self.block is None and cuda_ops.fuses_quantize(x, residual)

    def linear(self, x, layer):
        if cuda_ops.one_row(x):
            return cuda_ops.linear(
                x, layer.weight, layer.bias, scale=layer.weight_scale, block=self.block
            )
        return self._many(x, layer)

    def silu_mul_linear(self, gate_up, layer):
        if cuda_ops.one_row(gate_up):
            return cuda_ops.silu_and_mul_linear(
                gate_up, layer.weight, scale=layer.weight_scale, block=self.block
            )
        if self._fuses_quantize(gate_up):
            xq, xs = cuda_ops.quantized_silu_and_mul(gate_up)
            return self._quantized(xq, xs, layer, gate_up.dtype)
        return self._many(cuda_ops.silu_and_mul(gate_up), layer)

    def norm_linear(self, norm, x, residual, layer):
        if cuda_ops.fuses_norm(x, residual):
            return cuda_ops.norm_linear(
                x,
                residual,
                norm.weight,
                norm.eps,
                layer.weight,
                layer.bias,
                scale=layer.weight_scale,
                block=self.block,
            )
        if self._fuses_quantize(x, residual):
            xq, xs, residual = cuda_ops.quantized_norm(x, residual, norm.weight, norm.eps)
            return self._quantized(xq, xs, layer, x.dtype), residual
        h, residual = norm.add_forward(x, residual)
        return self._many(h, layer), residual


@functools.cache
def _warn_dequantized(device: torch.device, dtype: torch.dtype) -> None:
    log.warning(
        "FP8 weights dequantized to %s on %s: the FP8 kernels need a bfloat16 package, FP8 "
        "tensor cores, and block scales a power of 2 of at least 32 columns wide",
        dtype,
        device,
    )


def _power_of_2_at_least_32(n: int) -> bool:
    return n >= 32 and n & (n - 1) == 0


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def matmul_for(layer, quant: WeightQuant | None, dtype: torch.dtype):
    """The kind for one built layer (weights on their device). Where FP8 cannot run as FP8
    (the CPU, float32 runs, GPUs without FP8 tensor cores) the layer's weight is replaced by
    its dequantized copy in `dtype` here, once."""
    device = layer.weight.device
    half_cuda = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if quant is not None and layer.weight_scale is not None:
        # cuBLASLt's row-wise scaled FP8 GEMM writes bfloat16 only
        # and the block GEMM's tensor-core tiles take whole blocks of at least 32 columns
        block_ok = quant.scheme != "fp8-block" or _power_of_2_at_least_32(quant.block[1])
        if dtype == torch.bfloat16 and _has_fp8_tensor_cores(device) and block_ok:
            return Fp8Matmul(quant)
        if half_cuda:
            _warn_dequantized(device, dtype)
        layer.weight = torch.nn.Parameter(
            dequantize(layer.weight, layer.weight_scale).to(dtype), requires_grad=False
        )
        layer.weight_scale = None
    return HalfMatmul() if half_cuda else ReferenceMatmul()
