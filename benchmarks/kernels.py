"""Kernel-level comparisons behind the CUDA path's choices, on the Llama-3.1-8B shapes (TP 1):
the decode-sized linear layers (cuBLAS against the copy rate), Orbit's one-row GEMV, paged
decode attention (FlashInfer's CUDA-core and tensor-core variants), and a layer's whole decode
attention, RoPE and KV write included: FlashInfer's path against Orbit's fused kernel; both
attention parts over bf16 or FP8 pages (--attention-kv, --decode-kv).

    python -m benchmarks.kernels --out DIR [--part linear,gemv,few,fewsmall,splitk,attention,decode,prefix]

Every kernel is timed inside a CUDA graph of many calls (as the decode graph runs them), over
enough distinct weight / KV copies that nothing is served from the 50 MB L2 cache. Results:
DIR/kernels.json and a printed table; attention variants are checked against the first.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.decode import copy_bandwidth

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 128256, 32, 8, 128
LINEARS = {  # name: (N, K) of the TP-1 weight
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
L2_FLUSH_BYTES = 512 << 20


def graph_us(calls, reps: int = 10) -> float:
    """Median µs per call of `calls` (a list of thunks) captured back to back in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # warm-up (Triton compiles, FlashInfer loads) outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(L2_FLUSH_BYTES / nbytes))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# ---- linear layers ---------------------------------------------------------------------


def bench_linear(name: str, m: int, bw: float) -> dict:
    n, k = LINEARS[name]
    nbytes = n * k * 2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies_for(nbytes))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row = {"name": name, "m": m, "n": n, "k": k, "weight_MB": nbytes / 1e6}
    row["copy_rate_us"] = nbytes / bw * 1e6
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws] * 4)
    # The same product over the weight stored transposed ([K, N]): cuBLAS picks other kernels.
    wts = [w.t().contiguous() for w in ws]
    row["cublas_transposed_us"] = graph_us([lambda w=w: x @ w for w in wts] * 4)
    if m == 1:
        row["mv_us"] = graph_us([lambda w=w: torch.mv(w, x[0]) for w in ws] * 4)
    return row


# ---- Orbit's one-row GEMV (runtime/triton_kernels.py) -----------------------------------

ROWS_SWEEP = [  # ("rows", BLOCK_N, num_warps, programs per SM)
    ("rows", bn, w, p) for bn in (1, 2, 4) for w in (4, 8, 16) for p in (2, 4, 8)
]


def bench_gemv(name: str, bw: float) -> dict:
    """cuBLAS against Orbit's one-row GEMV (runtime/triton_kernels.py `gemv_rows`: persistent,
    the whole row a tile) over its tile sweep, and, for the products the model fuses, the
    fused kernel against the unfused pair: down with the SiLU-mul before it, qkv and gate_up
    with the add + RMSNorm before them."""
    from runtime import cuda_ops, triton_kernels

    n, k = LINEARS[name]
    nbytes = n * k * 2
    copies = copies_for(nbytes)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    row = {"name": name, "weight_MB": nbytes / 1e6, "copy_rate_us": nbytes / bw * 1e6}
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws] * 4)
    row["tiles"] = []

    def time_tile(tile):
        def call(w):
            triton_kernels.gemv_rows(x, w, None, y, tile[1:])

        try:
            call(ws[0])
            err = rel_err(y, ref)
            us = graph_us([lambda w=w: call(w) for w in ws] * 4)
        except Exception as e:  # a tile that does not compile (registers) is skipped
            print(f"  {name} {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            return
        row["tiles"].append({"tile": tile, "us": us, "err": err})

    for tile in ROWS_SWEEP:
        if k <= 4096 or (tile[1] <= 2 and tile[2] >= 8):
            time_tile(tile)
    row["best"] = min(row["tiles"], key=lambda t: t["us"])
    # The fused forms the model runs, with the tiles it uses, against the unfused kernels.
    if name == "down":
        gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        fused = [lambda w=w: cuda_ops.silu_and_mul_linear(gu, w) for w in ws]
        unfused = [lambda w=w: F.linear(cuda_ops.silu_and_mul(gu), w) for w in ws]
        err = rel_err(fused[0](), unfused[0]())
    elif name in ("qkv", "gate_up"):
        h, res = torch.randn(2, 1, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

        a, r = h.clone(), res.clone()

        def unfused_call(w):  # in place on a and r: values drift over the replays, time not
            cuda_ops.fused_add_rms_norm(a, r, nw, 1e-5)
            return F.linear(a, w)

        fused = [lambda w=w: cuda_ops.norm_linear(h, res, nw, 1e-5, w, None)[0] for w in ws]
        unfused = [lambda w=w: unfused_call(w) for w in ws]
        err = rel_err(fused[0](), unfused[0]())
    else:
        return row
    row["fused_us"] = graph_us(fused * 4)
    row["unfused_us"] = graph_us(unfused * 4)
    row["fused_err"] = err
    return row


# ---- Orbit's few-rows kernel (runtime/triton_kernels.py `few_rows_mm`) -----------------

FEW_SWEEP = [  # (BLOCK_N, BLOCK_K, stages, warps)
    *((bn, bk, st, 4) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 6)),
    (64, 128, 4, 8),
]


def timed_tiles(label: str, tiles, calls, y: torch.Tensor, ref: torch.Tensor) -> list[dict]:
    """calls: one function of a tile per weight copy, each writing y. For each tile that
    compiles: its µs per call, all copies in one graph, and y's error against ref."""
    timed = []
    for tile in tiles:
        try:
            calls[0](tile)
            err = rel_err(y, ref)
            us = graph_us([lambda c=c, t=tile: c(t) for c in calls] * 4)
        except Exception as e:  # a tile that does not compile (shared memory) is skipped
            print(f"  {label} {tile}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        timed.append({"tile": tile, "us": us, "err": err})
    return timed


def bench_few(name: str, m: int, bw: float) -> dict:
    """cuBLAS against Orbit's few-rows kernel (W x^T on the tensor cores) over its tile sweep,
    and the tile runtime/cuda_ops.py picks, for an m-row product of the 8B shape `name`."""
    from runtime import cuda_ops, triton_kernels

    n, k = LINEARS[name]
    nbytes = n * k * 2
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        for _ in range(copies_for(nbytes))
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    row = {"name": name, "m": m, "weight_MB": nbytes / 1e6, "copy_rate_us": nbytes / bw * 1e6}
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws] * 4)
    row["picked_tile"] = cuda_ops._few_tile(n, k, m)
    calls = [lambda t, w=w: triton_kernels.few_rows_mm(x, w, None, y, t) for w in ws]
    row["tiles"] = timed_tiles(f"{name} M={m}", FEW_SWEEP, calls, y, ref)
    row["best"] = min(row["tiles"], key=lambda t: t["us"])
    picked = [t for t in row["tiles"] if tuple(t["tile"]) == row["picked_tile"]]
    row["picked_us"] = picked[0]["us"] if picked else None
    return row


