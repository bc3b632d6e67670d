"""Where the one-row FP8 GEMV's time goes (issue 20: batch-1 decode with FP8 weights), over the
8B architecture's shapes, each product launched 20 times inside a CUDA graph:

- `variants`: the GEMV of runtime/triton_kernels.py (per-row scales) against the same
  persistent loop with the weight bytes handled otherwise: `bytes` sums them as integers (no
  conversion at all: what the access pattern alone allows), `int` builds each weight's f16 bits
  by integer ops ((b & 0x80) << 8 | (b & 0x7F) << 7 is e4m3 x 2^-8), `asm` does the same four
  bytes a register (prmt, and, shr, lop3), `f16` converts by the hardware to f16 and multiplies
  in f16 (float32 sums); `asm16` both. Checked against float32 (except `bytes`).
- `tiles`: the GEMV with tiles that keep more weight bytes in flight per SM (rows per program x
  K x programs per SM) than the tiles of benchmarks/fp8.py's sweep, which all hold 32 KB or less.

    python3 -m benchmarks.fp8_gemv variants --out DIR
    python3 -m benchmarks.fp8_gemv tiles --out DIR
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.decode import copy_bandwidth
from benchmarks.fp8 import _graph_us
from runtime import triton_kernels

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
MODES = {"bytes": 0, "int": 1, "asm": 2, "f16": 3, "asm16": 4}
VARIANT_TILES = [(2, 4, 4), (2, 16, 2), (4, 8, 2), (8, 16, 1)]
# (rows a program, warps, programs per SM): 32 to 128 KB in flight per SM for K = 4096
SHORT_TILES = [(2, 4, 4), (2, 8, 4), (2, 4, 8), (4, 8, 4), (8, 8, 2), (4, 4, 8), (8, 8, 4)]
SHORT_TILES += [(2, 8, 8), (4, 16, 4), (8, 16, 2), (16, 16, 2), (4, 4, 4), (8, 4, 4)]
LONG_TILES = [(2, 16, 2), (2, 8, 4), (4, 16, 2), (2, 16, 4), (4, 8, 4), (1, 8, 8), (2, 4, 8)]
LONG_TILES += [(8, 16, 2), (1, 4, 8), (2, 8, 2)]


@triton.jit
def _f16x4(b):
    # four e4m3 bytes in one register -> four f16 (each e4m3 x 2^-8): halfwords (b0, b1), (b2, b3)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t0, t1, s0, s1;
        prmt.b32 t0, $2, 0, 0x1404;
        prmt.b32 t1, $2, 0, 0x3424;
        and.b32 s0, t0, 0x7F007F00;
        and.b32 s1, t1, 0x7F007F00;
        shr.b32 s0, s0, 1;
        shr.b32 s1, s1, 1;
        lop3.b32 $0, t0, 0x80008000, s0, 0xea;
        lop3.b32 $1, t1, 0x80008000, s1, 0xea;
        }""",
        "=r,=r,r",
        [b],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _variant_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    # runtime/triton_kernels.py's persistent one-row loop (plain, per-row scales), w as bytes
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    col_ok = cols < K
    r = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_N + r
    mask = (rows < N)[:, None] & col_ok[None, :]
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=mask, other=0)
    xk = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    x16 = xk.to(tl.float16)
    for blk in range(pid, tl.cdiv(N, BLOCK_N), programs):
        rows = blk * BLOCK_N + r
        nxt = (blk + programs) * BLOCK_N + r
        mask = (nxt < N)[:, None] & col_ok[None, :]
        w_next = tl.load(
            w_ptr + nxt[:, None].to(tl.int64) * K + cols[None, :],
            mask=mask,
            other=0,
            eviction_policy="evict_first",
        )
        if MODE == 0:
            y = tl.sum(w.to(tl.int32), axis=1).to(tl.float32)
        elif MODE == 1:
            b = w.to(tl.uint16)
            f = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
            y = tl.sum(f.to(tl.float32) * xk[None, :], axis=1) * 256.0
        elif MODE == 2:
            y = tl.sum(_f16x4(w).to(tl.float32) * xk[None, :], axis=1) * 256.0
        elif MODE == 3:
            f = w.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            y = tl.sum((f * x16[None, :]).to(tl.float32), axis=1)
        else:
            y = tl.sum((_f16x4(w) * x16[None, :]).to(tl.float32), axis=1) * 256.0
        y *= tl.load(s_ptr + rows, mask=rows < N, other=0.0)
        tl.store(y_ptr + rows, y.to(tl.bfloat16), mask=rows < N)
        w = w_next


