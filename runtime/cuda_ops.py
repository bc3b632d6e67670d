"""Fused CUDA kernels behind the model's layers (runtime/layers.py picks them for half-precision
CUDA tensors) and the attention classes: FlashInfer's RMSNorm and fused add + RMSNorm, and
Triton kernels for RoPE with the paged KV write, SiLU-and-multiply, and the one-row products
of decode at batch 1 (GEMVs, with the add + RMSNorm before qkv and gate_up and the SiLU-mul
before down fused in; FP8 weights too; not inside exact_rows(), where rows take one tile),
and for FP8 weights at more rows, the per-token activation quantization and the FP8 GEMMs.
FlashInfer and Triton are imported on first use, so this module loads on machines that have
neither (the CPU reference path never calls it).

Each function allocates its output with the caching allocator; inside a captured CUDA graph
that memory comes from the graph's pool, so replays allocate nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    from flashinfer.norm import rmsnorm

    return rmsnorm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: residual += x, then x = rmsnorm(residual) * weight."""
    from flashinfer.norm import fused_add_rmsnorm

    fused_add_rmsnorm(x, residual, weight, eps)


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """RoPE on q [T, hq, hd] and k [T, hkv, hd] (views of the fused qkv output); the rotated k
    and v [T, hkv, hd] go into cache [P, 2, page_size, hkv, hd] at (pages[t], offsets[t]),
    divided by kv_scales (k, v) when the cache is FP8. Returns the rotated q, contiguous: the
    layout FlashInfer's attention reads. One kernel."""
    from runtime import triton_kernels

    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        triton_kernels.rope_store_kv(q, k, v, q_out, cache, cos, sin, pages, offsets, kv_scales)
    return q_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] = [gate | up] -> silu(gate) * up, [T, I]."""
    from runtime import triton_kernels

    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        triton_kernels.silu_mul(gate_up, out)
    return out


def one_row(x: torch.Tensor) -> bool:
    """A decode step of one sequence: its products are GEMVs, which Orbit's kernels run at the
    weight-read rate where cuBLAS spends 1.1-1.7x that (benchmarks/kernels.py --part gemv).
    Not inside exact_rows(), where one row takes the few-rows kernel as 32 rows would."""
    return x.shape[0] == 1 and not _exact_rows and x.is_contiguous()


# Set while the runner captures the exact graphs (runtime/cuda_runner.py, --exact-verification):
# every row of a verification step computed bit for bit as a one-token step computes it, so
# speculation's greedy output is the output without it (issue 19). Every product of 1 to
# HALF_FEW_ROWS rows goes through the few-rows kernel at one tile and ROWS = HALF_FEW_ROWS
# whatever the row count, so a row's dot products run the same instructions alone or among 32
# (the rows are the tensor cores' columns, never mixed); the norms are FlashInfer's, one row a
# block. One-token steps replay these graphs too and give up the GEMV: on an H200, one-token
# steps of SmolLM2-135M took 0.86 ms against 0.60 and a 17-token verification 0.98; the 8B's
# 4.63 and 5.58 ms (docs/performance.md, 2026-12-06). The first form, each row through the
# one-row GEMV in turn, was exact too but ran the rows one after another (17 tokens: 5.8 and
# 108 ms) and is gone.
_exact_rows = False


@contextlib.contextmanager
def exact_rows():
    """Within: products of 1 to HALF_FEW_ROWS rows as the exact graphs compute them."""
    global _exact_rows
    _exact_rows = True
    try:
        yield
    finally:
        _exact_rows = False


def _rows_tile(n: int, k: int, fp8: bool = False) -> tuple[int, int, int]:
    """(rows per block, warps, programs per SM) of the GEMV: the best of the H200 sweep over
    the 8B shapes (benchmarks/kernels.py --part gemv): two rows a block, four programs of 8
    warps per SM, except for long rows (down), one row a block and two programs per SM. FP8
    weights (benchmarks/fp8.py --sweep-only): two rows a block of 4 warps, four per SM; for
    down, two rows a block of 16 warps, two per SM."""
    if fp8:
        return (2, 16, 2) if k > 4096 else (2, 4, 4)
    return (1, 8, 2) if k > 4096 else (2, 8, 4)


HALF_FEW_ROWS = 32  # up to this many rows, W x^T in Triton beats cuBLAS (benchmarks/kernels.py)


def few_rows(x: torch.Tensor) -> bool:
    """A decode step of a few sequences, or a verification row replayed as one-token rows:
    products that read every weight for a handful of rows, where cuBLAS's GEMMs reach well
    under the weight-read rate (benchmarks/kernels.py --part few)."""
    least = 1 if _exact_rows else 2
    return least <= x.shape[0] <= HALF_FEW_ROWS and x.stride(1) == 1


# Weights of at most this many elements make a few-rows product that is bound by its launch,
# not its bytes (SmolLM2-135M's are 0.3-1.8M, the 8B's 17-117M): those launch early (PDL,
# as the GEMV and the norms do), so the kernel is resident when the one before it drains. On
# an H100, SmolLM2-135M's decode graph took 0.54 ms at 1 row (GEMVs, PDL) and 0.99 at 2 rows
# (this kernel without it), a verification row of 17 tokens 1.25 (docs/performance.md,
# 2026-12-05). Larger weights keep the plain launch: the 8B shapes' sweep measured an early
# variant 1.1-2x slower (2026-12-04).
EARLY_LAUNCH_WEIGHTS = 4 * 2**20


def _launch_bound(w: torch.Tensor) -> bool:
    return w.numel() <= EARLY_LAUNCH_WEIGHTS


def _few_rows_mm(x: torch.Tensor, w: torch.Tensor, bias) -> torch.Tensor:
    """x @ w^T (+ bias) through the few-rows kernel at its tile, launched early for a
    launch-bound w. The norm and SiLU-mul before it stay separate kernels: fusing them into
    this one for small weights measured slower and was removed (H200, SmolLM2-135M's decode
    graph 1.19 / 1.20 / 1.23 / 1.74 ms at 2 / 4 / 8 / 24 rows against 0.75 / 0.75 / 0.77 /
    1.04 without, 2026-12-05)."""
    from runtime import triton_kernels

    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    early = _launch_bound(w) and triton_kernels.pdl(x.device)
    # inside exact_rows(): the tile and ROWS of HALF_FEW_ROWS rows for 1 to HALF_FEW_ROWS rows
    rows = HALF_FEW_ROWS if _exact_rows else x.shape[0]
    triton_kernels.few_rows_mm(x, w, bias, out, _few_tile(*w.shape, rows), early=early, rows=rows)
    return out


def _few_tile(n: int, k: int, m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, warps) of the bf16 few-rows kernel for m rows of an N x K
    weight: the best of the H200 sweep over the 8B shapes (benchmarks/kernels.py --part few);
    long rows (down) take narrower blocks beyond 8 rows, so more programs share them."""
    if k > 4096:
        return (64, 256, 4, 4) if m <= 8 else (32, 256, 6, 4)
    return (64, 128, 4, 4) if n > 8192 else (64, 128, 6, 4)


