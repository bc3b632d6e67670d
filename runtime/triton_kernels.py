"""Triton kernels for the small elementwise steps of the CUDA path: each replaces several
PyTorch launches by one, which is what counts at decode, where a step is hundreds of tiny
kernels between the weight reads. Imported only on CUDA (runtime/cuda_ops.py); every kernel
computes in float32 and rounds once to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    cs_stride_t,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (token, head) over q's heads then k's; NeoX half rotation:
    # out[:h] = x1 cos1 - x2 sin1, out[h:] = x2 cos2 + x1 sin2 (h = head_dim / 2).
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    if head < NUM_Q_HEADS:
        src = q_ptr + t * q_stride_t + head * q_stride_h
        dst = q_out_ptr + (t * NUM_Q_HEADS + head) * 2 * HALF
    else:
        src = k_ptr + t * k_stride_t + (head - NUM_Q_HEADS) * k_stride_h
        dst = k_out_ptr + (t * NUM_K_HEADS + head - NUM_Q_HEADS) * 2 * HALF
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


def rope(q, k, q_out, k_out, cos, sin) -> None:
    """q [T, hq, hd], k [T, hkv, hd] (any token/head strides, unit last stride) rotated into
    contiguous q_out, k_out; cos, sin [T, hd] with unit last stride."""
    num_tokens, hq, hd = q.shape
    hkv = k.shape[1]
    half = hd // 2
    _rope_kernel[(num_tokens, hq + hkv)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        NUM_Q_HEADS=hq,
        NUM_K_HEADS=hkv,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
    )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_stride_t, BLOCK: tl.constexpr):
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
        x, out, inter, x.stride(0), BLOCK=block
    )


@triton.jit
def _store_kv_kernel(
    cache_ptr,
    k_ptr,
    v_ptr,
    pages_ptr,
    offsets_ptr,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    page_stride,
    kv_stride,
    slot_stride,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (token, kv head): cache[page, 0, offset, head] = k; [page, 1, ...] = v.
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HEAD_DIM
    page = tl.load(pages_ptr + t)
    slot = tl.load(offsets_ptr + t)
    dst = cache_ptr + page * page_stride + slot * slot_stride + head * HEAD_DIM
    k = tl.load(k_ptr + t * k_stride_t + head * k_stride_h + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + head * v_stride_h + offs, mask=mask)
    tl.store(dst + offs, k, mask=mask)
    tl.store(dst + kv_stride + offs, v, mask=mask)


def store_kv(cache, k, v, pages, offsets) -> None:
    """cache [P, 2, page_size, hkv, hd] contiguous; k, v [T, hkv, hd] (unit last stride);
    pages, offsets [T] int64: token t's page and slot in it."""
    num_tokens, hkv, hd = k.shape
    _store_kv_kernel[(num_tokens, hkv)](
        cache,
        k,
        v,
        pages,
        offsets,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        HEAD_DIM=hd,
        BLOCK=triton.next_power_of_2(hd),
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
