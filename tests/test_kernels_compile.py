"""Orbit's Triton GEMV, few-rows product, fused decode attention and split-context attention
compiled for Hopper (sm90) on the CPU, with the compiler Triton ships (no GPU needed to
compile): the variants the runner captures must compile, the GEMV and the attention kernels
at the 8B's heads must not spill registers to local memory (a spilled variant is correct but
slow), and the exact verification rows' attention must compute each row by
the one-row kernel's dataflow (tests/ptx_dataflow.py). The interpreter tests
(tests/test_interpreted_kernels.py) check what the kernels compute; these check that the
compiled form exists, fits and keeps the exact rows' promise, which the interpreter cannot."""

from __future__ import annotations

import inspect
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runtime import triton_kernels

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _names(fn) -> list[str]:
    """A Triton kernel's parameter names, in order."""
    return list(inspect.signature(fn.fn).parameters)


def compile_sm90(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages=3):
    """fn compiled for sm90: `types` names every runtime parameter's type, the rest are the
    constexprs, in the kernel's own parameter order. As a launch specialises them: every
    pointer 16-byte aligned (fresh allocations are), every integer a multiple of 16 (the
    shapes and strides here are)."""
    names = _names(fn)
    signature = {n: types.get(n, "constexpr") for n in names}
    assert {n for n, t in signature.items() if t == "constexpr"} == set(constexprs)
    aligned = [n for n, t in signature.items() if t.startswith(("*", "i"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton 3.9's notice about its FP-fusion default
        return triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=HOPPER,
            options={"num_warps": num_warps, "num_stages": num_stages},
        )


def resources(kernel, tmp_path: Path) -> dict[str, int]:
    """REG, STACK and LOCAL of the compiled kernel (cuobjdump --dump-resource-usage)."""
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out = subprocess.run(
        [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


GEMV_TYPES = {
    **{p: "*bf16" for p in ("x_ptr", "res_ptr", "norm_w_ptr", "res_out_ptr", "w_ptr", "b_ptr")},
    "y_ptr": "*bf16",
    "w_scale_ptr": "*bf16",
    "N": "i32",
    "eps": "fp32",
}

# (K, BLOCK_N, warps, what is fused in, FP8 scales: 0 none, 1 per row, 2 per 128 x 128 block)
# of the products a decode step makes: SmolLM2-135M's qkv, down and LM head, the 8B's qkv and
# down, in bf16 and FP8 (cuda_ops._rows_tile's tiles)
GEMV_SHAPES = {
    "smollm2_qkv": (576, 2, 8, "norm", 0),
    "smollm2_down": (1536, 2, 8, "silu", 0),
    "smollm2_lm_head": (576, 2, 8, "", 0),
    "8b_qkv": (4096, 2, 8, "norm", 0),
    "8b_down": (14336, 1, 8, "silu", 0),
    "8b_qkv_fp8_rows": (4096, 2, 4, "norm", 1),
    "8b_down_fp8_blocks": (14336, 2, 16, "silu", 2),
}


def _gemv(shape: str):
    """The GEMV of GEMV_SHAPES[shape] at its tile."""
    k, block_n, warps, fused, scales = GEMV_SHAPES[shape]
    block = 128 if scales == 2 else 1
    constexprs = {
        "K": k,
        "BLOCK_N": block_n,
        "BLOCK_K": triton.next_power_of_2(k),
        "NORM": fused == "norm",
        "ADD_RESIDUAL": fused == "norm",
        "SILU_MUL": fused == "silu",
        "HAS_BIAS": False,
        "PDL": True,
        "SCALE_COLS": triton.cdiv(k, 128) if scales == 2 else 0,
        "W_SCALE": scales,
        "BLOCK_ROWS": block,
        "BLOCK_COLS": block,
    }
    types = dict(GEMV_TYPES)
    if scales:
        types.update(w_ptr="*fp8e4nv", w_scale_ptr="*fp32")
    return compile_sm90(triton_kernels._gemv_rows_kernel, types, constexprs, warps)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build ships no cuobjdump")
@pytest.mark.parametrize("shape", sorted(GEMV_SHAPES))
def test_gemv_compiles_for_hopper_without_spills(shape, tmp_path):
    used = resources(_gemv(shape), tmp_path)
    assert used["STACK"] == 0 and used["LOCAL"] == 0, f"{shape} spills: {used}"
    assert used["REG"] <= 255


# (N, K, rows, fp8) of few-rows products, launched as cuda_ops launches them: SmolLM2-135M's
# qkv and down early (small weights: EARLY_LAUNCH_WEIGHTS), the 8B's qkv and down and its qkv
# in FP8 (per-row scales) plainly; at 32 rows also as the exact graphs launch every 1 to 32
# rows (cuda_ops.exact_rows: ROWS 32 and the 32-row tile), SmolLM2's LM head and the 8B's down
# among them
FEW_ROWS_CASES = {
    "smollm2_qkv": (960, 576, 17, False),
    "smollm2_down": (576, 1536, 8, False),
    "smollm2_lm_head_32": (49152, 576, 32, False),
    "8b_qkv": (6144, 4096, 24, False),
    "8b_down": (4096, 14336, 4, False),
    "8b_down_32": (4096, 14336, 32, False),
    "8b_qkv_fp8": (6144, 4096, 32, True),
}


@pytest.mark.parametrize("case", sorted(FEW_ROWS_CASES))
def test_few_rows_kernel_compiles_for_hopper(case, tmp_path):
    from runtime import cuda_ops

    n, k, rows, fp8 = FEW_ROWS_CASES[case]
    block_n, block_k, stages, warps = (64, 256, 4, 4) if fp8 else cuda_ops._few_tile(n, k, rows)
    half = "*fp8e4nv" if fp8 else "*bf16"
    types = {
        **{p: half for p in ("w_ptr", "x_ptr")},
        **{p: "*fp32" for p in ("xs_ptr", "ws_ptr")},
        **{p: "*bf16" for p in ("b_ptr", "y_ptr")},
        **{p: "i32" for p in ("M", "N", "x_stride")},
    }
    constexprs = {
        "K": k,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "ROWS": max(16, triton.next_power_of_2(rows)),
        "SCALED": fp8,
        "HAS_BIAS": False,
        "PDL": not fp8 and n * k <= cuda_ops.EARLY_LAUNCH_WEIGHTS,
    }
    kernel = compile_sm90(triton_kernels._few_rows_kernel, types, constexprs, warps, stages)
    assert kernel.asm["cubin"]
    if CUOBJDUMP.exists():
        used = resources(kernel, tmp_path)
        assert used["STACK"] == 0 and used["LOCAL"] == 0, f"{case} spills: {used}"


STRIDES = ["q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h"]
STRIDES += ["cs_stride_t", "page_stride", "kv_stride", "slot_stride"]


ATTENTION_TYPES = {
    **{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "cache_ptr")},
    **{p: "*i32" for p in ("indptr_ptr", "indices_ptr", "last_len_ptr", "count_ptr")},
    **{p: "*i64" for p in ("pages_ptr", "offsets_ptr")},
    "out_ptr": "*bf16",
    **{p: "*fp32" for p in ("part_acc_ptr", "part_ml_ptr")},
    **{p: "i32" for p in STRIDES},
    **{p: "fp32" for p in ("scale_log2", "k_scale", "v_scale")},
}

ROPE_TYPES = {
    **{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "cos_ptr", "sin_ptr")},
    "cache_ptr": "*bf16",
    **{p: "*i64" for p in ("pages_ptr", "offsets_ptr")},
    **{p: "i32" for p in ("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h")},
    **{p: "i32" for p in ("v_stride_t", "v_stride_h", "cs_stride_t", "page_stride")},
    **{p: "i32" for p in ("kv_stride", "slot_stride")},
    **{p: "fp32" for p in ("k_inv", "v_inv")},
}


def _decode_attention(
    store_new: bool,
    heads=(3, 3, 32),
    splits: int = 32,
    fp8: bool = False,
    pages_ahead: bool | None = None,
    one_pass_merge: bool = triton_kernels.SPLIT_MERGE_ONE_PASS,
):
    """The kernel as FusedDecodeAttention launches it: by default with SmolLM2-135M's heads
    (9 query heads of 64 over 3 KV heads, heads = (KV heads, group, half the head size)) for
    one row, 32 splits; over bf16 pages, or FP8 ones with the products and the page list's
    reading (pages_ahead None) that decode_attention chooses for them."""
    kv_heads, group, half = heads
    if pages_ahead is None:
        page_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        pages_ahead = page_dtype in triton_kernels.DECODE_PAGES_AHEAD
    constexprs = {
        "NUM_KV_HEADS": kv_heads,
        "GROUP": group,
        "BLOCK_G": 16,
        "HALF": half,
        "BLOCK_H": half,
        "PAGE_SIZE": 16,
        "SPLITS": splits,
        "BLOCK_T": 64,
        "MIN_CHUNK": 128,
        "KV_FP8": fp8,
        "MM_F16": fp8 and triton_kernels.FP8_PAGES_F16_PRODUCTS,
        "PDL": True,
        "STORE_NEW": store_new,
        "PAGES_AHEAD": pages_ahead,
        "ONE_PASS_MERGE": one_pass_merge,
    }
    types = {**ATTENTION_TYPES, "cache_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    return compile_sm90(triton_kernels._decode_attention_kernel, types, constexprs, 8)


@pytest.mark.parametrize("store_new", [True, False])
def test_decode_attention_compiles_for_hopper(store_new):
    """With the new token's KV write, and reading only (exact verification rows)."""
    assert _decode_attention(store_new).asm["cubin"]


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build ships no cuobjdump")
@pytest.mark.parametrize("one_pass_merge", [True, False])
def test_decode_attention_over_32_splits_compiles_without_spills(one_pass_merge, tmp_path):
    """The 8B's heads over 32 splits, the splits' states merged in one pass (the default,
    SPLIT_MERGE_ONE_PASS) or two: no register spilled."""
    kernel = _decode_attention(True, heads=(8, 4, 64), one_pass_merge=one_pass_merge)
    _unspilled_f16_widening(kernel, False, tmp_path)


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build ships no cuobjdump")
@pytest.mark.parametrize("pages_ahead", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_at_the_8b_heads_compiles_without_spills(fp8, pages_ahead, tmp_path):
    """The 8B's heads (32 query heads of 128 over 8 KV heads) over bf16 and FP8 pages, as
    decode_attention launches it for a batch of 64 rows, with the page list read a block
    ahead or not: no register spilled to local memory, and over FP8 pages each pair of e4m3
    values widens to float16 in one instruction with no further conversion to bf16 (a scalar
    conversion an element, which the bf16 products needed: 128 of them in the compiled
    kernel, 2026-12-07)."""
    kernel = _decode_attention(True, heads=(8, 4, 64), splits=1, fp8=fp8, pages_ahead=pages_ahead)
    _unspilled_f16_widening(kernel, fp8, tmp_path)


def _unspilled_f16_widening(kernel, fp8: bool, tmp_path: Path) -> None:
    """No register of the compiled attention kernel spilled to local memory; over FP8 pages,
    each pair of e4m3 values widened to float16 in one instruction and none converted on to
    bf16."""
    usage = resources(kernel, tmp_path)
    assert usage["LOCAL"] == 0 and usage["STACK"] == 0, usage
    if fp8:
        ptx = kernel.asm["ptx"]
        assert "cvt.rn.f16x2.e4m3x2" in ptx
        assert "cvt.bf16.f16" not in ptx


PREFIX_TYPES = {
    **{p: "*i32" for p in ("qo_indptr_ptr", "kv_indptr_ptr", "indices_ptr", "last_len_ptr")},
    **{p: "*bf16" for p in ("q_ptr", "cache_ptr", "out_ptr")},
    **{p: "*fp32" for p in ("part_acc_ptr", "part_ml_ptr")},
    "count_ptr": "*i32",
    **{p: "i32" for p in ("num_seqs", "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h")},
    **{p: "i32" for p in ("page_stride", "kv_stride", "slot_stride")},
    **{p: "fp32" for p in ("scale_log2", "v_scale")},
}


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build ships no cuobjdump")
@pytest.mark.parametrize(("fp8", "one_pass"), [(False, True), (True, True), (False, False)])
def test_prefix_attention_at_the_8b_heads_compiles_without_spills(fp8, one_pass, tmp_path):
    """The split-context attention of a step's new tokens at the 8B's heads (blocks of 16
    tokens of 4 query heads: 64 rows a tile) over bf16 and FP8 pages, and with the two-pass
    merge (SPLIT_MERGE_ONE_PASS off): no register spilled to local memory, and FP8 pages widened
    pairwise to float16 as in the decode kernel."""
    constexprs = {
        "NUM_KV_HEADS": 8,
        "GROUP": 4,
        "BLOCK_GG": 4,
        "QT": 16,
        "HALF": 64,
        "BLOCK_H": 64,
        "PAGE_SIZE": 16,
        "SPLITS": 16,
        "BLOCK_T": 64,
        "MIN_CHUNK": 128,
        "MM_F16": fp8 and triton_kernels.FP8_PAGES_F16_PRODUCTS,
        "ONE_PASS_MERGE": one_pass,
    }
    types = {**PREFIX_TYPES, "cache_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    kernel = compile_sm90(triton_kernels._prefix_attention_kernel, types, constexprs, 8)
    _unspilled_f16_widening(kernel, fp8, tmp_path)


def test_exact_rows_attention_writes_and_reads_as_one_row():
    """The exact verification rows' attention at the compiled level (tests/ptx_dataflow.py):
    rope_store_kv(kv_only) writes the same k and v trees into the cache as the fused kernel
    writes for a one-row step, and the fused kernel without its write stores the same
    output and partial accumulators. (Its partial max and sum differ in form only where the
    write's branch lets the compiler fold where(last, ...) into 1 * x and max(-inf, x),
    equal for finite values: not checked here, the GPU test checks the rows bit for bit.)"""
    from tests.ptx_dataflow import stored_values

    names = _names(triton_kernels._decode_attention_kernel)
    one_row, exact = (_decode_attention(store).asm["ptx"] for store in (True, False))
    for tensor in ("out_ptr", "part_acc_ptr"):
        assert stored_values(exact, names, tensor) == stored_values(one_row, names, tensor)
    assert not stored_values(exact, names, "cache_ptr")
    constexprs = {"NUM_Q_HEADS": 0, "HALF": 32, "BLOCK": 32, "KV_FP8": False, "PDL": True}
    rope = compile_sm90(triton_kernels._rope_store_kv_kernel, ROPE_TYPES, constexprs, 4)
    rope_names = _names(triton_kernels._rope_store_kv_kernel)
    written = set(stored_values(rope.asm["ptx"], rope_names, "cache_ptr"))
    assert written == set(stored_values(one_row, names, "cache_ptr"))


def test_rope_kv_write_and_small_kernels_compile_for_hopper():
    """RoPE with the KV write (bf16 and FP8 pages), SiLU-mul and the per-token FP8
    quantization, at SmolLM2-135M's and the 8B's sizes."""
    for half, fp8 in ((32, False), (64, False), (64, True)):
        types = {**ROPE_TYPES, "cache_ptr": "*fp8e4nv" if fp8 else "*bf16"}
        constexprs = {"NUM_Q_HEADS": 9, "HALF": half, "BLOCK": half, "KV_FP8": fp8, "PDL": True}
        assert compile_sm90(triton_kernels._rope_store_kv_kernel, types, constexprs, 4).asm["cubin"]
    silu = {"x_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32", "x_stride_t": "i32"}
    constexprs = {"BLOCK": 1024, "PDL": True}
    assert compile_sm90(triton_kernels._silu_mul_kernel, silu, constexprs, 4).asm["cubin"]
    quant = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32"}
    for group in (128, 4096):
        constexprs = {"GROUP": group, "BLOCK": group}
        kernel = compile_sm90(triton_kernels._quantize_rows_kernel, quant, constexprs, 4)
        assert kernel.asm["cubin"]


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton build ships no cuobjdump")
@pytest.mark.parametrize("k,silu_mul", [(4096, False), (14336, True), (576, False)])
def test_quantized_product_input_compiles_for_hopper_without_spills(k, silu_mul, tmp_path):
    """The FP8 products' input quantized where it is made (add + RMSNorm before qkv and
    gate_up, SiLU-mul before down) at the 8B's and SmolLM2-135M's widths, as
    triton_kernels.quantize_product_input launches it: a whole row a program, held in
    registers, none spilled to local memory."""
    types = {
        **{p: "*bf16" for p in ("x_ptr", "r_ptr", "w_ptr")},
        "q_ptr": "*fp8e4nv",
        "s_ptr": "*fp32",
        "K": "i32",
        "x_stride": "i32",
        "eps": "fp32",
    }
    block = triton.next_power_of_2(k)
    constexprs = {"ADD": not silu_mul, "SILU_MUL": silu_mul, "BLOCK": block}
    kernel = compile_sm90(
        triton_kernels._quantize_product_input_kernel,
        types,
        constexprs,
        16 if block > 4096 else 8,
    )
    used = resources(kernel, tmp_path)
    assert used.get("LOCAL", 0) == 0 and used.get("STACK", 0) == 0, used
