"""The CUDA path (FlashInfer's and Orbit's attention, decode from CUDA graphs) against
transformers on the GPU and against the CPU reference path, on a random Llama-architecture
model in bf16.

What each comparison can honestly promise:
- logits vs transformers bf16 on the GPU: relative error <= 1e-2 (two bf16 implementations
  with different kernels and summation orders);
- greedy tokens vs the CPU reference (float32 over the same bf16-rounded weights): equal until
  the first step where the reference's own top-2 margin is within twice the measured logit
  error (a near-tie that bf16 rounding may decide either way), with the error itself held to
  the bf16 bound at every step; how far the tokens agree is reported;
- padding and the NCCL calls: bitwise, since neither may change a real row at all.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run through the device tool)", allow_module_level=True)

from runtime.cuda_runner import BucketError
from runtime.layers import TPGroup
from runtime.runner import SeqInput
from tests.gpu import compare, models, steps
from tests.gpu.compare import (
    BF16_REL_TOL,
    check_greedy,
    random_prompts,
)


@pytest.fixture(scope="module")
def llama(nccl_group):
    """(hf float32 CPU model, spec, tensors, runner with NCCL collectives, plain runner)."""
    hf = models.random_hf_model(models.llama_config())
    spec, tensors = models.shard_tensors(hf)
    with_nccl = models.cuda_runner(spec, tensors, nccl_group)
    plain = models.cuda_runner(spec, tensors, TPGroup())
    return hf, spec, tensors, with_nccl, plain


def test_logits_match_transformers(llama, report):
    hf, spec, _, runner, _ = llama
    worst = compare.logits_vs_transformers(hf, spec, runner, num_new=24, seed=7)
    report("llama_logits_vs_transformers", **worst)
    vs_fp32, vs_bf16 = compare.bf16_bounds(worst)
    assert worst["transformers_bf16_vs_fp32"] <= BF16_REL_TOL  # so the bounds are the 1e-2
    assert worst["orbit_vs_transformers_fp32"] <= vs_fp32
    assert worst["orbit_vs_transformers_bf16"] <= vs_bf16


def test_greedy_matches_cpu_reference(llama, report):
    _, spec, tensors, runner, _ = llama
    prompts = random_prompts(spec.vocab_size, seed=9)
    tables = steps.page_tables(3, 512)
    gpu_tokens, gpu_logits = steps.greedy(runner, prompts, tables, max_new=32)
    ref = models.reference_runner(spec, tensors)
    ref_tokens, _ = steps.greedy(ref, prompts, tables, max_new=32)
    ref_logits = steps.teacher_forced(
        models.reference_runner(spec, tensors), prompts, [t[:-1] for t in gpu_tokens], tables
    )
    agree = [
        check_greedy(g, r, gl, rl)
        for g, r, gl, rl in zip(gpu_tokens, ref_tokens, gpu_logits, ref_logits)
    ]
    report("llama_greedy_vs_cpu_reference", tokens_agreeing=agree, max_new=32)


def test_nccl_collectives_in_graphs_change_nothing(llama):
    """The runner whose all-reduces and all-gather go through NCCL (captured in its graphs)
    gives bitwise the logits of the one that skips them."""
    _, spec, _, with_nccl, plain = llama
    prompts = random_prompts(spec.vocab_size, seed=10)
    conts = random_prompts(spec.vocab_size, lengths=(6,) * 3, seed=11)
    tables = steps.page_tables(3, 512)
    a = steps.teacher_forced(with_nccl, prompts, conts, tables)
    b = steps.teacher_forced(plain, prompts, conts, tables)
    for rows_a, rows_b in zip(a, b):
        for x, y in zip(rows_a, rows_b):
            assert torch.equal(x, y)


def test_padding_never_changes_results(llama, report):
    """3 sequences padded to bucket 4: scribbling over the padding page between two identical
    replays changes nothing (bitwise); the padded graph agrees with the eager, unpadded step
    (other kernels) within bf16 tolerance."""
    _, spec, _, runner, _ = llama
    prompts = random_prompts(spec.vocab_size, seed=12)
    tables = steps.page_tables(3, 512)
    first = steps.prefill(runner, prompts, tables)
    tokens = [int(row.argmax()) for row in first]
    contexts = [len(p) for p in prompts]
    a = steps.decode(runner, tokens, contexts, tables)
    for layer in runner.kv.layers:
        layer[runner.pad_page].normal_()
    b = steps.decode(runner, tokens, contexts, tables)
    eager = steps.decode(runner, tokens, contexts, tables, eager=True)
    assert torch.equal(a, b)
    err = steps.rel_error(a, eager)
    report("padding_graph_vs_eager", rel_err=err, batch=3, bucket=4)
    assert err <= BF16_REL_TOL


def test_fused_decode_attention_matches_flashinfer(llama, report):
    """Decode through the fused-attention graphs (the default for every bucket at these
    contexts) against a runner without them (FlashInfer's kernels), and against one that
    switches from the first to the second as the contexts pass fused_decode_max_context: the
    same logits within bf16 tolerance at batch 1, 3 (bucket 4), 8 and 16, over six steps."""
    _, spec, tensors, _, fused = llama
    flashinfer = models.cuda_runner(spec, tensors, TPGroup(), fused_decode_max_bucket=0)
    lengths = [40 + 9 * i for i in range(16)]
    switching = models.cuda_runner(
        spec, tensors, TPGroup(), fused_decode_max_context=max(lengths) + 3
    )
    worst = 0.0
    for batch in (1, 3, 8, 16):
        prompts = random_prompts(spec.vocab_size, lengths=lengths[:batch], seed=30 + batch)
        tables = steps.page_tables(batch, 512, per_seq=16)  # 256 tokens a sequence
        results = [
            steps.decode_run(runner, prompts, tables, spec.vocab_size, 6)
            for runner in (fused, flashinfer, switching)
        ]
        for other in results[1:]:
            worst = max(worst, steps.rel_error(results[0], other))
    report("fused_decode_vs_flashinfer", rel_err=worst)
    assert worst <= BF16_REL_TOL


def _graph_against_eager(runner, seqs: list[SeqInput], name: str) -> float:
    """A step replayed from its graph against the same step run eagerly and unpadded: one row
    of logits a sample, within bf16 tolerance (other attention schedules, GEMMs over more
    rows), and a second replay over a scribbled padding page equal to the first, bitwise.
    Returns the relative error."""
    eager = runner.step_eager(seqs).float().cpu()
    graph = runner.step(seqs).float().cpu()
    for layer in runner.kv.layers:
        layer[runner.pad_page].normal_()
    assert torch.equal(graph, runner.step(seqs).float().cpu()), name
    rows = (sum(s.num_logits for s in seqs), runner.model.spec.vocab_size)
    assert graph.shape == eager.shape == rows, name
    err = steps.rel_error(graph, eager)
    assert err <= BF16_REL_TOL, name
    return err


def test_prefill_graphs_match_the_eager_path(llama, report):
    """Prefill and mixed steps replayed from the token-bucket graphs (padded rows, empty
    sequences) agree with the same steps run eagerly and unpadded, within bf16 tolerance (other
    attention schedules, GEMMs over more rows); scribbling over the padding page between two
    identical replays changes nothing (bitwise)."""
    _, spec, _, runner, _ = llama
    tables = steps.page_tables(8, 512)
    prompts = random_prompts(spec.vocab_size, lengths=(300, 7, 64, 5), seed=15)
    history = steps.prefill(runner, prompts[:1], tables[:1], chunk=256)  # 300 cached tokens
    shapes = {
        "one prompt, 100 of bucket 128": [SeqInput(prompts[0][:100], 0, tables[1], True)],
        "exactly a bucket (64)": [SeqInput(prompts[2], 0, tables[2], True)],
        "chunk at 256 of a cached sequence": [SeqInput(prompts[0][256:], 256, tables[0], True)],
        "mixed: 3 decode rows, a 7-token prompt, a non-sampling chunk": [
            SeqInput([11], 300, tables[0], True),
            SeqInput(prompts[1], 0, tables[3], True),
            SeqInput([12], 0, tables[4], True),
            SeqInput(prompts[2][:40], 0, tables[5], False),
            SeqInput([13], 0, tables[6], True),
        ],
        "8 short prompts": [SeqInput(prompts[3], 0, tables[i], True) for i in range(8)],
        "verification rows (speculative decoding) beside a decode row": [
            SeqInput(prompts[0][256:261], 300, tables[0], True, num_samples=5),
            SeqInput([12], 0, tables[4], True),
            SeqInput(prompts[3][:3], 5, tables[6], True, num_samples=3),
        ],
    }
    worst = {name: _graph_against_eager(runner, seqs, name) for name, seqs in shapes.items()}
    report("prefill_graph_vs_eager", rel_err=worst, history_rows=len(history))


def test_mixed_steps_through_the_fa2_graphs_match_the_eager_path(llama, report):
    """A runner whose buckets also hold FA2 graphs for steps of at least 3 decode rows beside
    prompt chunks (mixed_fa2_min_rows, 48 by default): such a step replays them, fewer decode
    rows keep the FA3 graphs, and both agree with the eager path (FA3, unpadded) within bf16
    tolerance; replaying twice over a scribbled padding page gives the same logits."""
    _, spec, tensors, _, _ = llama
    runner = models.cuda_runner(spec, tensors, TPGroup(), mixed_fa2_min_rows=3)
    if torch.cuda.get_device_capability()[0] != 9:
        assert not runner.mixed_buckets  # FA2 is every graph's kernel already
        return
    assert runner.mixed_buckets == runner.prefill_buckets  # each holds 16 sequences
    tables = steps.page_tables(8, 512)
    prompts = random_prompts(spec.vocab_size, lengths=(300, 7, 40), seed=16)
    steps.prefill(runner, prompts[:1], tables[:1], chunk=256)
    mixed = [
        SeqInput([11], 300, tables[0], True),
        SeqInput(prompts[1], 0, tables[3], True),
        SeqInput([12], 0, tables[4], True),
        SeqInput(prompts[2], 0, tables[5], False),
        SeqInput([13], 0, tables[6], True),
    ]
    shapes = {"3 decode rows: FA2": mixed, "2 decode rows: FA3": mixed[:4]}
    worst = {}
    for name, seqs in shapes.items():
        assert runner._mixed(seqs) == name.endswith("FA2")
        worst[name] = _graph_against_eager(runner, seqs, name)
    report("mixed_fa2_graph_vs_eager", rel_err=worst)


def test_steps_through_the_split_context_graphs_match_the_eager_path(llama, report):
    """A runner whose buckets of up to 64 tokens also hold graphs attending through Orbit's
    split-context kernel (prefix_attention_max_tokens), replayed for steps of at most 8
    sequences whose longest context reaches 256 tokens: a turn after 300 cached tokens, a
    verification row and a decode row beside it, and a short prompt that keeps FlashInfer's
    graph all agree with the eager path within bf16 tolerance; replaying twice over a
    scribbled padding page gives the same logits."""
    _, spec, tensors, _, _ = llama
    runner = models.cuda_runner(
        spec, tensors, TPGroup(), prefix_attention_max_tokens=64, prefix_attention_max_seqs=8,
        prefix_attention_min_context=256,
    )  # fmt: skip
    assert runner.prefix_buckets == (16, 32, 64)
    tables = steps.page_tables(8, 512)
    prompts = random_prompts(spec.vocab_size, lengths=(300, 7, 40, 700), seed=17)
    steps.prefill(runner, [prompts[0], prompts[3][:640]], [tables[0], tables[1]], chunk=256)
    shapes = {
        "a turn of 40 after 300 cached: split": [SeqInput(prompts[2], 300, tables[0], True)],
        "two turns and a decode row: split": [
            SeqInput(prompts[2][:20], 300, tables[0], True),
            SeqInput(prompts[3][640:680], 640, tables[1], True, num_samples=4),
            SeqInput([11], 0, tables[2], True),
        ],
        "a short prompt: FlashInfer": [SeqInput(prompts[1], 0, tables[3], True)],
    }
    worst = {}
    for name, seqs in shapes.items():
        tokens = next(t for t in runner.prefill_buckets if t >= sum(len(s.token_ids) for s in seqs))
        assert runner._long_context(seqs, runner._prefix_attn[tokens]) == name.endswith("split")
        worst[name] = _graph_against_eager(runner, seqs, name)
    report("prefix_graph_vs_eager", rel_err=worst)


@pytest.mark.parametrize("which", ["plain", "nccl"])
def test_steady_state_allocates_no_gpu_memory(llama, report, which):
    """After warm-up, decode steps make no allocator call at all and prefill steps (a graph
    replay, then the eager LM head) reuse cached blocks: reserved memory stays put. With NCCL,
    ProcessGroupNCCL holds an eager collective's tensors until its watchdog sees the work
    finish, so allocated bytes are compared on the plain runner only."""
    _, spec, _, with_nccl, plain = llama
    runner = plain if which == "plain" else with_nccl
    tables = steps.page_tables(8, 512)
    prompts = random_prompts(spec.vocab_size, lengths=(40,) * 8, seed=13)
    steps.prefill(runner, prompts, tables)  # warm the eager LM head's cached blocks
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    decode_allocs = 0
    for i in range(120):
        batch = (1, 3, 8, 5)[i % 4]
        seqs = [SeqInput([i % 100], 40 + i, tables[j], True) for j in range(batch)]
        count = torch.cuda.memory_stats()["allocation.all.allocated"]
        runner.step(seqs)
        decode_allocs += torch.cuda.memory_stats()["allocation.all.allocated"] - count
    steps.prefill(runner, prompts, tables)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    report(
        f"steady_state_memory_{which}",
        before=before,
        after=after,
        decode_step_allocations=decode_allocs,
    )
    assert decode_allocs == 0
    assert after[1] == before[1]
    if which == "plain":
        assert after[0] == before[0]


def test_out_of_bucket_steps_are_refused(llama):
    _, _, _, runner, _ = llama
    tables = steps.page_tables(8, 512)
    too_many = [SeqInput([1], 0, tables[i % 8], True) for i in range(17)]
    with pytest.raises(BucketError, match="largest captured bucket"):
        runner.step(too_many)
    with pytest.raises(BucketError, match="tokens per step"):
        runner.step([SeqInput([1] * 257, 0, tables[0], True)])


def test_fed_tokens_equal_host_tokens(llama):
    """Greedy decode where each step's tokens stay on the GPU (feed() + fed_row, as a rank
    runs when the frontend plans a step ahead) gives bitwise the logits of the same decode
    with the tokens passed from the host in graph steps, and feeds the eager (mixed) path
    too."""
    _, spec, _, runner, _ = llama
    prompts = random_prompts(spec.vocab_size, seed=14)
    tables = steps.page_tables(6, 512)
    host_tables, fed_tables = tables[:3], tables[3:]
    contexts = [len(p) for p in prompts]
    first = steps.prefill(runner, prompts, host_tables)
    steps.prefill(runner, prompts, fed_tables)
    tokens = [int(row.argmax()) for row in first]
    fed = torch.tensor(tokens, device="cuda")
    for step in range(6):
        host = steps.decode(runner, tokens, [c + step for c in contexts], host_tables)
        runner.feed(fed)
        seqs = [
            SeqInput([0], c + step, tab, True, fed_row=i)
            for i, (c, tab) in enumerate(zip(contexts, fed_tables))
        ]
        # The last step mixes in a 2-token prefill chunk: the prefill graphs feed too.
        extra = [SeqInput([5, 6], 0, tables[0][-2:], False)] if step == 5 else []
        out = (runner.step(seqs + extra) if extra else runner.step(seqs)).float().cpu()
        if not extra:
            assert torch.equal(out, host)
        else:  # the prefill graph's kernels against the decode graph's: bf16 tolerance
            assert steps.rel_error(out, host) <= BF16_REL_TOL
        fed = out.argmax(-1).cuda()
        tokens = host.argmax(-1).tolist()


def test_verification_rows_equal_one_row_steps_bit_for_bit(llama, report):
    """As tests/gpu/test_smollm2_arch.py checks it, at head_dim 128 and wider weights."""
    _, spec, tensors, _, _ = llama
    runner = models.cuda_runner(spec, tensors, TPGroup(), exact_verify_max_bucket=32)
    diff = steps.verification_vs_one_row_steps(runner, spec.vocab_size, seed=44)
    report("verification_vs_one_row_steps", **diff)
    assert diff == {"logits_max_abs_diff": 0.0, "kv_max_abs_diff": 0.0}
