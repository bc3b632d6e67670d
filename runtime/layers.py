"""Tensor-parallel building blocks. Each rank holds its slice (runtime/layout.py); the
collectives are explicit calls in the forward passes below."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime import cuda_ops


def _fused_kernels(x: torch.Tensor) -> bool:
    """Whether x takes the fused CUDA kernels (runtime/cuda_ops.py) rather than plain PyTorch:
    half-precision CUDA tensors only, so float32 runs, CPU or GPU, stay the reference."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class TPGroup:
    """This rank's place in the tensor-parallel group; size 1 runs without torch.distributed.

    `always_communicate` makes a size-1 group still call the collectives (it then needs a
    world-size-1 process group): the GPU tests use it to capture NCCL calls in CUDA graphs on
    one GPU, exactly as TP > 1 does.
    """

    def __init__(self, rank: int = 0, size: int = 1, always_communicate: bool = False):
        self.rank, self.size = rank, size
        self.communicates = size > 1 or always_communicate

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.communicates:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, n] on each rank -> [tokens, size * n], rank-ordered."""
        if not self.communicates:
            return x
        x = x.contiguous()
        if x.is_cuda:  # NCCL gathers into one tensor (gloo has no all_gather_into_tensor)
            out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x)  # [size * tokens, n], rank-major
            out = out.view(self.size, x.shape[0], x.shape[1]).transpose(0, 1)
            return out.reshape(x.shape[0], self.size * x.shape[1])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_kernels(x) and x.dim() == 2 and x.is_contiguous():
            return cuda_ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add fused with the norm after it: returns (norm(s), s) with
        s = x + residual (s = x when residual is None). On CUDA one kernel does both, in place."""
        if residual is None:
            return self(x), x
        if _fused_kernels(x) and x.is_contiguous() and residual.is_contiguous():
            cuda_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


def norm_linear(norm: RMSNorm, linear: "Linear", x: torch.Tensor, residual: torch.Tensor | None):
    """linear(norm(s)) and the stream s = x + residual (s = x when residual is None); on the
    CUDA path a single row takes one kernel for the add, the norm and the product."""
    return linear.mm.norm_linear(norm, x, residual, linear)


class Linear(nn.Module):
    """y = x W^T (+ b) over this rank's slice of W; no communication. `mm` (runtime/matmul.py)
    is how it multiplies, set when the model is built; `weight_scale` is the FP8 weight's
    scale (runtime/quant.py), None for a dense weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        scale_shape: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale = (
            nn.Parameter(torch.empty(scale_shape), requires_grad=False) if scale_shape else None
        )
        self.mm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm.linear(x, self)


class RowParallelLinear(Linear):
    """Input split by columns across ranks; partial products are summed with an all-reduce."""

    def __init__(
        self,
        in_local: int,
        out_features: int,
        group: TPGroup,
        scale_shape: tuple[int, ...] | None = None,
    ):
        super().__init__(in_local, out_features, scale_shape=scale_shape)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.mm.linear(x, self))

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)), in one kernel where the CUDA path has one."""
        return self.group.all_reduce(self.mm.silu_mul_linear(gate_up, self))


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the padded embedding; other ids contribute zeros and
    the all-reduce assembles the full lookup."""

    def __init__(self, vocab_local: int, hidden: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden), requires_grad=False)
        self.group = group
        self.start = group.rank * vocab_local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.group.communicates:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        return self.group.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows, gathered so every rank holds the full row."""

    def __init__(self, vocab_local: int, hidden: int, vocab_size: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden), requires_grad=False)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = (
            cuda_ops.linear(x, self.weight, None) if _fused_kernels(x) else F.linear(x, self.weight)
        )
        logits = self.group.all_gather_last_dim(local)
        return logits[..., : self.vocab_size]  # [num_tokens, vocab]