# Beyond HALF_FEW_ROWS and up to SPLIT_ROWS rows (bf16/fp16) or FP8_SPLIT_ROWS rows (FP8),
# products take the split-K kernel. bf16: off (SPLIT_ROWS = HALF_FEW_ROWS, cuBLAS), since on
# an H100 at 64 rows its best tiles tied cuBLAS on the 8B shapes (170.8 against 169.7 µs a
# layer, 2026-12-05, benchmarks/kernels.py --part splitk). FP8: on, in place of the few-rows
# kernel's one tile: the batch-64 decode graph of the 8B with FP8 weights replayed in 6.04 ms
# against 6.44 and 6.05 against 6.19 (H100, 2026-12-06, two calls of `benchmarks.fp8 --batches
# 64 [--split-rows 32]`; docs/performance.md "FP8 at batch 64").
SPLIT_ROWS = HALF_FEW_ROWS
FP8_SPLIT_ROWS = 64


def split_rows(x: torch.Tensor, fp8: bool = False) -> bool:
    """A decode step of 33-64 sequences or a 33-64-token prefill step (issue 18's cached turn)
    whose products take the split-K kernel: products that still read every weight for few
    rows, where a 64-row tile of N = 4096 gives 64 programs for 132 SMs and cuBLAS reads the
    weights at 66-88% of the copy rate."""
    last = FP8_SPLIT_ROWS if fp8 else SPLIT_ROWS
    return HALF_FEW_ROWS < x.shape[0] <= last and x.stride(1) == 1


