"""Triton kernels for the small elementwise steps of the CUDA path: each replaces several
PyTorch launches by one, which is what counts at decode, where a step is hundreds of tiny
kernels between the weight reads. Imported only on CUDA (runtime/cuda_ops.py); every kernel
computes in float32 and rounds once to the output dtype.
"""

from __future__ import annotations

import contextlib
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
    k_inv,
    v_inv,
    NUM_Q_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,
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
    cs = cos_ptr + t * cs_stride_t
    sn = sin_ptr + t * cs_stride_t
    c1 = tl.load(cs + offs, mask=mask).to(tl.float32)
    c2 = tl.load(cs + HALF + offs, mask=mask).to(tl.float32)
    s1 = tl.load(sn + offs, mask=mask).to(tl.float32)
    s2 = tl.load(sn + HALF + offs, mask=mask).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    if head < NUM_Q_HEADS:
        # (names apart from the other branch's: Triton merges same-named values, whose
        # pointer types differ when the cache is FP8)
        q_src = q_ptr + t * q_stride_t + head * q_stride_h
        q_dst = q_out_ptr + (t * NUM_Q_HEADS + head) * 2 * HALF
        x1 = tl.load(q_src + offs, mask=mask).to(tl.float32)
        x2 = tl.load(q_src + HALF + offs, mask=mask).to(tl.float32)
        tl.store(q_dst + offs, (x1 * c1 - x2 * s1).to(out_ty), mask=mask)
        tl.store(q_dst + HALF + offs, (x2 * c2 + x1 * s2).to(out_ty), mask=mask)
    else:
        kv_head = head - NUM_Q_HEADS
        src = k_ptr + t * k_stride_t + kv_head * k_stride_h
        page = tl.load(pages_ptr + t)
        slot = tl.load(offsets_ptr + t)
        dst = cache_ptr + page * page_stride + slot * slot_stride + kv_head * 2 * HALF
        x1 = tl.load(src + offs, mask=mask).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=mask).to(tl.float32)
        # rounded to the model's dtype first, as the unfused reference rotates k
        k1 = (x1 * c1 - x2 * s1).to(out_ty)
        k2 = (x2 * c2 + x1 * s2).to(out_ty)
        v_src = v_ptr + t * v_stride_t + kv_head * v_stride_h
        v1 = tl.load(v_src + offs, mask=mask)
        v2 = tl.load(v_src + HALF + offs, mask=mask)
        if KV_FP8:
            tl.store(dst + offs, _to_fp8(k1.to(tl.float32) * k_inv), mask=mask)
            tl.store(dst + HALF + offs, _to_fp8(k2.to(tl.float32) * k_inv), mask=mask)
            tl.store(dst + kv_stride + offs, _to_fp8(v1.to(tl.float32) * v_inv), mask=mask)
            tl.store(dst + kv_stride + HALF + offs, _to_fp8(v2.to(tl.float32) * v_inv), mask=mask)
        else:
            tl.store(dst + offs, k1, mask=mask)
            tl.store(dst + HALF + offs, k2, mask=mask)
            tl.store(dst + kv_stride + offs, v1, mask=mask)
            tl.store(dst + kv_stride + HALF + offs, v2, mask=mask)


@triton.jit
def _to_fp8(x):
    """float32 -> e4m3, saturated at +-448 (runtime/quant.py store_kv), round to nearest."""
    return tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv)


def rope_store_kv(q, k, v, q_out, cache, cos, sin, pages, offsets, kv_scales, kv_only=False):
    """q [T, hq, hd], k, v [T, hkv, hd] (any token/head strides, unit last stride): rotated q
    into contiguous q_out; rotated k and v into cache [P, 2, page_size, hkv, hd] (contiguous)
    at (pages[t], offsets[t]) (int64 [T]), divided by kv_scales (k, v) when the cache is FP8;
    cos, sin [T, hd] with unit last stride. kv_only: k and v only (q and q_out untouched)."""
    num_tokens, hq, hd = q.shape
    hkv = k.shape[1]
    half = hd // 2
    if kv_only:
        hq = 0  # every program takes a kv head
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
        1.0 / kv_scales[0],
        1.0 / kv_scales[1],
        NUM_Q_HEADS=hq,
        HALF=half,
        BLOCK=triton.next_power_of_2(half),
        KV_FP8=cache.dtype == torch.float8_e4m3fn,
        PDL=pdl(q.device),
        launch_pdl=pdl(q.device),
    )


