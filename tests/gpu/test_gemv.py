"""Orbit's one-row GEMV kernels (runtime/cuda_ops.py, runtime/triton_kernels.py) against
float32 PyTorch of the same bf16 inputs: plain, with bias, SiLU-mul fused before the product,
add + RMSNorm fused before it; its few-rows kernel (W x^T) for 2 to 32 rows and its split-K
kernel for 33 to 64. Shapes include rows that do not fill a block and rows shorter than a
chunk, as the SmolLM2 and odd TP slices give."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run through the device tool)", allow_module_level=True)

from runtime import cuda_ops
from tests.gpu.steps import rel_error

# (N, K): the 8B-architecture qkv and down, SmolLM2's qkv, and odd sizes.
SHAPES = [(6144, 4096), (4096, 14336), (960, 576), (1001, 3000), (3, 64)]
TOL = 1e-2  # both sides round the product to bf16 once; the sums differ in order only


def _inputs(n: int, k: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    return g, w, x


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_matches_float32(n, k):
    g, w, x = _inputs(n, k, 1)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    for b in (None, bias):
        got = cuda_ops.linear(x, w, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (1, n) and got.dtype == torch.bfloat16
        assert rel_error(got.float(), ref) <= TOL


@pytest.mark.parametrize("n,k", SHAPES)
def test_silu_and_mul_linear_matches_float32(n, k):
    g, w, _ = _inputs(n, k, 2)
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
    act = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
    ref = act.to(torch.bfloat16).float() @ w.float().T
    assert rel_error(cuda_ops.silu_and_mul_linear(gate_up, w).float(), ref) <= TOL


@pytest.mark.parametrize("n,k", SHAPES)
def test_norm_linear_matches_float32(n, k):
    """norm_linear without and with the residual against float32: the product within TOL, the
    stream rounded once (x itself without a residual), and the inputs as they were (the new
    stream is a new tensor)."""
    g, w, x = _inputs(n, k, 3)
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    x_before, residual_before = x.clone(), residual.clone()
    for res in (None, residual):
        out, stream = cuda_ops.norm_linear(x, res, nw, 1e-5, w, None)
        s = x.float() + (0 if res is None else res.float())
        normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()
        ref = normed.to(torch.bfloat16).float() @ w.float().T
        assert out.shape == (1, n) and rel_error(out.float(), ref) <= TOL
        assert torch.equal(stream, s.to(torch.bfloat16))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def _checked_products(g, w, bias, rows):
    """For each row count: rows of a contiguous tensor and of a wider one (a stride past K, as
    the model's slices give), with and without bias, through cuda_ops.linear, each product
    checked against float32 over the same inputs; yields (x, b, product) for more checks."""
    n, k = w.shape
    for m in rows:
        wide = torch.randn(m, k + 8, device="cuda", dtype=torch.bfloat16, generator=g)
        for x in (wide[:, :k].contiguous(), wide[:, :k]):
            for b in (None, bias):
                got = cuda_ops.linear(x, w, b)
                ref = torch.nn.functional.linear(
                    x.float(), w.float(), None if b is None else b.float()
                )
                assert got.shape == (m, n) and got.dtype == torch.bfloat16
                assert rel_error(got.float(), ref) <= TOL, (m, b is None)
                yield x, b, got


@pytest.mark.parametrize("n,k", SHAPES)
def test_few_rows_match_float32(n, k):
    """2 to HALF_FEW_ROWS rows take Orbit's few-rows kernel (W x^T), one more cuBLAS; rows of
    a wider tensor (a stride past K) as the model's slices give, with and without bias."""
    g, w, _ = _inputs(n, k, 4)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    half = cuda_ops.HALF_FEW_ROWS
    for x, b, got in _checked_products(g, w, bias, (2, 5, half, half + 1)):
        assert cuda_ops.few_rows(x) == (x.shape[0] <= half)
        if x.shape[0] > half:  # beyond the kernel's rows: cuBLAS, exactly
            assert torch.equal(got, torch.nn.functional.linear(x, w, b))
    # The same rows one at a time through the one-row GEMV agree with the few-rows product.
    x = torch.randn(5, k, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = torch.cat([cuda_ops.linear(x[i : i + 1], w, None) for i in range(5)])
    assert rel_error(rows.float(), cuda_ops.linear(x, w, None).float()) <= TOL


@pytest.mark.parametrize("n,k", SHAPES)
def test_split_k_rows_match_float32(n, k, monkeypatch):
    """33 to 64 rows through the split-K kernel once SPLIT_ROWS takes them (it is off until the
    GPU has timed it against cuBLAS): rows of a wider tensor too, with and without bias, and
    the same result on every call (its parts are summed in a fixed order, never by atomics)."""
    monkeypatch.setattr(cuda_ops, "SPLIT_ROWS", 64)
    g, w, _ = _inputs(n, k, 6)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    for x, b, got in _checked_products(g, w, bias, (cuda_ops.HALF_FEW_ROWS + 1, 40, 64)):
        assert cuda_ops.split_rows(x)
        assert torch.equal(got, cuda_ops.linear(x, w, b))


def test_few_rows_silu_and_mul_linear_matches_float32():
    g, w, _ = _inputs(4096, 1000, 5)
    gate_up = torch.randn(5, 2000, device="cuda", dtype=torch.bfloat16, generator=g)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
    ref = torch.nn.functional.linear(act, w.float())
    assert rel_error(cuda_ops.silu_and_mul_linear(gate_up, w).float(), ref) <= TOL
