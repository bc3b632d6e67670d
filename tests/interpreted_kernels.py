"""Orbit's Triton kernels run through Triton's interpreter on the CPU, in float32, against
PyTorch: the one-row GEMV with its fusions (norm, residual stream, SiLU-mul), the few-rows and
split-K products (their indexing and masks: bias, strided rows, K not a multiple of the block,
the split-K parts), RoPE with the paged KV write, SiLU-and-multiply, the FP8 products' input
quantized where it is made, the fused decode attention and the split-context attention of a
step's new tokens, without a GPU. Run as a script with TRITON_INTERPRET=1 set before Triton is imported
(tests/test_interpreted_kernels.py does); prints the worst relative error of each check as JSON
and exits 1 on a failed check. The GPU tests (tests/gpu/test_gemv.py) check the same products
in bf16 on the hardware."""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

from runtime import cuda_ops

TOL = 1e-5  # float32 on both sides: only the order of the sums differs
# bf16 rows and float16 products against float32 (about 3e-3 in the interpreter)
BOUNDS = {"decode_attention_fp8": 1e-2, "prefix_attention_fp8": 1e-2}


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def note(worst: dict, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Keep the worst relative error of check `name` (inf for a nan, which max() would drop)."""
    error = rel(got, ref)
    worst[name] = max(worst.get(name, 0.0), float("inf") if math.isnan(error) else error)


def check_products(worst: dict) -> None:
    """Plain few-rows products (2 to 32 rows) and split-K ones (33 to 64 rows, SPLIT_ROWS on),
    of contiguous and strided rows, with and without bias."""
    cuda_ops.SPLIT_ROWS = 64
    for n, k in ((96, 80), (40, 300)):
        w = torch.randn(n, k) / k**0.5
        bias = torch.randn(n)
        for m in (2, 17, 40):
            wide = torch.randn(m, k + 8)
            for x in (wide[:, :k].contiguous(), wide[:, :k]):
                for b in (None, bias):
                    name = "split_k" if m > cuda_ops.HALF_FEW_ROWS else "few_rows"
                    note(worst, name, cuda_ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def check_gemv(worst: dict) -> None:
    """The persistent one-row GEMV (four programs per "SM" on the CPU, so each takes several
    row blocks in turn, the next block's weights loaded ahead): plain with and without bias,
    with the add + RMSNorm before it, without and with the residual (the stream written once
    and exact, the inputs untouched), and with the SiLU-mul."""
    for n, k in ((96, 80), (37, 300)):
        w = torch.randn(n, k) / k**0.5
        bias, nw = torch.randn(n), torch.rand(k) + 0.5
        x, residual = torch.randn(1, k), torch.randn(1, k)
        for b in (None, bias):
            note(worst, "gemv", cuda_ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
        before = (x.clone(), residual.clone())
        for res in (None, residual):
            out, stream = cuda_ops.norm_linear(x, res, nw, 1e-5, w, None)
            s = x + (0 if res is None else res)
            ref = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * nw) @ w.T
            note(worst, "gemv_norm", out, ref)
            assert torch.equal(stream, s), "the residual stream differs"
        assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
        gate_up = torch.randn(1, 2 * k)
        ref = (torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]) @ w.T
        note(worst, "gemv_silu", cuda_ops.silu_and_mul_linear(gate_up, w), ref)


def check_rope_and_silu(worst: dict) -> None:
    """RoPE with the paged KV write (q and k of a fused qkv's strided views, rotated as
    runtime/rope.py rotates them; k and v land at their pages and offsets, nothing else in the
    cache changes), and SiLU-and-multiply."""
    from runtime.rope import apply_rope

    tokens, hq, hkv, hd, page = 5, 4, 2, 16, 4
    qkv = torch.randn(tokens, (hq + 2 * hkv) * hd)
    q = qkv[:, : hq * hd].view(tokens, hq, hd)
    k = qkv[:, hq * hd : (hq + hkv) * hd].view(tokens, hkv, hd)
    v = qkv[:, (hq + hkv) * hd :].view(tokens, hkv, hd)
    angles = torch.randn(tokens, hd // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    cache = torch.randn(6, 2, page, hkv, hd)
    before = cache.clone()
    pages, offsets = torch.tensor([5, 5, 0, 3, 2]), torch.tensor([0, 3, 1, 2, 3])
    q_out = cuda_ops.rope_and_store_kv(q, k, v, cos, sin, cache, pages, offsets)
    note(worst, "rope_q", q_out, apply_rope(q, cos, sin))
    expected = before.clone()
    expected[pages, 0, offsets] = apply_rope(k, cos, sin)
    expected[pages, 1, offsets] = v
    note(worst, "rope_kv", cache, expected)
    gate_up = torch.randn(3, 2 * 100)
    ref = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    note(worst, "silu_mul", cuda_ops.silu_and_mul(gate_up), ref)


def check_quantized_inputs(worst: dict) -> None:
    """The FP8 products' input made and quantized in one kernel: add + RMSNorm (with the
    residual stream written back, and without a residual) and SiLU-and-multiply, against the
    same input computed in PyTorch and quantized by the separate per-token kernel, both
    dequantized. Not against a quantization in PyTorch: the interpreter's float8 conversion
    halves some values that PyTorch's does not (23 of 1,500 normal draws), so only kernels
    against kernels compare here and the GPU tests (tests/gpu/test_fp8.py) check the values."""

    def quantized(y: torch.Tensor) -> torch.Tensor:
        q, scale = cuda_ops.quantize_rows(y, y.shape[1])
        return q.float() * scale

    k = 300
    nw = torch.rand(k) + 0.5
    x, residual = torch.randn(5, k), torch.randn(5, k)
    for res in (None, residual.clone()):
        before = x.clone()
        xq, xs, stream = cuda_ops.quantized_norm(x, res, nw, 1e-5)
        s = x + (0 if res is None else residual)
        ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
        note(worst, "quantized_norm", xq.float() * xs, quantized(ref))
        assert torch.equal(stream, s) and torch.equal(x, before), "the stream or x differs"
        assert res is None or stream.data_ptr() == res.data_ptr(), "the stream is not in place"
    gate_up = torch.randn(4, 2 * k)
    xq, xs = cuda_ops.quantized_silu_and_mul(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    note(worst, "quantized_silu_mul", xq.float() * xs, quantized(ref))


def _paged(lengths, tables, page):
    """(indptr, indices, last_len) int32 of rows of these lengths over these page tables."""
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    indptr, indices, last_len = [0], [], []
    for length, table in zip(lengths, tables):
        used = -(-length // page)
        indices += table[:used]
        indptr.append(len(indices))
        last_len.append(length - (used - 1) * page)
    return i32(indptr), i32(indices), i32(last_len)


# The fused decode attention's rows: three of different lengths over scattered pages of 16.
ROW_LENGTHS, ROW_TABLES = (40, 17, 70), ([3, 7, 1], [0, 5], [2, 4, 6, 8, 9])


def _new_token_slots(lengths, tables, page) -> tuple[list[int], list[int]]:
    """(pages, offsets): where each row's new token, its last, goes."""
    pages = [table[(length - 1) // page] for length, table in zip(lengths, tables)]
    return pages, [(length - 1) % page for length in lengths]


def _attention(q_rotated, cache, lengths, tables, scales=(1.0, 1.0)) -> torch.Tensor:
    """Each row's query heads attending, in float32, over the keys and values of its pages of
    cache (times scales), its query heads shared evenly among the cache's KV heads."""
    batch, hq, hd = q_rotated.shape
    group = hq // cache.shape[3]
    out = torch.empty(batch, hq, hd)
    for b, (length, table) in enumerate(zip(lengths, tables)):
        keys = torch.cat([cache[p, 0] for p in table])[:length].float() * scales[0]
        values = torch.cat([cache[p, 1] for p in table])[:length].float() * scales[1]
        for h in range(hq):
            weights = torch.softmax(keys[:, h // group] @ q_rotated[b, h] * hd**-0.5, 0)
            out[b, h] = weights @ values[:, h // group]
    return out


def check_decode_attention(worst: dict) -> None:
    """Orbit's fused decode attention (RoPE, the new token's KV write, attention over the
    row's pages, the context split in 1, 2 or 4 parts merged by the last program of a row)
    against attention written out in PyTorch: three rows of different lengths over scattered
    pages, two query heads a KV head."""
    from runtime import triton_kernels
    from runtime.rope import apply_rope

    batch, hq, hkv, hd, page = 3, 4, 2, 16, 16
    lengths, tables = ROW_LENGTHS, ROW_TABLES
    cache = torch.randn(10, 2, page, hkv, hd)
    q, k, v = torch.randn(batch, hq, hd), torch.randn(batch, hkv, hd), torch.randn(batch, hkv, hd)
    angles = torch.randn(batch, hd // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pages, offsets = _new_token_slots(lengths, tables, page)
    expected_cache = cache.clone()
    expected_cache[pages, 0, offsets] = apply_rope(k, cos, sin)
    expected_cache[pages, 1, offsets] = v
    scale = hd**-0.5
    expected = _attention(apply_rope(q, cos, sin), expected_cache, lengths, tables)
    # the page list read ahead or not at each split count, the splits merged in one pass (the
    # default); in two passes where splits merge
    cases = [(*c, True) for c in itertools.product((1, 2, 4), (False, True))]
    cases += [(2, False, False), (4, True, False)]
    for splits, ahead, one_pass in cases:
        got_cache, out = cache.clone(), torch.empty(batch, hq, hd)
        workspace = triton_kernels.decode_workspace(batch, hkv, hq // hkv, hd, splits, "cpu")
        with triton_kernels.switched(
            DECODE_PAGES_AHEAD=frozenset({cache.dtype}) if ahead else frozenset(),
            SPLIT_MERGE_ONE_PASS=one_pass,
        ):
            triton_kernels.decode_attention(
                q, k, v, cos, sin, got_cache, *_paged(lengths, tables, page),
                torch.tensor(pages), torch.tensor(offsets), out, workspace, scale, splits,
                block_t=16, min_chunk=16, num_warps=4,
            )  # fmt: skip
        note(worst, "decode_attention", out, expected)
        note(worst, "decode_kv_write", got_cache, expected_cache)


def check_decode_attention_fp8(worst: dict) -> None:
    """The fused decode attention over FP8 pages with scales, its products in float16: bf16
    rows of eight query heads a KV head against attention in float32 over the pages the
    kernel left (the new token's key and value as it quantized them), dequantized."""
    from runtime import triton_kernels
    from runtime.rope import apply_rope

    batch, hq, hkv, hd, page, scales = 3, 8, 2, 32, 16, (0.5, 0.25)
    lengths, tables = ROW_LENGTHS, ROW_TABLES
    cache = (torch.randn(10, 2, page, hkv, hd) * 2).to(torch.float8_e4m3fn)
    q, k, v = (torch.randn(batch, h, hd).bfloat16() for h in (hq, hkv, hkv))
    angles = torch.randn(batch, hd // 2)
    cos, sin = (torch.cat([f(angles)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    pages, offsets = _new_token_slots(lengths, tables, page)
    for ahead in (False, True):
        got_cache, out = cache.clone(), torch.empty(batch, hq, hd, dtype=torch.bfloat16)
        workspace = triton_kernels.decode_workspace(batch, hkv, hq // hkv, hd, 2, "cpu")
        with triton_kernels.switched(
            DECODE_PAGES_AHEAD=frozenset({cache.dtype}) if ahead else frozenset(),
        ):
            triton_kernels.decode_attention(
                q, k, v, cos, sin, got_cache, *_paged(lengths, tables, page),
                torch.tensor(pages), torch.tensor(offsets), out, workspace, hd**-0.5, 2,
                kv_scales=scales, block_t=16, min_chunk=16, num_warps=4,
            )  # fmt: skip
        q_rotated = apply_rope(q.float(), cos.float(), sin.float())
        expected = _attention(q_rotated, got_cache, lengths, tables, scales)
        note(worst, "decode_attention_fp8", out.float(), expected)


# The prefix attention's sequences: (cached tokens, new tokens, page table); the second has no
# new tokens in the step (an unused sequence of a captured graph), the first's new tokens fill
# several query blocks and end one partly.
PREFIX_SEQS = ((37, 21, [3, 7, 1, 5]), (9, 0, [0]), (5, 3, [2]), (70, 6, [4, 6, 8, 9, 10]))


def _prefix_step(hq, hkv, hd, page, dtype=torch.float32):
    """A step of PREFIX_SEQS' new tokens: (q [T, hq, hd], cache, qo_indptr, the paged context
    (kv_indptr, indices, last_len))."""
    lengths = [c + n for c, n, _ in PREFIX_SEQS]
    tables = [t for *_, t in PREFIX_SEQS]
    qo = torch.tensor([0, *torch.tensor([n for _, n, _ in PREFIX_SEQS]).cumsum(0).tolist()])
    q = torch.randn(int(qo[-1]), hq, hd).to(dtype)
    cache = torch.randn(11, 2, page, hkv, hd)
    return q, cache, qo.to(torch.int32), _paged(lengths, tables, page)


def _prefix_expected(q, cache, scales=(1.0, 1.0)) -> torch.Tensor:
    """Each new token of PREFIX_SEQS attending, in float32, over its sequence's keys up to its
    own position (_attention of one row each)."""
    rows, lengths, tables, i = [], [], [], 0
    for cached, new, table in PREFIX_SEQS:
        for j in range(new):
            rows.append(q[i + j].float())
            lengths.append(cached + j + 1)
            tables.append(table)
        i += new
    return _attention(torch.stack(rows), cache, lengths, tables, scales)


def check_prefix_attention(worst: dict) -> None:
    """The split-context attention of a step's new tokens (prefix_attention) against attention
    written out in PyTorch: four sequences, one with no new tokens, blocks of 8 and 16 tokens,
    the context in 1, 2 or 4 parts merged by the last program of a block (in two passes, and
    in one: SPLIT_MERGE_ONE_PASS); two query heads a KV head and three (the group's rows
    padded to four)."""
    from runtime import triton_kernels

    hd, page = 16, 16
    for hq, hkv in ((4, 2), (6, 2)):
        q, cache, qo, paged = _prefix_step(hq, hkv, hd, page)
        expected = _prefix_expected(q, cache)
        for q_tokens in (8, 16):
            for splits, one_pass in ((1, False), (2, False), (4, False), (2, True), (4, True)):
                tokens, seqs = q.shape[0], len(PREFIX_SEQS)
                blocks = triton_kernels.prefix_blocks(tokens, seqs, q_tokens)
                workspace = triton_kernels.prefix_workspace(
                    blocks, hkv, hq // hkv, hd, splits, q_tokens, "cpu"
                )
                out = torch.full((tokens + 3, hq, hd), 7.0)  # rows of no sequence kept
                with triton_kernels.switched(SPLIT_MERGE_ONE_PASS=one_pass):
                    triton_kernels.prefix_attention(
                        q, cache, qo, *paged, out, workspace, hd**-0.5, splits, blocks,
                        q_tokens=q_tokens, block_t=16, min_chunk=16, num_warps=4,
                    )  # fmt: skip
                note(worst, "prefix_attention", out[:tokens], expected)
                worst["prefix_padding"] = max(
                    worst.get("prefix_padding", 0.0), (out[tokens:] - 7.0).abs().max().item()
                )


def check_prefix_attention_fp8(worst: dict) -> None:
    """prefix_attention over FP8 pages with scales, its products in float16: bf16 queries,
    four query heads a KV head, against attention in float32 over the dequantized pages."""
    from runtime import triton_kernels

    hq, hkv, hd, page, scales, q_tokens, splits = 8, 2, 32, 16, (0.5, 0.25), 4, 4
    q, cache, qo, paged = _prefix_step(hq, hkv, hd, page, torch.bfloat16)
    cache = (cache * 2).to(torch.float8_e4m3fn)
    blocks = triton_kernels.prefix_blocks(q.shape[0], len(PREFIX_SEQS), q_tokens)
    workspace = triton_kernels.prefix_workspace(blocks, hkv, 4, hd, splits, q_tokens, "cpu")
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    triton_kernels.prefix_attention(
        q, cache, qo, *paged, out, workspace, hd**-0.5, splits, blocks, kv_scales=scales,
        q_tokens=q_tokens, block_t=16, min_chunk=16, num_warps=4,
    )  # fmt: skip
    note(worst, "prefix_attention_fp8", out.float(), _prefix_expected(q, cache, scales))


def check_exact_tiles(worst: dict) -> None:
    """Inside cuda_ops.exact_rows() one row and a few take the few-rows kernel at one tile and
    ROWS, so rows together equal each row alone exactly (exact_tiles, 0 required; the padding
    rows' masks and the row stride are what it checks here, the tensor cores' column
    independence is for a GPU to show)."""
    n, k, m = 40, 300, 17
    w, bias = torch.randn(n, k) / k**0.5, torch.randn(n)
    x, gate_up = torch.randn(m, k), torch.randn(m, 2 * k)

    def products(x, gate_up):
        return torch.cat([cuda_ops.linear(x, w, bias), cuda_ops.silu_and_mul_linear(gate_up, w)], 1)

    with cuda_ops.exact_rows():
        assert not cuda_ops.one_row(x[:1]) and cuda_ops.few_rows(x[:1])
        together = products(x, gate_up)
        alone = torch.cat([products(x[i : i + 1], gate_up[i : i + 1]) for i in range(m)])
    expected = torch.cat([x @ w.T + bias, cuda_ops.silu_and_mul(gate_up) @ w.T], 1)
    note(worst, "tiles", together, expected)
    worst["exact_tiles"] = (together - alone).abs().max().item()


def check_exact_attention(worst: dict) -> None:
    """A verification row of one sequence as one-token rows (FusedDecodeAttention's exact
    mode: rope_store_kv writes every row's k and v, then the fused kernel reads them, the
    context split as for one row) against the same tokens in one-row steps one after
    another: outputs and cache exactly equal (exact_attention, 0 required)."""
    from runtime import triton_kernels

    hq, hkv, hd, page, start, m, splits = 4, 2, 16, 16, 37, 6, 4
    table = [3, 7, 1, 5]
    cache = torch.randn(8, 2, page, hkv, hd)
    q, k, v = torch.randn(m, hq, hd), torch.randn(m, hkv, hd), torch.randn(m, hkv, hd)
    angles = torch.randn(m, hd // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = range(start, start + m)
    pages = torch.tensor([table[p // page] for p in positions])
    offsets = torch.tensor([p % page for p in positions])
    kw = {"block_t": 16, "min_chunk": 16, "num_warps": 4}
    one_by_one, alone = cache.clone(), torch.empty(m, hq, hd)
    for i, p in enumerate(positions):
        workspace = triton_kernels.decode_workspace(1, hkv, hq // hkv, hd, splits, "cpu")
        triton_kernels.decode_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], cos[i : i + 1], sin[i : i + 1], one_by_one,
            *_paged([p + 1], [table], page), pages[i : i + 1], offsets[i : i + 1],
            alone[i : i + 1], workspace, hd**-0.5, splits, **kw,
        )  # fmt: skip
    together, out = cache.clone(), torch.empty(m, hq, hd)
    triton_kernels.rope_store_kv(q, k, v, q, together, cos, sin, pages, offsets, (1.0, 1.0), True)
    workspace = triton_kernels.decode_workspace(m, hkv, hq // hkv, hd, splits, "cpu")
    triton_kernels.decode_attention(
        q, k, v, cos, sin, together, *_paged([p + 1 for p in positions], [table] * m, page),
        pages, offsets, out, workspace, hd**-0.5, splits, store_new=False, **kw,
    )  # fmt: skip
    worst["exact_attention"] = max(
        (out - alone).abs().max().item(), (together - one_by_one).abs().max().item()
    )


def main() -> int:
    torch.manual_seed(0)
    worst: dict = {}
    check_products(worst)
    check_gemv(worst)
    check_rope_and_silu(worst)
    check_quantized_inputs(worst)
    check_decode_attention(worst)
    check_decode_attention_fp8(worst)
    check_prefix_attention(worst)
    check_prefix_attention_fp8(worst)
    check_exact_tiles(worst)
    check_exact_attention(worst)
    print(json.dumps(worst))
    exact = all(v == 0.0 for name, v in worst.items() if name.startswith("exact"))
    return 0 if exact and all(v <= BOUNDS.get(name, TOL) for name, v in worst.items()) else 1


if __name__ == "__main__":
    sys.exit(main())