# ---- the few-rows kernel on SmolLM2-135M's launch-bound shapes (issue 19) --------------
# With --exact-verification every step of 1 to 32 rows takes the few-rows kernel at ROWS = 32
# and one tile, the 8B's (64 wide), which leaves SmolLM2's small weights few programs (down,
# 576 x 1536: 9 programs of 12 K-steps each) where its one-token steps cost 0.86 ms against the
# GEMV's 0.60 (H200). Any tile that depends on the shape alone keeps the rows exact, so this
# sweeps narrower and deeper tiles, launched early as the runtime launches these weights, one
# row through ROWS = 32 as a one-token step runs them.

SMOLLM2_LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SMALL_SWEEP = [  # (BLOCK_N, BLOCK_K, stages, warps)
    (bn, bk, st, w)
    for bn in (16, 32, 64)
    for bk in (64, 128, 256)
    for st, w in ((2, 4), (4, 4), (3, 2))
]


def bench_few_small(name: str, bw: float) -> dict:
    from runtime import cuda_ops, triton_kernels

    n, k = SMOLLM2_LINEARS[name]
    nbytes = n * k * 2
    rows = cuda_ops.HALF_FEW_ROWS
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        for _ in range(copies_for(nbytes))
    ]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    row = {"name": name, "n": n, "k": k, "weight_MB": nbytes / 1e6}
    row["copy_rate_us"] = nbytes / bw * 1e6
    row["gemv_us"] = graph_us(
        [lambda w=w: triton_kernels.gemv_rows(x, w, None, y, cuda_ops._rows_tile(n, k)) for w in ws]
    )
    row["picked_tile"] = cuda_ops._few_tile(n, k, rows)
    calls = [
        lambda t, w=w: triton_kernels.few_rows_mm(x, w, None, y, t, early=True, rows=rows)
        for w in ws
    ]
    row["tiles"] = timed_tiles(f"{name} one row as {rows}", SMALL_SWEEP, calls, y, ref)
    row["best"] = min(row["tiles"], key=lambda t: t["us"])
    picked = [t for t in row["tiles"] if tuple(t["tile"]) == row["picked_tile"]]
    row["picked_us"] = picked[0]["us"] if picked else None
    return row


# ---- split-K products of 64 rows (an experiment for issues 18, 20 and 16) ---------------
# At 64 rows the few-rows kernel lost to cuBLAS on every 8B shape and cuBLAS reads the weights
# at 66-88% of the copy rate (H200): a 64-row tile of x over N = 4096 gives only 64 programs
# for 132 SMs. The runtime's split-K kernel (`triton_kernels.split_k_mm`) gives a program a
# BLOCK_N slice of the weight over 1/SPLIT of K and sums the parts in a fixed order in a second
# kernel: the same result on every run, and a workspace a graph can take from its pool. Every
# tile is timed so; the best tile also with the parts meeting through float32 atomics in a
# zeroed workspace (a kernel of this file's own), to show what the fixed order costs. The
# H100's answer (2026-12-05, docs/performance.md): bf16 ties cuBLAS, FP8 5% over the few-rows
# tile.

