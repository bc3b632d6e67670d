"""FP8 KV pages on the CUDA path against the CPU reference over FP8 pages with the same scales
(runtime/attention.py ReferenceAttention, which stores k / k_scale and v / v_scale in e4m3):

- Orbit's fused decode kernel (its KV write quantizes, its reads widen and scale), through
  tests/gpu/test_decode_attention.py's cases;
- the whole model through every graph kind (FlashInfer's FA2 prefill and decode kernels
  reading e4m3 pages with k_scale / v_scale, the fused decode graphs), teacher-forced: the
  FP8 runner's logits against the float32 reference's over FP8 pages, and against a bf16-page
  runner's (reported: what FP8 pages cost on this model);
- the pool: an FP8 page takes half a bf16 page's bytes, so the same memory holds twice the
  pages.

The reference rounds the rotated key from float32 to e4m3 where the kernels round it to bf16
first, so now and then a stored key differs by one e4m3 step (1/16 of itself): the bounds
below allow for that on top of the bf16 ones.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU with FP8 support", allow_module_level=True)

from runtime.kv_cache import KVCache
from runtime.layers import TPGroup
from runtime.quant import KVQuant
from tests.gpu import models, steps
from tests.gpu.compare import random_prompts
from tests.gpu.test_decode_attention import CASES, run_case

FP8_KV_TOL = 3e-2


@pytest.mark.parametrize("lengths,hq,hkv,hd,page_size,splits", CASES)
def test_fused_decode_over_fp8_pages_matches_reference(lengths, hq, hkv, hd, page_size, splits):
    err, cache_err = run_case(
        "cuda", lengths, hq, hkv, hd, page_size, splits, kv_scales=(0.5, 0.25)
    )
    assert err <= FP8_KV_TOL, err
    assert cache_err <= 7e-2, cache_err  # the new keys: at most one e4m3 step apart


@pytest.fixture(scope="module")
def llama_tensors():
    spec, tensors = models.shard_tensors(models.random_hf_model(models.llama_config()))
    return spec, tensors


def _scales(spec) -> KVQuant:
    # keys and values of this random model are ~0.3: scales that put them mid-range in e4m3
    return KVQuant(
        tuple(1 / 64 * (1 + i / 8) for i in range(spec.num_layers)),
        tuple(1 / 128 * (1 + i / 8) for i in range(spec.num_layers)),
    )


def _stack(rows: list[list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([torch.stack(r) for r in rows])


def test_model_over_fp8_pages_matches_reference(llama_tensors, report):
    spec, tensors = llama_tensors
    quant = _scales(spec)
    fp8 = models.cuda_runner(spec, tensors, TPGroup(), kv_quant=quant)
    bf16 = models.cuda_runner(spec, tensors, TPGroup())
    assert fp8.kv.dtype == torch.float8_e4m3fn
    assert 2 * fp8.kv_plan.page_bytes == bf16.kv_plan.page_bytes
    ref = models.reference_runner(spec, tensors)
    ref.kv = KVCache(ref.kv.shape, torch.float32, "cpu", quant)

    lengths = [37, 300, 700, 5]  # across the fused decode's context limit, and prefill chunks
    prompts = random_prompts(spec.vocab_size, lengths=lengths, seed=7)
    conts = [[(31 * i + 7 * s) % spec.vocab_size for s in range(6)] for i in range(len(prompts))]
    tables = steps.page_tables(len(prompts), 512)
    got = steps.teacher_forced(fp8, prompts, conts, tables)
    want = steps.teacher_forced(ref, prompts, conts, tables)
    dense = steps.teacher_forced(bf16, prompts, conts, tables)
    err = steps.rel_error(_stack(got), _stack(want))
    cost = steps.rel_error(_stack(got), _stack(dense))
    report("fp8_kv_vs_reference", rel_err=err, fp8_vs_bf16_pages=cost)
    assert err <= FP8_KV_TOL, err
    # batch 1 again: the fused decode graph at a short context, FlashInfer's past it
    one = steps.teacher_forced(fp8, prompts[:1], conts[:1], tables[:1])
    ref_one = steps.teacher_forced(ref, prompts[:1], conts[:1], tables[:1])
    assert steps.rel_error(_stack(one), _stack(ref_one)) <= FP8_KV_TOL
    # FlashInfer's decode kernels for every bucket (its k_scale in the softmax scale, v_scale
    # on the output), as buckets beyond the fused kernel's run
    flashinfer = models.cuda_runner(
        spec, tensors, TPGroup(), kv_quant=quant, fused_decode_max_bucket=0
    )
    fi = steps.teacher_forced(flashinfer, prompts, conts, tables)
    fi_err = steps.rel_error(_stack(fi), _stack(want))
    report("fp8_kv_flashinfer_decode_vs_reference", rel_err=fi_err)
    assert fi_err <= FP8_KV_TOL, fi_err
    # past fused_decode_fp8_max_context the same rows leave the fused graph: the three decode
    # steps within it replay what the default runner replayed, bitwise, the three past it do
    # not, and all stay within tolerance
    switching = models.cuda_runner(
        spec, tensors, TPGroup(), kv_quant=quant, fused_decode_fp8_max_context=max(lengths) + 3
    )
    sw, fused = _stack(steps.teacher_forced(switching, prompts, conts, tables)), _stack(got)
    assert torch.equal(sw[:, :4], fused[:, :4])
    assert not torch.equal(sw[:, 4:], fused[:, 4:])
    assert steps.rel_error(sw, _stack(want)) <= FP8_KV_TOL
