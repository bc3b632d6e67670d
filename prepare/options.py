"""The options of `orbit prepare`, importable without torch: the CLI checks them before any
weights are read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PrepareOptions:
    tp: int = 1
    dtype: str = "auto"  # "auto" keeps the checkpoint's dtype (float32 for GGUF)
    max_seq_len: int = 0  # 0: min(the model's trained context, 4096)
    max_batch: int = 64
    kv_page_size: int = 16
    max_step_tokens: int = 2048
    # The token buckets of the prefill and mixed-step graphs (capacities.prefill_chunk_sizes),
    # ascending; (): powers of two from 16 (runtime/spec.py default_prefill_chunks).
    prefill_buckets: tuple[int, ...] = ()
    force: bool = False
    sign_key: Path | None = None  # Ed25519 private key: writes manifest.sig
    # "fp8": FP8 weights with per-row scales for the linear layers of an unquantized checkpoint
    # (an FP8 checkpoint keeps its own scheme either way); "": as the checkpoint.
    quantize: str = ""
    # "fp8": the package runs with FP8 KV pages by default (orbit serve --kv-dtype auto); "":
    # with pages of its dtype. Calibrated k/v scales in the checkpoint are recorded either way.
    kv_dtype: str = ""
