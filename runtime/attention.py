"""Reference paged attention in plain PyTorch: the CPU path and the oracle for the GPU path."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.kv_cache import KVCache
from runtime.quant import store_kv
from runtime.rope import apply_rope


@dataclass
class SeqSpan:
    """One sequence's part of a step: its new tokens and where its KV lives."""

    num_new: int  # query tokens this step
    context_len: int  # tokens in the cache after this step, the new ones included
    page_table: torch.Tensor  # [pages] int64, covering context_len tokens


class ReferenceAttention:
    """Attention metadata for one step, plus the kernels that use it. Built once per step and
    passed down to every layer; the CUDA path has its own class with the same `attend`."""

    def __init__(self, spans: list[SeqSpan], kv: KVCache, scale: float):
        self.spans, self.kv, self.scale = spans, kv, scale
        ps = kv.shape.page_size
        pages, offsets = [], []
        for s in spans:
            pos = torch.arange(s.context_len - s.num_new, s.context_len)
            pages.append(s.page_table[pos // ps])
            offsets.append(pos % ps)
        self.write_pages = torch.cat(pages) if pages else torch.empty(0, dtype=torch.long)
        self.write_offsets = torch.cat(offsets) if offsets else torch.empty(0, dtype=torch.long)

    def attend(self, layer: int, q, k, v, cos, sin) -> torch.Tensor:
        """q: [T, hq, hd]; k, v: [T, hkv, hd] for this step's tokens, before RoPE; cos, sin:
        [T, hd], their positions' rotation. Returns [T, hq, hd]."""
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = self.kv.layers[layer]
        scales = self.kv.scales(layer)
        if self.kv.quant is not None:
            k, v = store_kv(k, scales[0]), store_kv(v, scales[1])
        cache[self.write_pages, 0, self.write_offsets] = k
        cache[self.write_pages, 1, self.write_offsets] = v
        out, start = [], 0
        for s in self.spans:
            qs = q[start : start + s.num_new]
            start += s.num_new
            out.append(self._one(cache, qs, s, scales))
        return torch.cat(out)

    def _one(
        self, cache: torch.Tensor, q: torch.Tensor, s: SeqSpan, scales: tuple[float, float]
    ) -> torch.Tensor:
        kv = cache[s.page_table].transpose(0, 1)  # [2, pages, page_size, hkv, hd]
        k = kv[0].flatten(0, 1)[: s.context_len]  # [ctx, hkv, hd]
        v = kv[1].flatten(0, 1)[: s.context_len]
        if self.kv.quant is not None:
            k, v = k.to(q.dtype) * scales[0], v.to(q.dtype) * scales[1]
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [hq, ctx, hd]
        v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        q_pos = torch.arange(s.context_len - s.num_new, s.context_len)[:, None]
        mask = torch.arange(s.context_len)[None, :] <= q_pos  # [n, ctx], causal
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k, v, attn_mask=mask, scale=self.scale
        )
        return o.transpose(0, 1)  # [n, hq, hd]