SPLITK_SWEEP = [  # (BLOCK_N, BLOCK_K, SPLIT, stages, warps)
    *((bn, bk, sp, 4, 4) for bn in (64, 128) for bk in (64, 128) for sp in (1, 2, 4, 8)),
    (128, 128, 4, 4, 8),
    (256, 64, 4, 3, 8),
    (256, 64, 8, 3, 8),
]


@functools.cache
def _atomic_splitk_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk(
        x_ptr,
        w_ptr,
        xs_ptr,
        ws_ptr,
        acc_ptr,
        M,
        N,
        x_stride,
        K: tl.constexpr,
        K_PART: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALED: tl.constexpr,
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, ROWS)
        rk = tl.arange(0, BLOCK_K)
        k_first = tl.program_id(1) * K_PART
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_first, k_first + K_PART, BLOCK_K):
            k = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * x_stride + k[None, :], mask=(rm < M)[:, None])
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + k[None, :], mask=(rn < N)[:, None])
            acc = tl.dot(x, tl.trans(w), acc)
        if SCALED:
            xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
            ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
            acc = acc * xs[:, None] * ws[None, :]
        ptrs = acc_ptr + rm[:, None] * N + rn[None, :]
        tl.atomic_add(ptrs, acc, mask=(rm < M)[:, None] & (rn < N)[None, :], sem="relaxed")

    @triton.jit
    def settle(acc_ptr, out_ptr, total, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(acc_ptr + i, mask=i < total)
        tl.store(out_ptr + i, a.to(out_ptr.dtype.element_ty), mask=i < total)
        tl.store(acc_ptr + i, tl.zeros_like(a), mask=i < total)

    return splitk, settle


def atomic_splitk_mm(x, w, acc, out, tile, xs=None, ws=None) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T with SPLIT > 1 parts added through atomics into acc,
    a zeroed float32 [M, N] workspace, zeroed again on return; with xs [M] and ws [N], x and w
    are float8 scaled per row. tile = (BLOCK_N, BLOCK_K, SPLIT, stages, warps)."""
    import triton

    splitk, settle = _atomic_splitk_kernels()
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, split, stages, warps = tile
    if k % (split * block_k):
        raise ValueError(f"K {k} is not a multiple of SPLIT x BLOCK_K {split * block_k}")
    splitk[(triton.cdiv(n, block_n), split)](
        x,
        w,
        xs if xs is not None else x,
        ws if ws is not None else w,
        acc,
        m,
        n,
        x.stride(0),
        K=k,
        K_PART=k // split,
        ROWS=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SCALED=xs is not None,
        num_stages=stages,
        num_warps=warps,
    )
    settle[(triton.cdiv(m * n, 1024),)](acc, out, m * n, BLOCK=1024)


def bench_splitk(name: str, m: int, bw: float, fp8: bool = False) -> dict:
    """cuBLAS (cuBLASLt's row-wise scaled GEMM for float8) against the runtime's split-K kernel
    over the sweep, the best tile also through atomics, and the tile the runtime's rule picks,
    for an m-row product of `name`; float8: also the few-rows kernel's FP8 tile."""
    from runtime import cuda_ops, triton_kernels

    n, k = LINEARS[name]
    nbytes = n * k * (1 if fp8 else 2)
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        for _ in range(copies_for(nbytes))
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    zeroed = torch.zeros(m * n, device="cuda", dtype=torch.float32)
    row = {"name": name, "m": m, "fp8": fp8, "weight_MB": nbytes / 1e6}
    row["copy_rate_us"] = nbytes / bw * 1e6
    if fp8:
        f8 = torch.float8_e4m3fn
        scales = [w.abs().amax(1).float() / 448 for w in ws]
        ws = [(w / s[:, None]).to(f8) for w, s in zip(ws, scales)]
        xs = x.abs().amax(1).float() / 448
        x = (x / xs[:, None]).to(f8)
        ref = ((x.float() * xs[:, None]) @ (ws[0].float() * scales[0][:, None]).t()).float()
        cublas = [
            lambda w=w, s=s: torch._scaled_mm(
                x, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16
            )
            for w, s in zip(ws, scales)
        ]
        row["cublas_us"] = graph_us(cublas * 4)
        few = [
            lambda w=w, s=s: triton_kernels.few_rows_mm(
                x, w, None, y, (64, 256, 4, 4), xs=xs[:, None], ws=s
            )
            for w, s in zip(ws, scales)
        ]
        row["few_rows_us"] = graph_us(few * 4)

        # W x^T on cuBLASLt, the weight as the long side as the few-rows kernel takes it
        # (M = N, N = m rows), then the transpose into the [m, N] rows the next kernel reads
        def swapped(w, s, copy: bool):
            yt = torch._scaled_mm(
                w, x.t(), scale_a=s[:, None], scale_b=xs[None, :], out_dtype=torch.bfloat16
            )
            return yt.t().contiguous() if copy else yt

        row["cublas_swapped_gemm_us"] = graph_us(
            [lambda w=w, s=s: swapped(w, s, False) for w, s in zip(ws, scales)] * 4
        )
        row["cublas_swapped_us"] = graph_us(
            [lambda w=w, s=s: swapped(w, s, True) for w, s in zip(ws, scales)] * 4
        )
        got = swapped(ws[0], scales[0], True).float()
        row["cublas_swapped_err"] = ((got - ref).norm() / ref.norm()).item()
        # the same bytes a step as bf16's tiles
        tiles = [(bn, bk * 2, *rest) for bn, bk, *rest in SPLITK_SWEEP]
    else:
        ref = F.linear(x, ws[0]).float()
        row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws] * 4)
        scales, xs, tiles = [None] * len(ws), None, SPLITK_SWEEP
    calls = [
        lambda t, w=w, s=s: triton_kernels.split_k_mm(x, w, None, y, t, xs=xs, ws=s)
        for w, s in zip(ws, scales)
    ]
    row["tiles"] = timed_tiles(f"{name} M={m}", tiles, calls, y, ref)
    row["best"] = min(row["tiles"], key=lambda t: t["us"])
    best = tuple(row["best"]["tile"])
    if best[2] > 1:
        atomic_calls = [
            lambda t, w=w, s=s: atomic_splitk_mm(x, w, zeroed, y, t, xs=xs, ws=s)
            for w, s in zip(ws, scales)
        ]
        atomic = timed_tiles(f"{name} M={m} atomic", [best], atomic_calls, y, ref)
        row["best_atomic"] = atomic[0] if atomic else None
    row["picked_tile"] = cuda_ops._split_tile(n, k, fp8)
    picked = [t for t in row["tiles"] if tuple(t["tile"]) == row["picked_tile"]]
    if not picked:
        picked = timed_tiles(f"{name} M={m} picked", [row["picked_tile"]], calls, y, ref)
    row["picked_us"] = picked[0]["us"] if picked else None
    return row