@triton.jit
def _kv_block(
    cache_ptr,
    indices_ptr,
    first_page,
    pos,
    hi,
    head_off,
    e,
    e_ok,
    page_stride,
    kv_stride,
    slot_stride,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """One kv head's k and v halves [BLOCK_T, BLOCK_H] at a row's cached positions `pos`
    (those >= hi masked to 0), through the row's page list from indices[first_page], as
    DTYPE (FP8 pages widen exactly; their scales are applied by the caller)."""
    page = _kv_pages(indices_ptr, first_page, pos, hi, PAGE_SIZE)
    return _kv_at(
        cache_ptr, page, pos, hi, head_off, e, e_ok, page_stride, kv_stride, slot_stride, HALF,
        PAGE_SIZE, DTYPE,
    )  # fmt: skip


@triton.jit
def _kv_pages(indices_ptr, first_page, pos, hi, PAGE_SIZE: tl.constexpr):
    """The pages of a row's cached positions `pos` (0 for those >= hi)."""
    return tl.load(indices_ptr + first_page + pos // PAGE_SIZE, mask=pos < hi, other=0)


@triton.jit
def _kv_at(
    cache_ptr,
    page,
    pos,
    hi,
    head_off,
    e,
    e_ok,
    page_stride,
    kv_stride,
    slot_stride,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """_kv_block's loads, the positions' pages given."""
    ok = pos < hi
    base = cache_ptr + page.to(tl.int64) * page_stride + (pos % PAGE_SIZE) * slot_stride
    kv_ok = ok[:, None] & e_ok[None, :]
    addr = base[:, None] + head_off + e[None, :]
    k1 = tl.load(addr, mask=kv_ok, other=0.0).to(DTYPE)
    k2 = tl.load(addr + HALF, mask=kv_ok, other=0.0).to(DTYPE)
    v1 = tl.load(addr + kv_stride, mask=kv_ok, other=0.0).to(DTYPE)
    v2 = tl.load(addr + kv_stride + HALF, mask=kv_ok, other=0.0).to(DTYPE)
    return k1, k2, v1, v2


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    cache_ptr,
    indptr_ptr,
    indices_ptr,
    last_len_ptr,
    pages_ptr,
    offsets_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    count_ptr,
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
    scale_log2,
    k_scale,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    KV_FP8: tl.constexpr,
    MM_F16: tl.constexpr,
    PDL: tl.constexpr,
    STORE_NEW: tl.constexpr,
    PAGES_AHEAD: tl.constexpr,
    ONE_PASS_MERGE: tl.constexpr,
):
    # FP8 pages (KV_FP8): keys and values are widened for the products, to float16 with
    # MM_F16 (one conversion instruction per pair, and every e4m3 value is exact in it; the
    # query and the probabilities are then float16 too) or else to the model's dtype; a
    # layer's k scale goes into the softmax scale and its v scale into the output. The new
    # token's k and v are rounded to FP8 before it attends to them, as if read back.
    # One program per (row b, kv head h, split s): the GROUP query heads that share kv head h
    # attend over one chunk of row b's cached context. The context before the new token
    # (positions < L - 1) was written by earlier steps, so its first block is requested before
    # griddepcontrol.wait; the new token's k and v come from this step's qkv, are rotated
    # (NeoX halves, as _rope_store_kv_kernel) and written to the cache by the last split, which
    # starts its softmax state from them. Splits keep running (max, sum, acc) states; with more
    # than one, each stores its state and the last to finish (an acq_rel counter per (b, h))
    # merges them, so there is no second kernel. Queries, keys and values are kept as their two
    # halves [.., HALF] throughout, the layout RoPE needs; the GROUP query heads are padded to
    # BLOCK_G >= 16 rows so that q k^T and p v run as tensor-core tiles.
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    e = tl.arange(0, BLOCK_H)
    e_ok = e < HALF
    t = tl.arange(0, BLOCK_T)
    first_page = tl.load(indptr_ptr + b)
    num_pages = tl.load(indptr_ptr + b + 1) - first_page
    length = (num_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + b)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_T) * BLOCK_T, MIN_CHUNK)
    active = tl.cdiv(length, chunk)
    lo = s * chunk
    hi = tl.minimum(lo + chunk, length - 1)  # cached positions of this split: [lo, hi)
    if lo < length:
        head_off = h * 2 * HALF
        if MM_F16:
            mm = tl.float16
        else:
            mm = out_ptr.dtype.element_ty
        k1, k2, v1, v2 = _kv_block(
            cache_ptr, indices_ptr, first_page, lo + t, hi, head_off, e, e_ok,
            page_stride, kv_stride, slot_stride, HALF, PAGE_SIZE, mm,
        )  # fmt: skip
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        dtype = out_ptr.dtype.element_ty
        cs = cos_ptr + b * cs_stride_t
        sn = sin_ptr + b * cs_stride_t
        c1 = tl.load(cs + e, mask=e_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cs + HALF + e, mask=e_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sn + e, mask=e_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sn + HALF + e, mask=e_ok, other=0.0).to(tl.float32)
        q_addr = q_ptr + b * q_stride_t + (h * GROUP + g)[:, None] * q_stride_h + e[None, :]
        q_ok = g_ok[:, None] & e_ok[None, :]
        x1 = tl.load(q_addr, mask=q_ok, other=0.0).to(tl.float32)
        x2 = tl.load(q_addr + HALF, mask=q_ok, other=0.0).to(tl.float32)
        # rotated q, rounded as the unfused path stores it (or to float16, MM_F16): the
        # products run on tensor cores with float32 sums, query heads padded to BLOCK_G >= 16
        # rows
        q1 = x1 * c1[None, :] - x2 * s1[None, :]
        q2 = x2 * c2[None, :] + x1 * s2[None, :]
        if MM_F16:  # saturated: a query beyond float16's range would make every score nan
            q1 = tl.clamp(q1, -65504.0, 65504.0)
            q2 = tl.clamp(q2, -65504.0, 65504.0)
        q1 = q1.to(mm)
        q2 = q2.to(mm)
        k_addr = k_ptr + b * k_stride_t + h * k_stride_h + e
        y1 = tl.load(k_addr, mask=e_ok, other=0.0).to(tl.float32)
        y2 = tl.load(k_addr + HALF, mask=e_ok, other=0.0).to(tl.float32)
        kn1 = (y1 * c1 - y2 * s1).to(dtype)
        kn2 = (y2 * c2 + y1 * s2).to(dtype)
        v_addr = v_ptr + b * v_stride_t + h * v_stride_h + e
        vn1 = tl.load(v_addr, mask=e_ok, other=0.0)
        vn2 = tl.load(v_addr + HALF, mask=e_ok, other=0.0)
        if KV_FP8:  # stored as FP8; attended to as read back (in units of the scales)
            kn1 = _to_fp8(kn1.to(tl.float32) / k_scale)
            kn2 = _to_fp8(kn2.to(tl.float32) / k_scale)
            vn1 = _to_fp8(vn1.to(tl.float32) / v_scale)
            vn2 = _to_fp8(vn2.to(tl.float32) / v_scale)
        last = s == active - 1
        if last and STORE_NEW:
            slot = (
                cache_ptr
                + tl.load(pages_ptr + b) * page_stride
                + tl.load(offsets_ptr + b) * slot_stride
                + head_off
            )
            tl.store(slot + e, kn1, mask=e_ok)
            tl.store(slot + HALF + e, kn2, mask=e_ok)
            tl.store(slot + kv_stride + e, vn1, mask=e_ok)
            tl.store(slot + kv_stride + HALF + e, vn2, mask=e_ok)
        # softmax state (log2 domain): the new token's in the last split, empty elsewhere
        s_new = scale_log2 * (
            tl.sum(q1.to(tl.float32) * kn1.to(tl.float32)[None, :], 1)
            + tl.sum(q2.to(tl.float32) * kn2.to(tl.float32)[None, :], 1)
        )
        m = tl.where(last, s_new, float("-inf"))
        l_sum = tl.where(last, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
        keep = tl.where(last, 1.0, 0.0)
        acc1 = keep * vn1.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
        acc2 = keep * vn2.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
        if PAGES_AHEAD:
            next_pages = _kv_pages(indices_ptr, first_page, lo + BLOCK_T + t, hi, PAGE_SIZE)
        for start in range(lo, hi, BLOCK_T):
            # the next block's loads are issued before this block's arithmetic; PAGES_AHEAD:
            # with its pages read a block earlier still, so that they do not wait on the
            # page list's load
            if PAGES_AHEAD:
                nk1, nk2, nv1, nv2 = _kv_at(
                    cache_ptr, next_pages, start + BLOCK_T + t, hi, head_off, e, e_ok,
                    page_stride, kv_stride, slot_stride, HALF, PAGE_SIZE, mm,
                )  # fmt: skip
                next_pages = _kv_pages(
                    indices_ptr, first_page, start + 2 * BLOCK_T + t, hi, PAGE_SIZE
                )
            else:
                nk1, nk2, nv1, nv2 = _kv_block(
                    cache_ptr, indices_ptr, first_page, start + BLOCK_T + t, hi, head_off, e,
                    e_ok, page_stride, kv_stride, slot_stride, HALF, PAGE_SIZE, mm,
                )  # fmt: skip
            m, l_sum, acc1, acc2 = _softmax_block(
                q1, q2, k1, k2, v1, v2, (start + t < hi)[None, :], m, l_sum, acc1, acc2,
                scale_log2, mm, False,
            )  # fmt: skip
            k1, k2, v1, v2 = nk1, nk2, nv1, nv2
        out_addr = out_ptr + ((b * NUM_KV_HEADS + h) * GROUP + g)[:, None] * 2 * HALF + e[None, :]
        _finish_split(
            acc1, acc2, m, l_sum, out_addr, g, g_ok, e, q_ok, s, active, part_acc_ptr,
            part_ml_ptr, count_ptr + b * NUM_KV_HEADS + h, (b * NUM_KV_HEADS + h) * SPLITS,
            v_scale, HALF, BLOCK_G, BLOCK_H, ONE_PASS_MERGE,
        )  # fmt: skip


@triton.jit
def _softmax_block(
    q1, q2, k1, k2, v1, v2, seen, m, l_sum, acc1, acc2, scale_log2, mm, EMPTY_ROWS: tl.constexpr
):  # fmt: skip
    """One block of keys and values (halves [BLOCK_T, BLOCK_H]) into the rows' softmax state
    (log2 domain: max m, sum l_sum, the output's halves acc1, acc2), the queries' halves q1, q2
    as `mm`, the scores masked where `seen` is false. EMPTY_ROWS: a row may have seen no key
    yet (its max -inf), whose state then stays empty rather than nan."""
    scores = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    scores = tl.where(seen, scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    p = p.to(mm)
    acc1 = acc1 * alpha[:, None] + tl.dot(p, v1)
    acc2 = acc2 * alpha[:, None] + tl.dot(p, v2)
    return m_new, l_sum, acc1, acc2


@triton.jit
def _finish_split(
    acc1,
    acc2,
    m,
    l_sum,
    out_addr,
    rows,
    rows_ok,
    e,
    ok,
    s,
    active,
    part_acc_ptr,
    part_ml_ptr,
    counter,
    first,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """Split s's softmax state (log2 domain: max m and sum l_sum [BLOCK_M], the output's halves
    acc1, acc2 [BLOCK_M, BLOCK_H]) to the output rows at out_addr (their first halves; the
    second halves HALF further). Alone (active == 1) it stores them; of several, it stores its
    state in the workspace's entry first + s, and the last split to finish (the acq_rel
    counter) merges all, so there is no second kernel: in two passes over the splits or, with
    ONE_PASS, in one. Every row must have seen a key in one split at least."""
    dtype = out_addr.dtype.element_ty
    if active == 1:
        tl.store(out_addr, (acc1 / l_sum[:, None] * v_scale).to(dtype), mask=ok)
        tl.store(out_addr + HALF, (acc2 / l_sum[:, None] * v_scale).to(dtype), mask=ok)
    else:
        tile = rows[:, None] * 2 * BLOCK_H + e[None, :]
        acc_base = part_acc_ptr + (first + s) * BLOCK_M * 2 * BLOCK_H
        tl.store(acc_base + tile, acc1, mask=ok)
        tl.store(acc_base + tile + BLOCK_H, acc2, mask=ok)
        ml_base = part_ml_ptr + (first + s) * 2 * BLOCK_M
        tl.store(ml_base + rows, m, mask=rows_ok)
        tl.store(ml_base + BLOCK_M + rows, l_sum, mask=rows_ok)
        # every thread's stores above happen before the counter's release
        tl.debug_barrier()
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == active - 1:
            # The last split to finish merges all; .cg loads read L2, never an L1 line left
            # by an earlier step. (Loading every split's state at once measured slower.)
            ml = part_ml_ptr + first * 2 * BLOCK_M + rows
            acc = part_acc_ptr + first * BLOCK_M * 2 * BLOCK_H + tile
            if ONE_PASS:
                o1, o2, total = _merge_one_pass(ml, acc, rows_ok, ok, active, BLOCK_M, BLOCK_H)
            else:
                o1, o2, total = _merge_two_pass(ml, acc, rows_ok, ok, active, BLOCK_M, BLOCK_H)
            tl.store(out_addr, (o1 / total[:, None] * v_scale).to(dtype), mask=ok)
            tl.store(out_addr + HALF, (o2 / total[:, None] * v_scale).to(dtype), mask=ok)
            tl.store(counter, 0)  # ready for the next step


@triton.jit
def _split_state(ml, acc, j, rows_ok, ok, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Split j's stored state: its rows' max and sum ([BLOCK_M]) and output halves ([BLOCK_M,
    BLOCK_H]), read past L1 (.cg), where the other programs' stores are seen."""
    mj = tl.load(ml + j * 2 * BLOCK_M, mask=rows_ok, other=0.0, cache_modifier=".cg")
    lj = tl.load(ml + j * 2 * BLOCK_M + BLOCK_M, mask=rows_ok, other=0.0, cache_modifier=".cg")
    aj = acc + j * BLOCK_M * 2 * BLOCK_H
    a1 = tl.load(aj, mask=ok, other=0.0, cache_modifier=".cg")
    a2 = tl.load(aj + BLOCK_H, mask=ok, other=0.0, cache_modifier=".cg")
    return mj, lj, a1, a2


@triton.jit
def _merge_two_pass(ml, acc, rows_ok, ok, active, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """The splits' outputs and sums (o1, o2 [BLOCK_M, BLOCK_H], total [BLOCK_M]) weighted to
    their common max: the maxima in a first pass over the splits, the rest in a second."""
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for j in range(active):
        mj = tl.load(ml + j * 2 * BLOCK_M, mask=rows_ok, other=0.0, cache_modifier=".cg")
        m_all = tl.maximum(m_all, mj)
    total = tl.zeros([BLOCK_M], tl.float32)
    o1 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    o2 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    for j in range(active):
        mj, lj, a1, a2 = _split_state(ml, acc, j, rows_ok, ok, BLOCK_M, BLOCK_H)
        wj = tl.exp2(mj - m_all)
        total += wj * lj
        o1 += wj[:, None] * a1
        o2 += wj[:, None] * a2
    return o1, o2, total


@triton.jit
def _merge_one_pass(ml, acc, rows_ok, ok, active, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """The splits' outputs and sums (o1, o2 [BLOCK_M, BLOCK_H], total [BLOCK_M]) weighted to
    their common max in one pass: what is merged so far is rescaled whenever a split's max is
    higher, so each split costs one round trip to L2 where _merge_two_pass costs two."""
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    o1 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    o2 = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    for j in range(active):
        mj, lj, a1, a2 = _split_state(ml, acc, j, rows_ok, ok, BLOCK_M, BLOCK_H)
        m_new = tl.maximum(m_all, mj)
        # a row that no split so far saw a key of (max -inf) stays empty, not nan
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_all - m_ref)
        wj = tl.exp2(mj - m_ref)
        total = total * alpha + wj * lj
        o1 = o1 * alpha[:, None] + wj[:, None] * a1
        o2 = o2 * alpha[:, None] + wj[:, None] * a2
        m_all = m_new
    return o1, o2, total


# decode_attention over FP8 pages widens keys and values to float16 for its products (True) or
# to the model's dtype: a switch for `benchmarks.kernels --part decode`, which times both.
FP8_PAGES_F16_PRODUCTS = True
# Page dtypes over which decode_attention reads the page list a block ahead of the keys and
# values, rather than just before them (`benchmarks.kernels --part decode` times both). H100,
# 2026-12-07, µs a layer, the same tiles: over FP8 pages ahead wins everywhere (64 rows of 512
# tokens 42.8 against 45.5, of 4,096 290.3 against 308.3; 8 rows of 512 10.9 against 11.2),
# since their loop is bound by the two dependent loads a block; over bf16 pages it loses
# everywhere (64 rows of 512 53.0 against 51.3, 8 rows of 2,048 35.9 against 34.7).
DECODE_PAGES_AHEAD: frozenset = frozenset({torch.float8_e4m3fn})
# decode_attention and prefix_attention merge the splits' states in one pass (True) or in two
# (the last split reading the others' states twice, one after another). H100, 2026-12-07, µs a
# layer, the same tiles: one pass wins wherever the context is split (decode, bf16 pages: 8
# rows of 2,048 tokens 33.0 against 34.7, 32 of 512 31.2 against 32.1; FP8 pages: 8 of 512
# 10.4 against 11.2; the split-context kernel, 64 new tokens over 2,112: 27.4 against 27.9
# with 512-token splits, 32.5 against 33.4 with 256) and ties where it is not (64 rows of 512).
SPLIT_MERGE_ONE_PASS = True
# decode_attention's loop issues each block's loads one block ahead of its arithmetic. Triton's
# software pipeline instead (cp.async into shared memory, 2 or 3 stages) lost everywhere it was
# timed, by 10-80% (H100, 2026-12-07 17:45 UTC: FP8 pages, 64 rows of 512 tokens, 57.3-77.5
# µs a layer against 42.7; docs/performance.md), and was taken out.


@contextlib.contextmanager
def switched(**values):
    """The variant switches above (FP8_PAGES_F16_PRODUCTS=..., DECODE_PAGES_AHEAD=...,
    SPLIT_MERGE_ONE_PASS=...) set for the block, for the benchmarks and checks that run both
    variants; read at launch, so a graph captured inside keeps its variant."""
    switches = globals()
    saved = {name: switches[name] for name in values}
    switches.update(values)
    try:
        yield
    finally:
        switches.update(saved)


def decode_splits(batch: int, kv_heads: int, device) -> int:
    """Splits of the context per (row, kv head) in decode_attention: enough programs to give
    every SM about two, at most 32 (a split has MIN_CHUNK tokens at least, so short contexts
    use fewer). Four per SM, up to 64, measured slower on the H200."""
    want = triton.cdiv(2 * _num_sms(device), batch * kv_heads)
    return max(1, min(32, triton.next_power_of_2(want)))


def _block_g(group: int) -> int:
    return max(16, triton.next_power_of_2(group))  # a tensor-core tile has 16 rows at least


def decode_workspace(batch: int, kv_heads: int, group: int, head_dim: int, splits: int, device):
    """(partial accumulators, partial max/sum, counters) for decode_attention: float32 and a
    zeroed int32 counter per (row, kv head), allocated once and reused by every layer."""
    return _split_workspace(batch * kv_heads, splits, _block_g(group), head_dim, device)


def _split_workspace(slots: int, splits: int, rows: int, head_dim: int, device):
    """Each split's softmax state for `slots` (program row, kv head) pairs of `rows` rows (as
    _finish_split stores it), float32, and a zeroed int32 counter a slot."""
    block_h = max(16, triton.next_power_of_2(head_dim // 2))
    states = slots * splits
    part_acc = torch.empty(states * rows * 2 * block_h, dtype=torch.float32, device=device)
    part_ml = torch.empty(states * 2 * rows, dtype=torch.float32, device=device)
    counts = torch.zeros(slots, dtype=torch.int32, device=device)
    return part_acc, part_ml, counts


def decode_attention(
    q,
    k,
    v,
    cos,
    sin,
    cache,
    indptr,
    indices,
    last_len,
    pages,
    offsets,
    out,
    workspace,
    scale: float,
    splits: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    block_t: int = 64,
    min_chunk: int = 128,
    num_warps: int = 8,
    store_new: bool = True,
) -> None:
    """Decode attention of B rows, one new token each, with that token's RoPE and KV write:
    q [B, hq, hd], k, v [B, hkv, hd] (this step's, before RoPE; unit last stride), cos, sin
    [B, hd]; cache [P, 2, page_size, hkv, hd]; a row's pages are indices[indptr[b]:indptr[b+1]]
    with last_len[b] tokens in the last (int32), its new token goes to (pages[b], offsets[b])
    (int64). out [B, hq, hd] contiguous. workspace from decode_workspace(..., splits). An FP8
    cache holds keys and values divided by kv_scales (k, v). store_new=False: the new tokens'
    k and v are in the cache already (rope_store_kv, kv_only, the same rounding), so rows may
    read one another's (the rows of one verification), and the kernel only reads the cache."""
    batch, hq, hd = q.shape
    hkv = k.shape[1]
    part_acc, part_ml, counts = workspace
    use_pdl = pdl(q.device)
    _decode_attention_kernel[(batch, hkv, splits)](
        q,
        k,
        v,
        cos,
        sin,
        cache,
        indptr,
        indices,
        last_len,
        pages,
        offsets,
        out,
        part_acc,
        part_ml,
        counts,
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
        scale * kv_scales[0] * 1.4426950408889634,
        kv_scales[0],
        kv_scales[1],
        NUM_KV_HEADS=hkv,
        GROUP=hq // hkv,
        BLOCK_G=_block_g(hq // hkv),
        HALF=hd // 2,
        BLOCK_H=max(16, triton.next_power_of_2(hd // 2)),
        PAGE_SIZE=cache.shape[2],
        SPLITS=splits,
        BLOCK_T=block_t,
        MIN_CHUNK=triton.cdiv(min_chunk, block_t) * block_t,
        KV_FP8=cache.dtype == torch.float8_e4m3fn,
        MM_F16=cache.dtype == torch.float8_e4m3fn and FP8_PAGES_F16_PRODUCTS,
        PDL=use_pdl,
        STORE_NEW=store_new,
        PAGES_AHEAD=cache.dtype in DECODE_PAGES_AHEAD,
        ONE_PASS_MERGE=SPLIT_MERGE_ONE_PASS,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )


@triton.jit
def _prefix_attention_kernel(
    q_ptr,
    cache_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    indices_ptr,
    last_len_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    count_ptr,
    num_seqs,
    q_stride_t,
    q_stride_h,
    o_stride_t,
    o_stride_h,
    page_stride,
    kv_stride,
    slot_stride,
    scale_log2,
    v_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_GG: tl.constexpr,
    QT: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    MM_F16: tl.constexpr,
    ONE_PASS_MERGE: tl.constexpr,
):
    # One program per (query block r, kv head h, split s). A sequence's new tokens (its part
    # of qo_indptr) are cut into blocks of QT; block r's QT tokens times the GROUP query heads
    # of kv head h are the rows of its tiles ([QT * BLOCK_GG], token-major), so the block's
    # keys and values are read once for all of them, where FlashInfer's prefill kernels give
    # a block of a few tokens one CTA for its whole context. The context the block's last
    # token sees is split SPLITS ways, each query masked to its own causal length, and merged
    # as in the decode kernel. Queries come rotated and every key and value is in the cache
    # already (rope_store_kv). Blocks past the last sequence's do nothing: the grid is sized
    # for the most blocks a step of its tokens and sequences can have.
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq = r * 0 - 1
    j = r * 0
    before = r * 0  # blocks of the sequences before i
    for i in range(num_seqs):
        blocks = tl.cdiv(tl.load(qo_indptr_ptr + i + 1) - tl.load(qo_indptr_ptr + i), QT)
        hit = (r >= before) & (r < before + blocks)
        seq = tl.where(hit, i, seq)
        j = tl.where(hit, r - before, j)
        before += blocks
    if seq >= 0:
        q_first = tl.load(qo_indptr_ptr + seq)
        q_len = tl.load(qo_indptr_ptr + seq + 1) - q_first
        first_page = tl.load(kv_indptr_ptr + seq)
        num_pages = tl.load(kv_indptr_ptr + seq + 1) - first_page
        length = (num_pages - 1) * PAGE_SIZE + tl.load(last_len_ptr + seq)
        t0 = j * QT  # the block's first token among the sequence's new ones
        n_q = tl.minimum(QT, q_len - t0)
        pos0 = length - q_len + t0  # that token's position
        seen_len = pos0 + n_q  # keys [0, seen_len) are seen by the block's last token
        chunk = tl.maximum(tl.cdiv(tl.cdiv(seen_len, SPLITS), BLOCK_T) * BLOCK_T, MIN_CHUNK)
        active = tl.cdiv(seen_len, chunk)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, seen_len)
        if lo < seen_len:
            if MM_F16:
                mm = tl.float16
            else:
                mm = out_ptr.dtype.element_ty
            rows = tl.arange(0, QT * BLOCK_GG)
            tok = rows // BLOCK_GG
            g = rows % BLOCK_GG
            rows_ok = (tok < n_q) & (g < GROUP)
            e = tl.arange(0, BLOCK_H)
            e_ok = e < HALF
            ok = rows_ok[:, None] & e_ok[None, :]
            t = tl.arange(0, BLOCK_T)
            head_off = h * 2 * HALF
            k1, k2, v1, v2 = _kv_block(
                cache_ptr, indices_ptr, first_page, lo + t, hi, head_off, e, e_ok,
                page_stride, kv_stride, slot_stride, HALF, PAGE_SIZE, mm,
            )  # fmt: skip
            token = q_first + t0 + tok
            head = h * GROUP + g
            q_addr = q_ptr + (token * q_stride_t + head * q_stride_h)[:, None] + e[None, :]
            q1 = tl.load(q_addr, mask=ok, other=0.0).to(tl.float32)
            q2 = tl.load(q_addr + HALF, mask=ok, other=0.0).to(tl.float32)
            if MM_F16:  # saturated: a query beyond float16's range would make every score nan
                q1 = tl.clamp(q1, -65504.0, 65504.0)
                q2 = tl.clamp(q2, -65504.0, 65504.0)
            q1 = q1.to(mm)
            q2 = q2.to(mm)
            last_key = pos0 + tok  # each row's query sees keys up to its own position
            m = tl.full([QT * BLOCK_GG], float("-inf"), tl.float32)
            l_sum = tl.zeros([QT * BLOCK_GG], tl.float32)
            acc1 = tl.zeros([QT * BLOCK_GG, BLOCK_H], tl.float32)
            acc2 = tl.zeros([QT * BLOCK_GG, BLOCK_H], tl.float32)
            for start in range(lo, hi, BLOCK_T):
                # the next block's loads are issued before this block's arithmetic
                nk1, nk2, nv1, nv2 = _kv_block(
                    cache_ptr, indices_ptr, first_page, start + BLOCK_T + t, hi, head_off, e,
                    e_ok, page_stride, kv_stride, slot_stride, HALF, PAGE_SIZE, mm,
                )  # fmt: skip
                seen = ((start + t)[None, :] <= last_key[:, None]) & (start + t < hi)[None, :]
                m, l_sum, acc1, acc2 = _softmax_block(
                    q1, q2, k1, k2, v1, v2, seen, m, l_sum, acc1, acc2, scale_log2, mm, True
                )
                k1, k2, v1, v2 = nk1, nk2, nv1, nv2
            out_addr = out_ptr + (token * o_stride_t + head * o_stride_h)[:, None] + e[None, :]
            _finish_split(
                acc1, acc2, m, l_sum, out_addr, rows, rows_ok, e, ok, s, active, part_acc_ptr,
                part_ml_ptr, count_ptr + r * NUM_KV_HEADS + h, (r * NUM_KV_HEADS + h) * SPLITS,
                v_scale, HALF, QT * BLOCK_GG, BLOCK_H, ONE_PASS_MERGE,
            )  # fmt: skip


def prefix_blocks(tokens: int, seqs: int, q_tokens: int) -> int:
    """The most query blocks prefix_attention can meet in a step of at most `tokens` new tokens
    over at most `seqs` sequences: each sequence's last block may be partial."""
    return tokens // q_tokens + seqs


def prefix_splits(tokens: int, q_tokens: int, kv_heads: int, device) -> int:
    """prefix_attention's splits of the context for steps of up to `tokens` new tokens: as
    decode_attention's for that many blocks, which a step of one sequence has."""
    return decode_splits(triton.cdiv(tokens, q_tokens), kv_heads, device)


def prefix_workspace(blocks: int, kv_heads: int, group: int, head_dim: int, splits: int,
                     q_tokens: int, device):  # fmt: skip
    """(partial accumulators, partial max/sum, counters) for prefix_attention, as
    decode_workspace's with a block's rows (q_tokens tokens of the group's heads) for a row's."""
    rows = q_tokens * triton.next_power_of_2(group)
    return _split_workspace(blocks * kv_heads, splits, rows, head_dim, device)


def prefix_attention(
    q,
    cache,
    qo_indptr,
    kv_indptr,
    indices,
    last_len,
    out,
    workspace,
    scale: float,
    splits: int,
    blocks: int,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    q_tokens: int = 16,
    block_t: int = 64,
    min_chunk: int = 128,
    num_warps: int = 8,
) -> None:
    """Causal attention of a step's new tokens over their sequences' paged context, the
    context split `splits` ways: for steps of a few new tokens over long contexts (a turn
    after a cached prefix), where a kernel that walks each sequence's context in one CTA is
    bound by that walk. q [T, hq, hd] rotated; sequence i's new tokens are q[qo_indptr[i]:
    qo_indptr[i + 1]], the last of its context (the new tokens included, their k and v in the
    cache already), whose pages are indices[kv_indptr[i]:kv_indptr[i + 1]] with last_len[i]
    tokens in the last (int32; a sequence without new tokens is skipped). cache [P, 2,
    page_size, hkv, hd], as the model's dtype or FP8 holding keys and values divided by
    kv_scales. out [T, hq, hd]: rows of no sequence are left as they are. blocks from
    prefix_blocks, workspace from prefix_workspace(blocks, ..., splits, q_tokens)."""
    hq, hd = q.shape[1], q.shape[2]
    hkv = cache.shape[3]
    rows = q_tokens * triton.next_power_of_2(hq // hkv)
    if q_tokens != triton.next_power_of_2(q_tokens) or rows < 16:
        raise ValueError(
            f"prefix_attention takes a power of two of tokens a block, at least 16 rows with "
            f"the group's heads (got {q_tokens} tokens of {hq // hkv} heads)."
        )
    part_acc, part_ml, counts = workspace
    fp8 = cache.dtype == torch.float8_e4m3fn
    _prefix_attention_kernel[(blocks, hkv, splits)](
        q,
        cache,
        qo_indptr,
        kv_indptr,
        indices,
        last_len,
        out,
        part_acc,
        part_ml,
        counts,
        qo_indptr.shape[0] - 1,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        scale * kv_scales[0] * 1.4426950408889634,
        kv_scales[1],
        NUM_KV_HEADS=hkv,
        GROUP=hq // hkv,
        BLOCK_GG=triton.next_power_of_2(hq // hkv),
        QT=q_tokens,
        HALF=hd // 2,
        BLOCK_H=max(16, triton.next_power_of_2(hd // 2)),
        PAGE_SIZE=cache.shape[2],
        SPLITS=splits,
        BLOCK_T=block_t,
        MIN_CHUNK=triton.cdiv(min_chunk, block_t) * block_t,
        MM_F16=fp8 and FP8_PAGES_F16_PRODUCTS,
        ONE_PASS_MERGE=SPLIT_MERGE_ONE_PASS,
        num_warps=num_warps,
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
def _gemv_input(
    x_ptr, res_ptr, norm_w_ptr, res_out_ptr, cols, col_ok, eps, store_stream, dtype,
    K: tl.constexpr, NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    """One activation row as the GEMV multiplies it, float32 [BLOCK_K]: x, or silu(gate) * up
    of x = [gate | up], plus the residual (the stream written when store_stream), normalised."""
    if SILU_MUL:  # x = [gate | up] of 2K: silu(gate) * up, rounded as the unfused kernel
        gate = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
        xk = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
    else:
        xk = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # the stream s = x + residual, kept for the next add (FlashInfer's order)
        xk += tl.load(res_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if store_stream:
            tl.store(res_out_ptr + cols, xk.to(dtype), mask=col_ok)
    if NORM:
        rrms = 1.0 / tl.sqrt(tl.sum(xk * xk, axis=0) / K + eps)
        nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        xk = (xk * rrms * nw).to(dtype).to(tl.float32)
    return xk


@triton.jit
def _gemv_block(
    w, xk, rows, y_ptr, b_ptr, w_scale_ptr, N,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_COLS: tl.constexpr, W_SCALE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    """y[rows] = the block w [BLOCK_N, BLOCK_K] of weight rows times xk (scaled, + bias)."""
    if W_SCALE == 2:
        parts = tl.sum(
            tl.reshape(
                w.to(tl.float32) * xk[None, :], (BLOCK_N, BLOCK_K // BLOCK_COLS, BLOCK_COLS)
            ),
            axis=2,
        )
        kb = tl.arange(0, BLOCK_K // BLOCK_COLS)
        ws = tl.load(
            w_scale_ptr + (rows // BLOCK_ROWS)[:, None] * SCALE_COLS + kb[None, :],
            mask=(rows < N)[:, None] & (kb < SCALE_COLS)[None, :],
            other=0.0,
        )
        y = tl.sum(parts * ws, axis=1)
    else:
        y = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
    if W_SCALE == 1:
        y *= tl.load(w_scale_ptr + rows, mask=rows < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


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
    w_scale_ptr,
    SCALE_COLS: tl.constexpr,
    W_SCALE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    # W_SCALE: 0 a dense w; 1 float8 w with one scale per row; 2 float8 w with one scale per
    # (BLOCK_ROWS x BLOCK_COLS) block, SCALE_COLS blocks a row. The scales multiply the dot
    # products (per block of columns for 2), so the weights are read once, as float8.
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
    xk = _gemv_input(
        x_ptr, res_ptr, norm_w_ptr, res_out_ptr, cols, col_ok, eps, pid == 0, dtype,
        K, NORM, ADD_RESIDUAL, SILU_MUL,
    )  # fmt: skip
    for blk in range(pid, num_blocks, num_programs):
        rows = blk * BLOCK_N + r
        nxt = (blk + num_programs) * BLOCK_N + r
        w_next = tl.load(
            w_ptr + nxt[:, None].to(tl.int64) * K + cols[None, :],
            mask=(nxt < N)[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        _gemv_block(
            w, xk, rows, y_ptr, b_ptr, w_scale_ptr, N,
            BLOCK_N, BLOCK_K, HAS_BIAS, SCALE_COLS, W_SCALE, BLOCK_ROWS, BLOCK_COLS,
        )  # fmt: skip
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
    w_scale=None,
    w_block=None,
) -> None:
    """The persistent GEMV: out [1, N] = a [1, K] @ w [N, K]^T (+ bias), where a is x,
    or silu(gate) * up of x = [gate | up] (silu_mul), or with norm_weight
    rmsnorm(x (+ residual)) * norm_weight, writing x + residual to residual_out. tile =
    (BLOCK_N, num_warps, programs per SM). x, residual, residual_out, out contiguous.
    w_scale: a float8 w's scales, [N] per row or [ceil(N / rows), ceil(K / cols)] per block
    of w_block = (rows, cols), both powers of 2."""
    n, k = w.shape
    block_n, warps, per_sm = tile
    scaled = dict(w_scale_ptr=w, SCALE_COLS=0, W_SCALE=0, BLOCK_ROWS=1, BLOCK_COLS=1)
    block_k = triton.next_power_of_2(k)
    if w_scale is not None and w_scale.dim() == 1:
        scaled.update(w_scale_ptr=w_scale, W_SCALE=1)
    elif w_scale is not None:
        rows, cols = w_block
        block_k = max(block_k, cols)
        scaled = dict(
            w_scale_ptr=w_scale,
            SCALE_COLS=w_scale.shape[1],
            W_SCALE=2,
            BLOCK_ROWS=rows,
            BLOCK_COLS=cols,
        )
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
        BLOCK_K=block_k,
        NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        PDL=pdl(out.device),
        num_warps=warps,
        launch_pdl=pdl(out.device),
        **scaled,
    )


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row, g = tl.program_id(0), tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    ok = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(x_ptr + row.to(tl.int64) * K + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * tl.num_programs(1) + g, scale)


def quantize_rows(x, out, scales, group: int) -> None:
    """x [T, K] contiguous -> out [T, K] float8 and scales [T, K / group] float32."""
    t, k = x.shape
    block = triton.next_power_of_2(group)
    _quantize_rows_kernel[(t, k // group)](
        x, out, scales, k, GROUP=group, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )


@triton.jit
def _quantize_product_input_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    K,
    x_stride,
    eps,
    ADD: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One row a program: the next product's input, computed as the unfused kernels compute it
    # and rounded to x's dtype as they store it, then quantized to float8 with one scale for
    # the row. SILU_MUL: silu(gate) * up of x = [gate | up]. Otherwise RMSNorm(s) * w of the
    # stream s = x + residual (ADD; s is written back into the residual, as FlashInfer's
    # fused add + RMSNorm does) or s = x.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    if SILU_MUL:
        gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + K + cols, mask=ok, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        s = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            s += tl.load(r_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
            s = s.to(r_ptr.dtype.element_ty)
            tl.store(r_ptr + row * K + cols, s, mask=ok)
            s = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / K + eps)
        y = s * inv * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12) / 448.0
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_product_input(x, residual, norm_weight, eps: float, out, scales, silu_mul: bool):
    """out [T, K] float8 and scales [T, 1] float32 of the next product's input, in one launch:
    silu(gate) * up of x [T, 2 K] (silu_mul), or RMSNorm(x + residual) * norm_weight of x
    [T, K] with the sum written into residual [T, K] (residual None: RMSNorm(x)). x's rows
    have unit column stride; residual is contiguous."""
    t, k = out.shape
    block = triton.next_power_of_2(k)
    _quantize_product_input_kernel[(t,)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        out,
        scales,
        k,
        x.stride(0),
        eps,
        ADD=residual is not None,
        SILU_MUL=silu_mul,
        BLOCK=block,
        num_warps=16 if block > 4096 else 8,
    )


@triton.jit
def _fp8_block_mm_kernel(
    a_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    c_ptr,
    M,
    N,
    K,
    SCALE_COLS,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # C = A B^T with A [M, K] float8 scaled per (row, BLOCK_K columns) and B [N, K] float8
    # scaled per (BLOCK_ROWS rows, BLOCK_K columns): every K block's partial product is scaled
    # as it is accumulated, in float32.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(
            a_ptr + rm[:, None].to(tl.int64) * K + k[None, :],
            mask=(rm < M)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rn[None, :].to(tl.int64) * K + k[:, None],
            mask=(rn < N)[None, :] & (k < K)[:, None],
            other=0.0,
        )
        a_s = tl.load(a_s_ptr + rm * SCALE_COLS + kb, mask=rm < M, other=0.0)
        b_s = tl.load(b_s_ptr + (rn // BLOCK_ROWS) * SCALE_COLS + kb, mask=rn < N, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    tl.store(
        c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def fp8_block_mm(a, a_scales, b, b_scales, out, block: tuple[int, int]) -> None:
    """out [M, N] = (a [M, K] * a_scales [M, K / cols]) @ (b [N, K] * b_scales per block)^T,
    block = (rows, cols) of b's scale blocks; a is scaled per the same column blocks."""
    m, k = a.shape
    n = b.shape[0]
    rows, cols = block
    block_m = 64 if m > 32 else 16
    block_n = 128 if n >= 128 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_mm_kernel[grid](
        a,
        a_scales,
        b,
        b_scales,
        out,
        m,
        n,
        k,
        b_scales.shape[1],
        BLOCK_ROWS=rows,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=cols,
        num_warps=4,
        num_stages=3,
    )


@triton.jit
def _few_rows_kernel(
    w_ptr,
    x_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    x_stride,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    # y [M, N] = x [M, K] @ w [N, K]^T (+ b) for few rows M <= ROWS, computed as W x^T so that
    # the weight's rows fill the tensor cores' long side (a GEMM with M rows would pad them to
    # 64 and read the weights once per 64-row tile of x anyway). SCALED: x and w are float8,
    # x scaled per row by xs [M], w per row by ws [N], both applied to the float32 sums.
    # PDL: launched early, it waits for the previous kernel before reading anything.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * K + k[None, :],
            mask=(rn < N)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        xt = tl.load(
            x_ptr + rr[None, :] * x_stride + k[:, None],
            mask=(rr < M)[None, :] & (k < K)[:, None],
            other=0.0,
        )
        acc = tl.dot(w, xt, acc)
    if SCALED:
        ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
        xs = tl.load(xs_ptr + rr, mask=rr < M, other=0.0)
        acc = acc * ws[:, None] * xs[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + rr[None, :] * N + rn[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rn < N)[:, None] & (rr < M)[None, :],
    )


def few_rows_mm(
    x, w, bias, out, tile, xs=None, ws=None, early: bool = False, rows: int = 0
) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T (+ bias) for M <= 64, each row of x contiguous (any
    row stride); with xs and ws, x and w are float8 scaled per row (xs [M, 1], ws [N]). tile =
    (BLOCK_N, BLOCK_K, pipeline stages, warps). early: launched with programmatic dependent
    launch (on GPUs that have it), so it starts while the previous kernel drains. rows (at
    least M; 0: M): the rows the kernel's ROWS is sized for, so that the same kernel serves
    fewer."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, stages, warps = tile
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        w,
        x,
        xs if xs is not None else x,
        ws if ws is not None else w,
        bias if bias is not None else w,
        out,
        m,
        n,
        x.stride(0),
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=max(16, triton.next_power_of_2(rows or m)),
        SCALED=xs is not None,
        HAS_BIAS=bias is not None,
        PDL=early,
        num_stages=stages,
        num_warps=warps,
        launch_pdl=early,
    )


@triton.jit
def _split_k_kernel(
    x_ptr,
    w_ptr,
    xs_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    x_stride,
    K: tl.constexpr,
    K_PART: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    b_ptr,
):
    # Program (n tile, part): x [M, K_PART slice] @ w [BLOCK_N, K_PART slice]^T. With one part
    # it writes y (+ bias) itself; with several, its float32 sum goes to its own slice of the
    # parts buffer y_ptr [PARTS, M, N] and _split_k_sum adds them in order: no atomics, so a
    # product rounds the same on every run.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    part = tl.program_id(1)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(part * K_PART, (part + 1) * K_PART, BLOCK_K):
        k = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * x_stride + k[None, :],
            mask=(rm < M)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[:, None].to(tl.int64) * K + k[None, :],
            mask=(rn < N)[:, None] & (k < K)[None, :],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    if SCALED:  # each part takes the scales on its own: the sum of scaled parts is the product
        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if PARTS == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + (part * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _split_k_sum(
    parts_ptr,
    b_ptr,
    y_ptr,
    total,
    N,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(parts_ptr + i, mask=i < total, other=0.0)
    for p in tl.static_range(1, PARTS):
        a += tl.load(parts_ptr + p * total + i, mask=i < total, other=0.0)
    if HAS_BIAS:
        a += tl.load(b_ptr + i % N, mask=i < total, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, a.to(y_ptr.dtype.element_ty), mask=i < total)


def split_k_mm(x, w, bias, out, tile, xs=None, ws=None) -> None:
    """out [M, N] = x [M, K] @ w [N, K]^T (+ bias) for M <= 64 rows, each of x contiguous (any
    row stride), K split into SPLIT parts so that narrow weights still give every SM programs;
    with xs [M] and ws [N], x and w are float8 scaled per row. tile = (BLOCK_N, BLOCK_K, SPLIT,
    stages, warps). With SPLIT > 1 the parts take a float32 buffer of SPLIT x M x N from the
    allocator (inside a capture, the graph's pool: every replay writes it before reading)."""
    m, k = x.shape
    n = w.shape[0]
    block_n, block_k, split, stages, warps = tile
    k_part = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_part)  # no empty part
    parts = out if split == 1 else torch.empty(split * m * n, dtype=torch.float32, device=x.device)
    _split_k_kernel[(triton.cdiv(n, block_n), split)](
        x,
        w,
        xs if xs is not None else x,
        ws if ws is not None else w,
        parts,
        m,
        n,
        x.stride(0),
        K=k,
        K_PART=k_part,
        ROWS=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PARTS=split,
        SCALED=xs is not None,
        HAS_BIAS=bias is not None,
        b_ptr=bias if bias is not None else w,
        num_stages=stages,
        num_warps=warps,
    )
    if split > 1:
        _split_k_sum[(triton.cdiv(m * n, 1024),)](
            parts,
            bias if bias is not None else w,
            out,
            m * n,
            n,
            PARTS=split,
            HAS_BIAS=bias is not None,
            BLOCK=1024,
        )


@functools.cache
def _num_sms(device) -> int:
    device = torch.device(device)
    if device.type != "cuda":  # Triton's interpreter on the CPU (tests/interpreted_kernels.py)
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl(device) -> bool:
    """Whether kernels launch with programmatic dependent launch (Hopper and later): each may
    start while the previous one drains and waits on it with griddepcontrol.wait before
    reading its inputs. FlashInfer's kernels do the same on these GPUs."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
