"""Tensor-parallel building blocks. Each rank holds its slice (runtime/layout.py); the
collectives are explicit calls in the forward passes below."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class TPGroup:
    """This rank's place in the tensor-parallel group; size 1 runs without torch.distributed."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank-ordered."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) over this rank's slice of W; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """Input split by columns across ranks; partial products are summed with an all-reduce."""

    def __init__(self, in_local: int, out_features: int, group: TPGroup):
        super().__init__(in_local, out_features)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * n, (rank + 1) * n) of the padded embedding; other ids contribute zeros and
    the all-reduce assembles the full lookup."""

    def __init__(self, vocab_local: int, hidden: int, group: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden), requires_grad=False)
        self.group = group
        self.start = group.rank * vocab_local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
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
        logits = self.group.all_gather_last_dim(F.linear(x, self.weight))
        return logits[..., : self.vocab_size]  # [num_tokens, vocab]
