"""Triton kernels for the small elementwise steps of the CUDA path: each replaces several
PyTorch launches by one, which is what counts at decode, where a step is hundreds of tiny
kernels between the weight reads. Imported only on CUDA (runtime/cuda_ops.py); every kernel
computes in float32 and rounds once to the output dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    pages_ptr,
    offsets_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    cs_stride_t,
    page_stride,
    kv_stride,
    slot_stride,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # One program per (token, head) over q's heads then the kv heads. NeoX half rotation:
    # out[:h] = x1 cos1 - x2 sin1, out[h:] = x2 cos2 + x1 sin2 (h = head_dim / 2). q goes to
    # q_out; a kv head's rotated k and its v go straight to the token's (page, slot) of the
    # paged cache [P, 2, page_size, hkv, hd], so k is never written anywhere else.
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    if head < NUM_Q_HEADS:
        src = q_ptr + t * q_stride_t + head * q_stride_h
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * 2 * HALF
    else:
        kv_head = head - NUM_Q_HEADS
        src = k_ptr + t * k_stride_t + kv_head * k_stride_h
        page = tl.load(pages_ptr + t)
        slot = tl.load(offsets_ptr + t)
        dst = cache_ptr + page * page_stride + slot * slot_stride + kv_head * 2 * HALF
        v_src = v_ptr + t * v_stride_t + kv_head * v_stride_h
        v1 = tl.load(v_src + offs, mask=mask)
        v2 = tl.load(v_src + HALF + offs, mask=mask)
        tl.store(dst + kv_stride + offs, v1, mask=mask)
        tl.store(dst + kv_stride + HALF + offs, v2, mask=mask)
    x1 = tl.load(src + offs, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask).to(tl.float32)
    cs = cos_ptr + t * cs_stride_t
    sn = sin_ptr + t * cs_stride_t
    c1 = tl.load(cs + offs, mask=mask).to(tl.float32)
    c2 = tl.load(cs + HALF + offs, mask=mask).to(tl.float32)
    s1 = tl.load(sn + offs, mask=mask).to(tl.float32)
    s2 = tl.load(sn + HALF + offs, mask=mask).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(dst + offs, (x1 * c1 - x2 * s1).to(out_ty), mask=mask)
    tl.store(dst + HALF + offs, (x2 * c2 + x1 * s2).to(out_ty), mask=mask)


def rope_store_kv(q, k, v, q_out, cache, cos, sin, pages, offsets) -> None:
    """q [T, hq, hd], k, v [T, hkv, hd] (any token/head strides, unit last stride): rotated q
    into contiguous q_out; rotated k and v into cache [P, 2, page_size, hkv, hd] (contiguous)
    at (pages[t], offsets[t]) (int64 [T]); cos, sin [T, hd] with unit last stride."""
    num_tokens, hq, hd = q.shape
    hkv = k.shape[1]
    half = hd // 2
    _rope_store_kv_kernel[(num_tokens, hq + hkv)](
        q,
        k,
        v,
        q_out,
        cache,
        cos,
        sin,
        pages,
        offsets,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        NUM_Q_HEADS=hq,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        PDL=pdl(q.device),
        launch_pdl=pdl(q.device),
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_stride_t, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * x_stride_t + offs, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + t * x_stride_t + inter + offs, mask=mask).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * inter + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x, out) -> None:
    """x [T, 2 I] = [gate | up] (unit last stride) -> out [T, I] contiguous."""
    num_tokens, inter = out.shape
    block = 1024
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), BLOCK=block, PDL=pdl(x.device), launch_pdl=pdl(x.device)
    )


@triton.jit
def _exponential_race_kernel(
    probs_ptr, seeds_ptr, out_ptr, probs_stride, VOCAB: tl.constexpr, BLOCK: tl.constexpr
):
    # Draw token j with probability p_j: argmax_j p_j / E_j with E_j ~ Exp(1) i.i.d. The
    # uniforms come from Philox keyed by the row's own seed and the token index only, so a
    # row's draw does not depend on which batch slot it sits in. float64 keeps -log(u) exact
    # enough near u = 1, where a float32 log would round E_j to 0.
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    best_key = tl.full([BLOCK], -1.0, tl.float64)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < VOCAB
        p = tl.load(probs_ptr + row * probs_stride + offs, mask=mask, other=0.0).to(tl.float64)
        bits = tl.randint(seed, offs).to(tl.uint32)
        u = (bits.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)  # in (0, 1), never 0 or 1
        key = tl.where(p > 0, p / -tl.log(u), -1.0)
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_key, axis=0)
    idx = tl.min(tl.where(best_key == top, best_idx, VOCAB), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def exponential_race(probs, seeds, out) -> None:
    """probs [n, V] float32 (rows need not sum to 1; zeros never drawn), seeds [n] int64 ->
    out [n] int64 token ids."""
    n, vocab = probs.shape
    _exponential_race_kernel[(n,)](probs, seeds, out, probs.stride(0), VOCAB=vocab, BLOCK=1024)


@triton.jit
def _gemv_rows_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Persistent form: a grid of a few programs per SM, each taking row blocks pid, pid + G,
    # ... of w with the whole K in one tile, so the activation row is read (and normalised)
    # once per program rather than once per row block, and the next block's weights are in
    # flight while the current one is multiplied.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    r = tl.arange(0, BLOCK_N)
    num_blocks = tl.cdiv(N, BLOCK_N)
    rows = pid * BLOCK_N + r
    w = tl.load(
        w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
        mask=(rows < N)[:, None] & col_ok[None, :],
        other=0.0,
        eviction_policy="evict_first",
    )
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    dtype = y_ptr.dtype.element_ty
    if SILU_MUL:  # x = [gate | up] of 2K: silu(gate) * up, rounded as the unfused kernel
        gate = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
        xk = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
    else:
        xk = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # the stream s = x + residual, kept for the next add (FlashInfer's order)
        xk += tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if pid == 0:
            tl.store(res_out_ptr + cols, xk.to(dtype), mask=col_ok)
    if NORM:
        rrms = 1.0 / tl.sqrt(tl.sum(xk * xk, axis=0) / K + eps)
        nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        xk = (xk * rrms * nw).to(dtype).to(tl.float32)
    for blk in range(pid, num_blocks, num_programs):
        rows = blk * BLOCK_N + r
        nxt = (blk + num_programs) * BLOCK_N + r
        w_next = tl.load(
            w_ptr + nxt[:, None].to(tl.int64) * K + cols[None, :],
            mask=(nxt < N)[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        y = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(dtype), mask=rows < N)
        w = w_next


def gemv_rows(
    x,
    w,
    bias,
    out,
    tile,
    silu_mul: bool = False,
    norm_weight=None,
    eps: float = 0.0,
    residual=None,
    residual_out=None,
) -> None:
    """The persistent one-row GEMV: out [1, N] = a [1, K] @ w [N, K]^T (+ bias), where a is x,
    or silu(gate) * up of x = [gate | up] (silu_mul), or with norm_weight
    rmsnorm(x (+ residual)) * norm_weight, writing x + residual to residual_out. tile =
    (BLOCK_N, num_warps, programs per SM)."""
    n, k = w.shape
    block_n, warps, per_sm = tile
    blocks = triton.cdiv(n, block_n)
    grid = min(blocks, per_sm * _num_sms(out.device))
    _gemv_rows_kernel[(grid,)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        residual_out if residual_out is not None else x,
        w,
        bias if bias is not None else w,
        out,
        n,
        eps,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k),
        NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        PDL=pdl(out.device),
        num_warps=warps,
        launch_pdl=pdl(out.device),
    )


@functools.cache
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl(device) -> bool:
    """Whether kernels launch with programmatic dependent launch (Hopper and later): each may
    start while the previous one drains and waits on it with griddepcontrol.wait before
    reading its inputs. FlashInfer's kernels do the same on these GPUs."""
    return torch.cuda.get_device_capability(device)[0] >= 9
