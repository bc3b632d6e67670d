"""FP8 weights on the CUDA path (runtime/matmul.py Fp8Matmul) against float32 PyTorch over the
dequantized weights.

What each comparison can promise:
- the one-row GEMV reads the FP8 weight exactly and multiplies a bf16 activation, so against
  float32 over the dequantized weight it is held to the bf16 bound (1e-2), per-row and block
  scales, with the norm / SiLU-mul fusions;
- the GEMMs quantize the activations per token (and per 128 columns for block scales) first:
  against float32 over the *same* quantized activations they are held to 1e-2; against the
  unquantized activations the difference is the FP8 rounding of the activations, reported;
- the whole model (CUDA graphs, prefill through the GEMMs, decode through the GEMV) against
  transformers in float32 over the dequantized weights: held to FP8_MODEL_TOL, the bf16
  bound plus what rounding every product's input to e4m3 adds (3 mantissa bits: at most
  2^-4 relative per element, a few percent on a product's output, partly averaging out
  across the layers' sums), and reported.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 tensor cores", allow_module_level=True)

from runtime import cuda_ops
from runtime.quant import FP8, WeightQuant, dequantize, quantize
from tests.gpu import compare, models
from tests.gpu.steps import rel_error

TOL = 1e-2
FP8_MODEL_TOL = 6e-2
CHANNEL = WeightQuant("fp8-channel")
BLOCK = WeightQuant("fp8-block", (128, 128))
# (N, K, quant): the 8B architecture's qkv and down, SmolLM2's qkv, odd rows, small blocks.
CASES = [
    (6144, 4096, CHANNEL),
    (4096, 14336, CHANNEL),
    (960, 576, CHANNEL),
    (1001, 3008, CHANNEL),
    (6144, 4096, BLOCK),
    (4096, 14336, BLOCK),
    (96, 96, WeightQuant("fp8-block", (16, 16))),
]


def _weights(n, k, quant, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    w8, scale = quantize(w, quant)
    return g, w8, scale, dequantize(w8, scale)


def _block(quant):
    return quant.block if quant.scheme == "fp8-block" else None


@pytest.mark.parametrize("n,k,quant", CASES)
def test_gemv_matches_float32(n, k, quant):
    g, w8, scale, w = _weights(n, k, quant, 1)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    for b in (None, bias):
        got = cuda_ops.linear(x, w8, b, scale=scale, block=_block(quant))
        ref = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
        assert rel_error(got.float(), ref) <= TOL
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
    act = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
    got = cuda_ops.silu_and_mul_linear(gate_up, w8, scale=scale, block=_block(quant))
    assert rel_error(got.float(), act.to(torch.bfloat16).float() @ w.T) <= TOL
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    out, _ = cuda_ops.norm_linear(x, residual, nw, 1e-5, w8, None, scale, _block(quant))
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()
    assert rel_error(out.float(), normed.to(torch.bfloat16).float() @ w.T) <= TOL


def _quantized_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each row's `group`-column groups rounded through e4m3 (the test's own code)."""
    t, k = x.shape
    xg = x.float().view(t, k // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((xg / s).clamp(-448, 448).to(FP8).float() * s).view(t, k)


@pytest.mark.parametrize("tokens", [3, 64, 65, 300])
@pytest.mark.parametrize("n,k,quant", [c for c in CASES if c[0] % 16 == 0 and c[0] > 96])
def test_gemm_matches_float32_over_quantized_activations(tokens, n, k, quant, report):
    g, w8, scale, w = _weights(n, k, quant, 2)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    if quant.scheme == "fp8-block":
        got, with_bias = (cuda_ops.fp8_block_mm(x, w8, scale, quant.block, b) for b in (None, bias))
        xq = _quantized_activations(x, quant.block[1])
    else:
        got, with_bias = (cuda_ops.fp8_rowwise_mm(x, w8, scale, b) for b in (None, bias))
        xq = _quantized_activations(x, k)
    assert got.shape == (tokens, n) and got.dtype == torch.bfloat16
    assert rel_error(got.float(), xq @ w.T) <= TOL
    # few rows add the bias in the kernel's epilogue, more rows after cuBLASLt's product
    assert rel_error(with_bias.float(), xq @ w.T + bias.float()) <= TOL
    report(
        "fp8_gemm_activation_rounding",
        n=n,
        k=k,
        scheme=quant.scheme,
        tokens=tokens,
        vs_unquantized_activations=rel_error(got.float(), x.float() @ w.T),
    )


@pytest.mark.parametrize("tokens", [33, 64])
@pytest.mark.parametrize("n,k,quant", [c for c in CASES if c[2] is CHANNEL])
def test_split_k_gemm_matches_float32_over_quantized_activations(tokens, n, k, quant):
    """33 to 64 rows of per-row-scaled FP8 through the split-K kernel (FP8_SPLIT_ROWS): each
    part takes the scales on its own, the parts are summed in a fixed order, so the product
    is the same on every call."""
    g, w8, scale, w = _weights(n, k, quant, 7)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    assert cuda_ops.split_rows(x, fp8=True) and not cuda_ops.split_rows(x)
    xq = _quantized_activations(x, k)
    for b in (None, bias):
        got = cuda_ops.fp8_rowwise_mm(x, w8, scale, b)
        ref = xq @ w.T + (0 if b is None else b.float())
        assert got.shape == (tokens, n) and got.dtype == torch.bfloat16
        assert rel_error(got.float(), ref) <= TOL
        assert torch.equal(got, cuda_ops.fp8_rowwise_mm(x, w8, scale, b))


def _e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most e4m3 steps between two float8 tensors' elements: their codes ordered as the
    values are (sign and magnitude: the 7 low bits grow with the magnitude)."""

    def ordinal(q: torch.Tensor) -> torch.Tensor:
        code = q.view(torch.uint8).int()
        return torch.where(code >= 128, 128 - code, code)

    return (ordinal(a) - ordinal(b)).abs().max().item()


@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("k", [4096, 14336, 576])
def test_input_quantized_where_it_is_made_matches_the_separate_launches(tokens, k):
    """The add + RMSNorm and the SiLU-mul that quantize the next product's input as they make
    it (FUSE_QUANTIZE) against FlashInfer's norm or Orbit's SiLU-mul followed by the separate
    per-token quantization: the residual stream equal; the scales within bf16's rounding; each
    float8 value the same or one e4m3 step away. FlashInfer normalizes by the sum before it is
    rounded to bf16 and the fused kernel by the rounded stream, as the PyTorch reference does,
    so a row's scale can move by a bf16 step and values at a rounding boundary by one code
    (the first run had up to 1.5% of relative difference this way)."""
    g = torch.Generator("cuda").manual_seed(11)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    for res in (None, residual):
        h, stream = x.clone(), None if res is None else res.clone()
        if stream is None:
            h = cuda_ops.rms_norm(h, weight, 1e-5)
        else:
            cuda_ops.fused_add_rms_norm(h, stream, weight, 1e-5)
        ref_q, ref_s = cuda_ops.quantize_rows(h, k)
        fused_stream = None if res is None else res.clone()
        xq, xs, out_stream = cuda_ops.quantized_norm(x, fused_stream, weight, 1e-5)
        assert torch.equal(out_stream, x if res is None else stream)
        assert rel_error(xs, ref_s) <= 2**-7
        assert _e4m3_steps(xq, ref_q) <= 1
    gate_up = torch.randn(tokens, 2 * k, device="cuda", dtype=torch.bfloat16, generator=g)
    ref_q, ref_s = cuda_ops.quantize_rows(cuda_ops.silu_and_mul(gate_up), k)
    xq, xs = cuda_ops.quantized_silu_and_mul(gate_up)
    assert rel_error(xs, ref_s) <= 2**-7
    assert _e4m3_steps(xq, ref_q) <= 1


@pytest.mark.parametrize("quant", [CHANNEL, BLOCK])
def test_model_logits_match_dequantized_reference(quant, report):
    """The 4-layer random Llama of test_cuda_runner with its linear weights in FP8, through
    the captured graphs, against transformers over the same weights dequantized."""
    from runtime.layers import TPGroup

    hf = models.random_hf_model(models.llama_config())
    fp8_parts = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("proj.weight"):
                w8, scale = quantize(p.data, quant)
                p.data = dequantize(w8, scale)  # transformers runs the dequantized weights
                fp8_parts[name] = (w8, scale)
    spec, tensors = models.shard_tensors(hf)
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in ("qkv", "o", "gate_up", "down")]:
        # the dequantized weights quantize back to the same FP8 values and scales
        tensors[name], tensors[name + "_scale"] = quantize(tensors[name], quant)
    runner = models.cuda_runner(spec, tensors, TPGroup(), quant=quant)
    errors = compare.logits_vs_transformers(hf, spec, runner, num_new=24, seed=7)
    report(f"fp8_model_logits_{quant.scheme}", **errors)
    assert errors["orbit_vs_transformers_fp32"] <= FP8_MODEL_TOL
