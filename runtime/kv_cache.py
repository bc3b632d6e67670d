"""The paged KV cache: one tensor per layer, allocated once, addressed through page tables.

Layout per layer is [num_pages, 2 (k, v), page_size, kv_heads_local, head_dim] ("NHD", the
layout FlashInfer's paged kernels read), so the CPU and GPU paths share it. Token t of a
sequence lives in page page_table[t // page_size] at offset t % page_size.

The pages hold the model's dtype, or float8_e4m3fn with one k and one v scale per layer
(runtime/quant.py KVQuant): half the bytes, so twice the pages in the same memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.quant import FP8, KVQuant
from runtime.spec import ModelSpec


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int  # this rank's
    head_dim: int

    def bytes(self, dtype: torch.dtype) -> int:
        elems = (
            self.num_layers * self.num_pages * 2 * self.page_size * self.kv_heads * self.head_dim
        )
        return elems * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def for_spec(cls, spec: ModelSpec, tp: int, num_pages: int, page_size: int) -> KVCacheShape:
        return cls(spec.num_layers, num_pages, page_size, spec.num_kv_heads // tp, spec.head_dim)

    def page_bytes(self, dtype: torch.dtype) -> int:
        return self.bytes(dtype) // self.num_pages


def page_dtype(model_dtype: torch.dtype, quant: KVQuant | None) -> torch.dtype:
    """What the pages hold: the model's dtype, or e4m3 with quant's scales."""
    return model_dtype if quant is None else FP8


class KVCache:
    def __init__(
        self,
        shape: KVCacheShape,
        model_dtype: torch.dtype,
        device: torch.device | str,
        quant: KVQuant | None = None,
    ):
        """Pages of `model_dtype`, or FP8 ones scaled by `quant`."""
        self.shape, self.quant, self.model_dtype = shape, quant, model_dtype
        self.dtype = page_dtype(model_dtype, quant)
        if quant is not None and len(quant.k_scales) != shape.num_layers:
            raise ValueError(
                f"{len(quant.k_scales)} KV scales for {shape.num_layers} layers; the package's "
                "quantization.kv_k_scales must have one per layer."
            )
        self.layers = [
            torch.zeros(
                shape.num_pages,
                2,
                shape.page_size,
                shape.kv_heads,
                shape.head_dim,
                dtype=self.dtype,
                device=device,
            )
            for _ in range(shape.num_layers)
        ]

    def scales(self, layer: int) -> tuple[float, float]:
        """(k, v) scale of a layer's pages: 1.0 for pages of the model's dtype."""
        if self.quant is None:
            return 1.0, 1.0
        return self.quant.k_scales[layer], self.quant.v_scales[layer]
