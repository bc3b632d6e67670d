"""Orbit's split-context attention of a step's new tokens (runtime/triton_kernels.py
prefix_attention) against FlashInfer's paged prefill, the kernels the prefill graphs run, on
the same pages: the 8B's heads, a turn of 64 tokens after a 2,048-token cached prefix (the
step issue 18 times), several sequences with an unused one among them, and FP8 pages with
scales."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run through the device tool)", allow_module_level=True)

from flashinfer import BatchPrefillWithPagedKVCacheWrapper

from runtime import triton_kernels
from runtime.cuda_attention import prefill_backend
from tests.gpu.steps import rel_error

HQ, HKV, HD, PAGE = 32, 8, 128, 16
# Both round the probabilities before p v (bf16, or float16 over FP8 pages) and the output
# to bf16; they differ in the order of their sums.
TOL = 1e-2


@pytest.mark.parametrize(
    "seqs",
    [
        [(2048, 64)],
        [(2048, 64), (0, 0), (300, 17), (16, 1)],
        [(5, 40)],
    ],
    ids=["cached-turn", "mixed", "fresh-prompt"],
)
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_prefix_attention_matches_flashinfer(seqs, kv):
    """seqs: (cached tokens, new tokens) a sequence."""
    g = torch.Generator().manual_seed(0)
    lengths = [c + n for c, n in seqs]
    pages_per = [max(1, -(-n // PAGE)) for n in lengths]
    num_pages = sum(pages_per)
    fp8 = kv == "fp8"
    scales = (0.5, 0.25) if fp8 else (1.0, 1.0)
    cache = torch.randn(num_pages, 2, PAGE, HKV, HD, generator=g).to(torch.bfloat16).cuda()
    if fp8:
        cache = (cache * 2).to(torch.float8_e4m3fn)
    indices = torch.randperm(num_pages, generator=g).to(torch.int32).cuda()
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32)
    last_len = torch.tensor(
        [n - (p - 1) * PAGE if n else 1 for n, p in zip(lengths, pages_per)], dtype=torch.int32
    )
    qo = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()])
    qo = qo.to(torch.int32)
    tokens = int(qo[-1])
    q = torch.randn(tokens, HQ, HD, generator=g).to(torch.bfloat16).cuda()
    scale = HD**-0.5

    used = [i for i, (_, n) in enumerate(seqs) if n]  # FlashInfer is given the used ones
    f_qo = torch.tensor([0, *torch.tensor([seqs[i][1] for i in used]).cumsum(0).tolist()])
    f_pages = [pages_per[i] for i in used]
    f_indptr = torch.tensor([0, *torch.tensor(f_pages).cumsum(0).tolist()], dtype=torch.int32)
    f_indices = torch.cat([indices[kv_indptr[i] : kv_indptr[i + 1]] for i in used])
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchPrefillWithPagedKVCacheWrapper(
        workspace, "NHD", backend="fa2" if fp8 else prefill_backend(q.device, None)
    )
    wrapper.plan(
        f_qo.to(torch.int32), f_indptr, f_indices, last_len[used], HQ, HKV, HD, PAGE,
        causal=True, sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=cache.dtype,
    )  # fmt: skip
    extra = {"k_scale": scales[0], "v_scale": scales[1]} if fp8 else {}
    expected = wrapper.run(q, cache, **extra)

    q_tokens = 16
    blocks = triton_kernels.prefix_blocks(tokens, len(seqs), q_tokens)
    splits = triton_kernels.prefix_splits(tokens, q_tokens, HKV, q.device)
    work = triton_kernels.prefix_workspace(blocks, HKV, HQ // HKV, HD, splits, q_tokens, "cuda")
    out = torch.empty_like(q)
    for _ in range(2):  # twice: the merge counters must be back at zero after a step
        out.fill_(float("nan"))
        triton_kernels.prefix_attention(
            q, cache, qo.cuda(), kv_indptr.cuda(), indices, last_len.cuda(), out, work, scale,
            splits, blocks, kv_scales=scales, q_tokens=q_tokens,
        )  # fmt: skip
        assert rel_error(out, expected) < TOL