# ---- decode attention ------------------------------------------------------------------


ATTENTION_VARIANTS = {
    "fa2-cudacore": dict(use_tensor_cores=False, backend="fa2", plan={}),
    "fa2-cudacore-nosplit": dict(
        use_tensor_cores=False, backend="fa2", plan={"disable_split_kv": True}
    ),
    "tc-fa3": dict(use_tensor_cores=True, backend="fa3", plan={}),
    "tc-fa2": dict(use_tensor_cores=True, backend="fa2", plan={}),
}


def paged_caches(batch: int, context: int, layers: int, kv: str = "bf16"):
    """(page size, pages per sequence, one random paged cache per layer, bf16 or FP8 (e4m3, unit
    scales), page indptr and last-page lengths on the host): `batch` sequences of `context`
    tokens, pages in order."""
    page = 16
    pages_per_seq = -(-context // page)
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    caches = [
        torch.randn(
            batch * pages_per_seq, 2, page, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16
        ).to(kv_dtype)
        for _ in range(layers)
    ]
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    last = torch.full((batch,), context - (pages_per_seq - 1) * page, dtype=torch.int32)
    return page, pages_per_seq, caches, indptr, last


def bench_attention(
    batch: int, context: int, layers: int, variants: list[str], bw: float, kv: str = "bf16"
) -> dict:
    """Each decode variant over `batch` sequences of `context` tokens, per layer, with bf16 or
    FP8 (e4m3, unit scales) pages; errors against the first variant that runs."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    page, pages_per_seq, caches, indptr, last = paged_caches(batch, context, layers, kv)
    kv_dtype = caches[0].dtype
    num_pages = batch * pages_per_seq
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_bytes = layers * batch * context * KV_HEADS * HEAD_DIM * 2 * caches[0].element_size()
    row = {
        "batch": batch,
        "context": context,
        "kv": kv,
        "kv_MB_per_layer": kv_bytes / layers / 1e6,
    }
    ref = None
    for name in variants:
        v = ATTENTION_VARIANTS[name]
        t0 = time.perf_counter()
        try:
            workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            ind = torch.arange(num_pages, dtype=torch.int32, device="cuda")
            w = BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=v["use_tensor_cores"],
                paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
                paged_kv_indices_buffer=ind,
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device="cuda"),
                backend=v["backend"],
            )
            w.plan(
                indptr,
                ind,
                last,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                page,
                q_data_type=torch.bfloat16,
                kv_data_type=kv_dtype,
                **v["plan"],
            )
            out = w.run(q, caches[0])
            if ref is None:
                ref = out
            row[name] = {
                "us_per_layer": graph_us([lambda c=c: w.run(q, c) for c in caches]),
                "err": rel_err(out, ref),
                "first_use_s": time.perf_counter() - t0,
            }
        except Exception as e:  # a variant this FlashInfer cannot run here is reported
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    row["copy_rate_us_per_layer"] = kv_bytes / layers / bw * 1e6
    return row


FUSED_CONFIGS = [  # (tokens per block, minimum tokens per split, warps) of decode_attention
    (64, 128, 8),
    (64, 64, 8),
    (32, 128, 8),
    (64, 256, 8),
    (32, 64, 8),
]
# the tiles also timed with the page list read the other way than the default for the pages'
# dtype (triton_kernels.DECODE_PAGES_AHEAD: a block ahead over FP8 pages, just before over bf16)
PAGES_AHEAD_CONFIGS = [(64, 128, 8), (64, 256, 8)]
# the tiles also timed with the splits' states merged the other way than the default
# (triton_kernels.SPLIT_MERGE_ONE_PASS: one pass)
ONE_PASS_CONFIGS = [(64, 128, 8), (64, 64, 8)]


def _unlike(switch: str, value: bool, default: bool) -> list[str]:
    """A tile's label for a variant switch set otherwise than the default: "one-pass merge"
    or "not one-pass merge"; nothing when it is the default."""
    return [] if value == default else [switch if value else f"not {switch}"]


def bench_fused_decode(batch: int, context: int, layers: int, bw: float, kv: str = "bf16") -> dict:
    """A layer's whole decode attention as the decode graph runs it: FlashInfer's path
    (RoPE + KV write kernel, tensor-core decode, split merge; DecodeAttention) against Orbit's
    one kernel (FusedDecodeAttention) in each FUSED_CONFIGS tile, at `context` tokens a row,
    over bf16 or FP8 (e4m3, unit scales) pages."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    from runtime import cuda_ops, triton_kernels

    page, pages_per_seq, caches, indptr, last = paged_caches(batch, context, layers, kv)
    kv_dtype = caches[0].dtype
    num_pages = batch * pages_per_seq
    dev = "cuda"
    qkv = torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : HEADS * HEAD_DIM].view(batch, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(batch, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(batch, KV_HEADS, HEAD_DIM)
    angle = torch.rand(batch, HEAD_DIM, device=dev) * 6.28
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    last_len = int(last[0])
    indices = torch.arange(num_pages, dtype=torch.int32, device=dev)
    write_pages = (torch.arange(batch, device=dev) + 1) * pages_per_seq - 1
    write_offsets = torch.full((batch,), last_len - 1, dtype=torch.int64, device=dev)
    scale = HEAD_DIM**-0.5
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * caches[0].element_size()
    row = {"batch": batch, "context": context, "kv": kv, "kv_MB_per_layer": kv_bytes / 1e6}

    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev),
        backend="fa2",
    )
    w.plan(
        indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page, q_data_type=torch.bfloat16,
        kv_data_type=kv_dtype,
    )  # fmt: skip

    def flashinfer(c):
        rotated = cuda_ops.rope_and_store_kv(q, k, v, cos, sin, c, write_pages, write_offsets)
        return w.run(rotated, c)

    ref = flashinfer(caches[0])
    row["flashinfer_us"] = graph_us([lambda c=c: flashinfer(c) for c in caches])
    splits = triton_kernels.decode_splits(batch, KV_HEADS, torch.device(dev))
    work = triton_kernels.decode_workspace(
        batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, splits, dev
    )
    dev_indptr, dev_last = indptr.to(dev), last.to(dev)
    out = torch.empty(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    row["splits"], row["fused"] = splits, []
    # over FP8 pages the products run in float16 (the default) and, to compare, in bf16
    product_kinds = (True, False) if kv == "fp8" else (True,)
    ahead_now = kv_dtype in triton_kernels.DECODE_PAGES_AHEAD
    one_pass_now = triton_kernels.SPLIT_MERGE_ONE_PASS
    configs = [(f16, *c, ahead_now, one_pass_now) for f16 in product_kinds for c in FUSED_CONFIGS]
    configs += [(True, *c, not ahead_now, one_pass_now) for c in PAGES_AHEAD_CONFIGS]
    configs += [(True, *c, ahead_now, not one_pass_now) for c in ONE_PASS_CONFIGS]
    for f16, block_t, min_chunk, warps, ahead, one_pass in configs:

        def fused(c, block_t=block_t, min_chunk=min_chunk, warps=warps):
            triton_kernels.decode_attention(
                q, k, v, cos, sin, c, dev_indptr, indices, dev_last, write_pages,
                write_offsets, out, work, scale, splits, block_t=block_t,
                min_chunk=min_chunk, num_warps=warps,
            )  # fmt: skip

        with triton_kernels.switched(
            FP8_PAGES_F16_PRODUCTS=f16,
            DECODE_PAGES_AHEAD=frozenset({kv_dtype}) if ahead else frozenset(),
            SPLIT_MERGE_ONE_PASS=one_pass,
        ):
            fused(caches[0])
            err = rel_err(out, ref)
            us = graph_us([lambda c=c: fused(c) for c in caches])
        products = "f16" if f16 and kv == "fp8" else "model dtype"
        tile = [block_t, min_chunk, warps] + _unlike("pages ahead", ahead, ahead_now)
        tile += _unlike("one-pass merge", one_pass, one_pass_now)
        row["fused"].append({"tile": tile, "products": products, "us": us, "err": err})
    row["best"] = min(row["fused"], key=lambda r: r["us"])
    if kv == "fp8":
        row["best_bf16_products"] = min(
            (r for r in row["fused"] if r["products"] != "f16"), key=lambda r: r["us"]
        )
    row["copy_rate_us"] = kv_bytes / bw * 1e6
    return row


PREFIX_CONFIGS = [  # (query tokens a block, tokens a key block, minimum tokens a split, warps)
    (16, 64, 128, 8),
    (16, 64, 256, 8),
    (16, 32, 128, 8),
    (8, 64, 128, 8),
    (32, 64, 128, 8),
    # fewer, longer splits: the last split merges the others' states one after another, 64
    # rows each (256 tokens a split was the best of the five above, 2026-12-07)
    (16, 64, 512, 8),
    (16, 64, 1024, 8),
]
# the tiles also timed with the splits' states merged the other way than the default
# (triton_kernels.SPLIT_MERGE_ONE_PASS)
PREFIX_ONE_PASS_CONFIGS = [(16, 64, 128, 8), (16, 64, 256, 8), (16, 64, 512, 8)]


def bench_prefix(seqs: int, new: int, context: int, bw: float, kv: str = "bf16") -> dict:
    """A layer's attention for a step of `seqs` sequences bringing `new` tokens each, `context`
    tokens in all (the new ones included): a turn after a cached prefix. FlashInfer's paged
    prefill in CUDA-graph mode as the prefill graphs run it (FA3 over bf16 pages on Hopper, FA2
    over FP8; and FA2 over bf16 beside it) against Orbit's split-context kernel
    (triton_kernels.prefix_attention) in each PREFIX_CONFIGS tile. The queries come rotated and
    the new tokens' KV written, as in both paths after the shared RoPE + KV-write kernel."""
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper

    from runtime import triton_kernels
    from runtime.cuda_attention import prefill_backend

    dev = "cuda"
    kv_bytes = seqs * context * KV_HEADS * HEAD_DIM * 2 * (1 if kv == "fp8" else 2)
    page, pages_per_seq, caches, indptr, last = paged_caches(
        seqs, context, copies_for(kv_bytes), kv
    )
    kv_dtype = caches[0].dtype
    tokens = seqs * new
    qo = torch.arange(seqs + 1, dtype=torch.int32) * new
    indices = torch.arange(seqs * pages_per_seq, dtype=torch.int32, device=dev)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    row = {"seqs": seqs, "new": new, "context": context, "kv": kv,
           "kv_MB_per_layer": kv_bytes / 1e6, "copy_rate_us": kv_bytes / bw * 1e6}  # fmt: skip
    # the runtime's choice first (FA3 over bf16 pages on Hopper), FA2 beside it
    backends = ["fa2"] if kv == "fp8" else [prefill_backend(torch.device(dev), None)]
    backends += ["fa2"] if backends[0] != "fa2" else []
    ref = None
    for backend in backends:
        workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        w = BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(seqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=torch.zeros(seqs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=torch.zeros(seqs, dtype=torch.int32, device=dev),
            backend=backend,
        )
        w.plan(
            qo, indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, page, causal=True,
            sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
        )  # fmt: skip
        out = w.run(q, caches[0])
        ref = out if ref is None else ref
        row[backend] = {
            "us": graph_us([lambda c=c, w=w: w.run(q, c) for c in caches]),
            "err": rel_err(out, ref),
        }
    dev_qo, dev_indptr, dev_last = qo.to(dev), indptr.to(dev), last.to(dev)
    out = torch.empty(tokens, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    row["orbit"] = []
    one_pass_now = triton_kernels.SPLIT_MERGE_ONE_PASS
    configs = [(*c, one_pass_now) for c in PREFIX_CONFIGS]
    configs += [(*c, not one_pass_now) for c in PREFIX_ONE_PASS_CONFIGS]
    for q_tokens, block_t, min_chunk, warps, one_pass in configs:
        blocks = triton_kernels.prefix_blocks(tokens, seqs, q_tokens)
        splits = triton_kernels.prefix_splits(tokens, q_tokens, KV_HEADS, torch.device(dev))
        work = triton_kernels.prefix_workspace(
            blocks, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, splits, q_tokens, dev
        )

        def orbit(c, q_tokens=q_tokens, block_t=block_t, min_chunk=min_chunk, warps=warps,
                  blocks=blocks, splits=splits, work=work):  # fmt: skip
            triton_kernels.prefix_attention(
                q, c, dev_qo, dev_indptr, indices, dev_last, out, work, scale, splits, blocks,
                q_tokens=q_tokens, block_t=block_t, min_chunk=min_chunk, num_warps=warps,
            )  # fmt: skip

        tile = [q_tokens, block_t, min_chunk, warps]
        tile += _unlike("one-pass merge", one_pass, one_pass_now)
        try:
            with triton_kernels.switched(SPLIT_MERGE_ONE_PASS=one_pass):
                orbit(caches[0])
                err = rel_err(out, ref)
                us = graph_us([lambda c=c: orbit(c) for c in caches])
            row["orbit"].append({"tile": tile, "splits": splits, "us": us, "err": err})
        except Exception as e:  # a tile that does not compile or fit here is reported
            error = f"{type(e).__name__}: {str(e)[:300]}"
            row["orbit"].append({"tile": tile, "error": error})
    timed = [r for r in row["orbit"] if "us" in r]
    row["best"] = min(timed, key=lambda r: r["us"]) if timed else None
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--part", default="linear,attention")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--few-rows", default="2,5,8,16,32,64")
    p.add_argument("--splitk-rows", default="64")
    p.add_argument("--splitk-fp8", action="store_true", help="splitk: float8 weights and rows")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--variants", default=",".join(ATTENTION_VARIANTS))
    p.add_argument(
        "--attention-contexts",
        default="512",
        help="attention: tokens per sequence (beyond 512 over 4 layers, so big batches fit)",
    )
    p.add_argument("--attention-kv", default="bf16", help="attention: bf16, fp8 or bf16,fp8")
    p.add_argument(
        "--decode-cases",
        default="1x512,2x512,4x512,8x512,16x512,32x512,64x512,1x2048,1x8192,8x4096",
        help="decode: BATCHxCONTEXT cases",
    )
    p.add_argument("--decode-kv", default="bf16", help="decode: bf16, fp8 or bf16,fp8")
    p.add_argument(
        "--prefix-cases",
        default="1x64x2112,1x64x576,1x64x4160,4x64x2112,1x16x2064,1x256x2304",
        help="prefix: SEQSxNEWxCONTEXT cases (context: tokens a sequence, the new ones included)",
    )
    p.add_argument("--prefix-kv", default="bf16", help="prefix: bf16, fp8 or bf16,fp8")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12}
    parts = args.part.split(",")
    rows = [int(r) for r in args.rows.split(",")]

    def save():
        (out / "kernels.json").write_text(json.dumps(result, indent=2))

    if "linear" in parts:
        result["linear"] = []
        for m in rows:
            for name in LINEARS:
                r = bench_linear(name, m, bw)
                result["linear"].append(r)
                print(
                    f"{name:>8} M={m} {r['weight_MB']:7.1f} MB  at the copy rate "
                    f"{r['copy_rate_us']:6.1f} µs  cuBLAS {r['cublas_us']:6.1f} µs, "
                    f"over W^T {r['cublas_transposed_us']:6.1f} µs, "
                    f"mv {r.get('mv_us', float('nan')):6.1f} µs",
                    flush=True,
                )
                save()
    if "gemv" in parts:
        result["gemv"] = []
        for name in LINEARS:
            r = bench_gemv(name, bw)
            result["gemv"].append(r)
            b = r["best"]
            fused = (
                f"  fused {r['fused_us']:6.1f} µs against {r['unfused_us']:6.1f} unfused"
                f" (err {r['fused_err']:.1e})"
                if "fused_us" in r
                else ""
            )
            print(
                f"gemv {name:>8} copy {r['copy_rate_us']:6.1f} µs  "
                f"cuBLAS {r['cublas_us']:6.1f} µs  best {b['us']:6.1f} µs {b['tile']}{fused}",
                flush=True,
            )
            save()
    if "few" in parts:
        result["few"] = []
        for m in [int(r) for r in args.few_rows.split(",")]:
            for name in LINEARS:
                r = bench_few(name, m, bw)
                result["few"].append(r)
                b = r["best"]
                print(
                    f"few {name:>8} M={m:>2} copy {r['copy_rate_us']:6.1f} µs  "
                    f"cuBLAS {r['cublas_us']:6.1f} µs  picked {r['picked_us'] or float('nan'):6.1f} µs  "
                    f"best {b['us']:6.1f} µs {b['tile']} (err {b['err']:.1e})",
                    flush=True,
                )
                save()
    if "fewsmall" in parts:
        result["fewsmall"] = []
        for name in SMOLLM2_LINEARS:
            r = bench_few_small(name, bw)
            result["fewsmall"].append(r)
            b = r["best"]
            print(
                f"fewsmall {name:>8} copy {r['copy_rate_us']:5.1f} µs  GEMV {r['gemv_us']:5.1f} "
                f"µs  picked {r['picked_us'] or float('nan'):5.1f} µs  best {b['us']:5.1f} µs "
                f"{b['tile']} (err {b['err']:.1e})",
                flush=True,
            )
            save()
        best = {f"{r['n']}x{r['k']}": r["best"]["tile"] for r in result["fewsmall"]}
        (out / "few_small_tiles.json").write_text(json.dumps(best))
    if "splitk" in parts:
        result["splitk"] = []
        for m in [int(r) for r in args.splitk_rows.split(",")]:
            for name in LINEARS:
                r = bench_splitk(name, m, bw, args.splitk_fp8)
                result["splitk"].append(r)
                b = r["best"]
                few = f"  few-rows {r['few_rows_us']:6.1f} µs" if "few_rows_us" in r else ""
                if "cublas_swapped_us" in r:
                    few += (
                        f"  cuBLAS W x^T {r['cublas_swapped_gemm_us']:6.1f} µs, with the"
                        f" transpose {r['cublas_swapped_us']:6.1f} µs"
                        f" (err {r['cublas_swapped_err']:.1e})"
                    )
                atomic = r.get("best_atomic")
                few += f"  atomic {atomic['us']:6.1f} µs" if atomic else ""
                few += f"  picked {r['picked_us'] or float('nan'):6.1f} µs {r['picked_tile']}"
                print(
                    f"splitk{' fp8' if r['fp8'] else ''} {name:>8} M={m:>3} copy "
                    f"{r['copy_rate_us']:6.1f} µs  cuBLAS {r['cublas_us']:6.1f} µs{few}  best "
                    f"{b['us']:6.1f} µs {b['tile']} (err {b['err']:.1e})",
                    flush=True,
                )
                save()
    if "attention" in parts:
        result["attention"] = []
        cases = [
            (b, ctx, kv)
            for kv in args.attention_kv.split(",")
            for ctx in (int(x) for x in args.attention_contexts.split(","))
            for b in (int(x) for x in args.batches.split(","))
        ]
        for b, ctx, kv in cases:
            variants = [v for v in args.variants.split(",") if not (kv == "fp8" and "fa3" in v)]
            r = bench_attention(b, ctx, 32 if ctx <= 512 else 4, variants, bw, kv)
            result["attention"].append(r)
            cells = "  ".join(
                f"{k}: {v['us_per_layer']:.1f} µs (err {v['err']:.1e})"
                if "us_per_layer" in v
                else f"{k}: {v['error'][:80]}"
                for k, v in r.items()
                if isinstance(v, dict)
            )
            print(
                f"attention {kv} b={b} ctx={ctx} copy-rate {r['copy_rate_us_per_layer']:.1f} µs"
                f"  {cells}",
                flush=True,
            )
            save()
    if "decode" in parts:
        result["decode"] = []
        cases = [
            (kv, *map(int, case.split("x")))
            for kv in args.decode_kv.split(",")
            for case in args.decode_cases.split(",")
        ]
        for kv, b, ctx in cases:
            # 32 layers' caches up to 64 x 512 tokens, fewer beyond (at least 2: past L2)
            layers = max(2, min(32, (64 * 512 * 32) // (b * ctx)))
            r = bench_fused_decode(b, ctx, layers, bw, kv)
            result["decode"].append(r)
            best = r["best"]
            print(
                f"decode attention {kv} b={b} ctx={ctx} copy-rate {r['copy_rate_us']:.1f} µs  "
                f"FlashInfer {r['flashinfer_us']:.1f} µs  fused {best['us']:.1f} µs "
                f"{best['tile']} {best['products']} (err {best['err']:.1e}, splits "
                f"{r['splits']})"
                + (
                    f"  bf16 products {r['best_bf16_products']['us']:.1f} µs"
                    if "best_bf16_products" in r
                    else ""
                )
                + "  all "
                + " ".join(f"{x['us']:.1f}" for x in r["fused"]),
                flush=True,
            )
            save()
    if "prefix" in parts:
        result["prefix"] = []
        for kv in args.prefix_kv.split(","):
            for case in args.prefix_cases.split(","):
                seqs, new, ctx = (int(x) for x in case.split("x"))
                r = bench_prefix(seqs, new, ctx, bw, kv)
                result["prefix"].append(r)
                best = r["best"] or {"us": float("nan"), "tile": None, "err": float("nan")}
                flashinfer = "  ".join(f"{b} {r[b]['us']:.1f} µs" for b in ("fa3", "fa2") if b in r)
                print(
                    f"prefix attention {kv} {seqs}x{new} ctx={ctx} copy-rate "
                    f"{r['copy_rate_us']:.1f} µs  {flashinfer}  orbit {best['us']:.1f} µs "
                    f"{best['tile']} (err {best['err']:.1e})  all "
                    + " ".join(f"{x['us']:.1f}" if "us" in x else "x" for x in r["orbit"]),
                    flush=True,
                )
                save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