def _variant(mode: int, x, w_bytes, scale, y, tile) -> None:
    n, k = w_bytes.shape
    block_n, warps, per_sm = tile
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = min(triton.cdiv(n, block_n), per_sm * sms)
    _variant_kernel[(grid,)](
        x, w_bytes, scale, y, n, K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_N=block_n,
        MODE=mode, num_warps=warps,
    )  # fmt: skip


def _problem(n: int, k: int):
    w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device="cuda") * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ w.float().t()) * scale
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    return w, scale, x, ref, y


def _row(n, k, label, tile, fn, y, ref, bw, nbytes) -> dict:
    try:
        us = _graph_us(fn)
    except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
        return {"n": n, "k": k, "kernel": label, "tile": tile, "error": str(e)[-200:]}
    err = ((y.float() - ref).norm() / ref.norm()).item()
    return {
        "n": n,
        "k": k,
        "kernel": label,
        "tile": tile,
        "in_flight_kb_per_sm": tile[0] * k * tile[2] // 1024,
        "us": round(us, 2),
        "of_copy": round(nbytes / (us * 1e-6) / bw, 3),
        "rel_err": round(err, 5),
    }


def variants(bw: float) -> list[dict]:
    rows = []
    for n, k in SHAPES:
        w, scale, x, ref, y = _problem(n, k)
        tile = (2, 16, 2) if k > 4096 else (2, 4, 4)  # the tiles the GEMV uses (cuda_ops)
        fn = partial(triton_kernels.gemv_rows, x, w, None, y, tile, w_scale=scale)
        rows.append(_row(n, k, "gemv_rows", tile, fn, y, ref, bw, n * k))
        print(rows[-1], flush=True)
        for name, mode in MODES.items():
            for t in VARIANT_TILES:
                fn = partial(_variant, mode, x, w.view(torch.uint8), scale, y, t)
                rows.append(_row(n, k, name, t, fn, y, ref, bw, n * k))
                print(rows[-1], flush=True)
    return rows


def tiles(bw: float) -> list[dict]:
    rows = []
    for n, k in SHAPES:
        w, scale, x, ref, y = _problem(n, k)
        for t in LONG_TILES if k > 4096 else SHORT_TILES:
            fn = partial(triton_kernels.gemv_rows, x, w, None, y, t, w_scale=scale)
            rows.append(_row(n, k, "gemv_rows", t, fn, y, ref, bw, n * k))
            print(rows[-1], flush=True)
        wb = w.to(torch.bfloat16)
        t = (1, 8, 2) if k > 4096 else (2, 8, 4)  # bf16's tiles, for scale
        fn = partial(triton_kernels.gemv_rows, x, wb, None, y, t)
        ref_bf16 = x.float() @ w.float().t()  # the same weights unscaled, in bf16
        rows.append(_row(n, k, "gemv_rows bf16", t, fn, y, ref_bf16, bw, 2 * n * k))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["variants", "tiles"])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    bw = copy_bandwidth()
    report = {
        "device": torch.cuda.get_device_name(),
        "copy_TBps": bw / 1e12,
        "rows": variants(bw) if args.part == "variants" else tiles(bw),
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fp8_gemv_{args.part}.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