def _split_tile(n: int, k: int, fp8: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, stages, warps) of the split-K kernel: the best of the H100
    sweep at 64 rows on the 8B shapes, the same bytes a block for both dtypes: 128 columns a
    program for wide weights (gate_up), 64 otherwise; long rows (down) in two parts."""
    return (128 if n > 8192 else 64, 256 if fp8 else 128, 2 if k > 8192 else 1, 4, 4)


def many_rows_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T (+ bias) for T > 1 bf16/fp16 rows: Orbit's few-rows kernel up to
    HALF_FEW_ROWS, its split-K kernel up to SPLIT_ROWS (when on), cuBLAS beyond."""
    if few_rows(x):
        return _few_rows_mm(x, w, bias)
    if not split_rows(x):
        return F.linear(x, w, bias)
    from runtime import triton_kernels

    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    triton_kernels.split_k_mm(x, w, bias, out, _split_tile(*w.shape, False))
    return out


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T (+ bias): one row through Orbit's GEMV, more through
    many_rows_linear. With `scale` (an FP8 w's, per row, or per `block` for block scales;
    runtime/quant.py) one row only: the GEMV applies it."""
    if not one_row(x):
        return many_rows_linear(x, w, bias)
    return _gemv(x, w, bias, scale, block)


def _gemv(x: torch.Tensor, w: torch.Tensor, bias, scale, block, **fused) -> torch.Tensor:
    """x's row (or what `fused` makes of it: triton_kernels.gemv_rows) @ w^T (+ bias)
    through the GEMV at its tile, FP8 scales applied."""
    from runtime import triton_kernels

    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    tile = _rows_tile(*w.shape, scale is not None)
    triton_kernels.gemv_rows(x, w, bias, out, tile, w_scale=scale, w_block=block, **fused)
    return out


def silu_and_mul_linear(
    gate_up: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """silu_and_mul(gate_up) @ w^T; one row in one kernel."""
    if not one_row(gate_up):
        return many_rows_linear(silu_and_mul(gate_up), w, None)
    return _gemv(gate_up, w, None, scale, block, silu_mul=True)


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (float8 [T, K], float32 scales [T, K / group]): each group of `group`
    columns of a row scaled so its largest magnitude lands on the FP8 maximum (group = K: one
    scale per row)."""
    from runtime import triton_kernels

    t, k = x.shape
    out = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((t, k // group), dtype=torch.float32, device=x.device)
    if t:
        triton_kernels.quantize_rows(x, out, scales, group)
    return out, scales


FEW_ROWS = 64  # up to this many rows, Triton beats cuBLASLt (benchmarks/fp8.py)


def fp8_rowwise_mm(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, K] @ (w [N, K] float8 * scale [N] per row)^T (+ bias), on the FP8 tensor cores
    with x quantized per token: up to HALF_FEW_ROWS rows (decode batches) Orbit's few-rows
    kernel, which takes the weight's rows as the tensor cores' long side (0.6-0.7x cuBLASLt's
    time there on the 8B shapes, H200), from there up to FP8_SPLIT_ROWS its split-K kernel, up
    to FEW_ROWS the few-rows kernel again; more rows cuBLASLt's row-wise scaled GEMM."""
    return fp8_rowwise_mm_quantized(*quantize_rows(x, x.shape[1]), w, scale, bias, x.dtype)


def fp8_rowwise_mm_quantized(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_rowwise_mm of x already quantized per token: xq [T, K] float8, xs [T, 1]."""
    if xq.shape[0] <= FEW_ROWS:
        from runtime import triton_kernels

        out = torch.empty((xq.shape[0], w.shape[0]), dtype=dtype, device=xq.device)
        if split_rows(xq, fp8=True):
            tile = _split_tile(*w.shape, True)
            triton_kernels.split_k_mm(xq, w, bias, out, tile, xs=xs, ws=scale)
        elif xq.shape[0]:
            triton_kernels.few_rows_mm(xq, w, bias, out, (64, 256, 4, 4), xs=xs, ws=scale)
        return out
    out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale[None, :], out_dtype=dtype)
    return out if bias is None else out + bias


# FP8 products of more than one row take their input quantized by the kernel that computes it
# (the add + RMSNorm before qkv and gate_up, the SiLU-mul before down) rather than by a launch
# of its own after it: the batch-64 decode graph on an H100 spent 1.8 us on each of 128
# quantizing launches and 3.0 / 2.7 us on each norm / SiLU-mul (2026-12-06,
# `benchmarks.fp8 --profile`); fused, the graph replayed in 6.05 ms against 6.36. False: the
# separate launches (`benchmarks.fp8 --unfused-quantize`).
FUSE_QUANTIZE = True


def quantized_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(xq, xs, s): RMSNorm(s) * weight quantized per token (float8 [T, K], float32 [T, 1]) and
    the stream s = x + residual, written into residual (s = x when residual is None)."""
    from runtime import triton_kernels

    xq, xs = _quantized_like(x.shape[0], x.shape[1], x.device)
    if x.shape[0]:
        triton_kernels.quantize_product_input(x, residual, weight, eps, xq, xs, silu_mul=False)
    return xq, xs, x if residual is None else residual


def quantized_silu_and_mul(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of gate_up [T, 2 I], quantized per token: (float8 [T, I], float32 [T, 1])."""
    from runtime import triton_kernels

    xq, xs = _quantized_like(gate_up.shape[0], gate_up.shape[1] // 2, gate_up.device)
    if gate_up.shape[0]:
        triton_kernels.quantize_product_input(gate_up, None, None, 0.0, xq, xs, silu_mul=True)
    return xq, xs


def _quantized_like(t: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    xq = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=device)
    return xq, torch.empty((t, 1), dtype=torch.float32, device=device)


def fuses_quantize(x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether the FP8 products' input of these rows is quantized in the kernel that makes it:
    rows of unit column stride, a contiguous residual."""
    return FUSE_QUANTIZE and x.stride(-1) == 1 and (residual is None or residual.is_contiguous())


def fp8_block_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [T, K] @ (w [N, K] float8 scaled per block)^T (+ bias), x quantized per token and
    block of columns, in Orbit's Triton GEMM."""
    from runtime import triton_kernels

    xq, xs = quantize_rows(x, block[1])
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        triton_kernels.fp8_block_mm(xq, xs, w, scale, out, block)
    return out if bias is None else out + bias


def fuses_norm(x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether norm_linear takes these: one row, contiguous."""
    return one_row(x) and (residual is None or residual.is_contiguous())


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s) * norm_weight) @ w^T (+ bias) and s = x + residual (s = x when residual is
    None), for the rows fuses_norm accepts, in one kernel: every program of the GEMV
    normalises the rows itself."""
    stream = torch.empty_like(x) if residual is not None else None
    fused = {"norm_weight": norm_weight, "eps": eps, "residual": residual, "residual_out": stream}
    out = _gemv(x, w, bias, scale, block, **fused)
    return out, (x if stream is None else stream)
