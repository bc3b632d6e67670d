"""The rank's step executor (ranks/steps.py) on the CPU reference path: a step launched before
the previous one is finished takes its follows_sample tokens from the runner's feed, and the
tokens come out exactly as when each step is finished before the next is launched. Real model
(a tiny Llama package), real runner; the plans are what the frontend's scheduler sends."""

from __future__ import annotations

import pytest
import torch

from proto import wire_pb2
from ranks.steps import StepExecutor
from runtime.sampling import sample
from tests.tp_harness import load_runner, result_samples

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8]]
SAMPLING = [
    wire_pb2.SamplingParams(temperature=0.0, num_logprobs=-1),
    wire_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=42, num_logprobs=-1),
]


def _executor(package: str) -> StepExecutor:
    runner, _ = load_runner(package, rank=0, num_pages=8)
    return StepExecutor(runner, 0, torch.device("cpu"), sample, None, max_batch=4)


def _plans(num_decode: int) -> list[wire_pb2.StepPlan]:
    """Prefill both prompts, then decode steps that each follow the previous step's sample."""
    first = wire_pb2.StepPlan(step_id=1)
    for i, (prompt, params) in enumerate(zip(PROMPTS, SAMPLING)):
        first.new_seqs.append(wire_pb2.NewSequence(seq_id=i + 1, sampling=params))
        first.seqs.append(
            wire_pb2.SeqStep(
                seq_id=i + 1, token_ids=prompt, start_pos=0, new_pages=[4 * i], sample=True
            )
        )
    plans = [first]
    for step in range(num_decode):
        plan = wire_pb2.StepPlan(step_id=step + 2)
        for i, prompt in enumerate(PROMPTS):
            plan.seqs.append(
                wire_pb2.SeqStep(
                    seq_id=i + 1, start_pos=len(prompt) + step, sample=True, follows_sample=True
                )
            )
        plans.append(plan)
    return plans


def _tokens(result: wire_pb2.StepResult) -> list[int]:
    return [s.token_id for s in result_samples(result)]


def test_launching_ahead_feeds_the_unfinished_samples(tiny_checkpoints, package_cache):
    package = package_cache(tiny_checkpoints["llama"], 1)
    plans = _plans(num_decode=6)

    one_at_a_time = _executor(package)
    expected = [_tokens(one_at_a_time.finish(one_at_a_time.launch(p, None))) for p in plans]

    ahead = _executor(package)
    fed = 0
    got, previous = [], ahead.launch(plans[0], None)
    for plan in plans[1:]:
        fed += sum(previous.row_of(s.seq_id) >= 0 for s in plan.seqs if s.follows_sample)
        launched = ahead.launch(plan, previous)  # before `previous` is finished
        got.append(_tokens(ahead.finish(previous)))
        previous = launched
    got.append(_tokens(ahead.finish(previous)))

    assert fed == 2 * 6
    assert got == expected
    assert len({t for step in expected for t in step}) > 2  # the model does not repeat one token


def test_a_follow_without_a_sample_is_refused(tiny_checkpoints, package_cache):
    executor = _executor(package_cache(tiny_checkpoints["llama"], 1))
    plan = wire_pb2.StepPlan(step_id=1)
    plan.new_seqs.append(wire_pb2.NewSequence(seq_id=1, sampling=SAMPLING[0]))
    plan.seqs.append(
        wire_pb2.SeqStep(seq_id=1, start_pos=0, new_pages=[0], sample=True, follows_sample=True)
    )
    with pytest.raises(ValueError, match="frontend and the rank disagree"):
        executor.launch(plan, None)


def _decode_plan(step_id: int, rows: list[tuple[int, list[int], int, int]]) -> wire_pb2.StepPlan:
    """rows: (seq_id, token_ids, start_pos, num_samples)."""
    plan = wire_pb2.StepPlan(step_id=step_id)
    for seq_id, ids, start, m in rows:
        plan.seqs.append(
            wire_pb2.SeqStep(
                seq_id=seq_id, token_ids=ids, start_pos=start, sample=True, num_samples=m
            )
        )
    return plan


def test_a_verification_row_draws_as_one_token_steps_do(tiny_checkpoints, package_cache):
    """A row of the last token and proposals draws after each exactly what one-token steps
    draw there (greedy, and seeded sampling); after a wrong proposal the next step overwrites
    its KV, and the sequence goes on as it would have."""
    package = package_cache(tiny_checkpoints["llama"], 1)
    prefill = _plans(num_decode=0)[0]

    one = _executor(package)
    outs = [_tokens(one.finish(one.launch(prefill, None)))]
    for step in range(6):
        rows = [(i + 1, [outs[-1][i]], len(p) + step, 1) for i, p in enumerate(PROMPTS)]
        outs.append(_tokens(one.finish(one.launch(_decode_plan(step + 2, rows), None))))
    ys = list(zip(*outs))  # per sequence: its first 7 output tokens

    spec = _executor(package)
    assert _tokens(spec.finish(spec.launch(prefill, None))) == list(outs[0])
    # proposals: the true next two tokens, then a wrong one, then the true one after it
    rows = [
        (i + 1, [y[0], y[1], y[2], (y[3] + 1) % 50, y[4]], len(p), 5)
        for i, (p, y) in enumerate(zip(PROMPTS, ys))
    ]
    draws = _tokens(spec.finish(spec.launch(_decode_plan(2, rows), None)))
    for i, y in enumerate(ys):
        assert draws[5 * i : 5 * i + 3] == list(y[1:4])  # up to and with the draw after y[2]
    # two proposals kept, the draw y[3] after them: go on from y[3], over the wrong KV
    rows = [(i + 1, [y[3]], len(p) + 3, 1) for i, (p, y) in enumerate(zip(PROMPTS, ys))]
    assert _tokens(spec.finish(spec.launch(_decode_plan(3, rows), None))) == [y[4] for y in ys]
    rows = [(i + 1, [y[4]], len(p) + 4, 1) for i, (p, y) in enumerate(zip(PROMPTS, ys))]
    assert _tokens(spec.finish(spec.launch(_decode_plan(4, rows), None))) == [y[5] for y in ys]


def _packed(plan: wire_pb2.StepPlan) -> wire_pb2.StepPlan:
    """The plan with its decode rows as the frontend sends them (wire.proto DecodeRows)."""
    out = wire_pb2.StepPlan(step_id=plan.step_id)
    for i, s in enumerate(plan.seqs):
        out.decode.seq_ids.append(s.seq_id)
        out.decode.start_pos.append(s.start_pos)
        out.decode.page_rows.extend([i] * len(s.new_pages))
        out.decode.new_pages.extend(s.new_pages)
    return out


def test_packed_decode_rows_draw_as_their_seq_steps_do(tiny_checkpoints, package_cache):
    """Decode rows packed in the plan (DecodeRows, pages added on the way) draw the tokens the
    same rows sent as SeqSteps draw, launched ahead or not; a step of tokens alone comes back
    packed, one that asks for logprobs as a Sample per row."""
    package = package_cache(tiny_checkpoints["llama"], 1)
    plans = _plans(num_decode=6)
    plans[3].seqs[0].new_pages.append(1)  # each sequence gains a page on the way
    plans[5].seqs[1].new_pages.append(5)

    seq_steps = _executor(package)
    expected = [seq_steps.finish(seq_steps.launch(p, None)) for p in plans]
    assert all(not r.samples and len(r.sample_token_ids) == 2 for r in expected)

    packed = _executor(package)
    got, previous = [], packed.launch(plans[0], None)
    for plan in plans[1:]:
        launched = packed.launch(_packed(plan), previous)
        got.append(packed.finish(previous))
        previous = launched
    got.append(packed.finish(previous))
    assert [_tokens(r) for r in got] == [_tokens(r) for r in expected]
    assert packed.seqs[1].pages == [0, 1] and packed.seqs[2].pages == [4, 5]

    logprobs = _executor(package)
    plan = _plans(num_decode=0)[0]
    plan.new_seqs[0].sampling.num_logprobs = 2
    result = logprobs.finish(logprobs.launch(plan, None))
    assert not result.sample_seq_ids and [s.seq_id for s in result.samples] == [1, 2]
    assert len(result.samples[0].top_token_ids) == 2 and not result.samples[1].top_token_ids
    assert _tokens(result) == _tokens(expected[0])


def test_packed_decode_rows_that_disagree_are_refused(tiny_checkpoints, package_cache):
    executor = _executor(package_cache(tiny_checkpoints["llama"], 1))
    executor.finish(executor.launch(_plans(num_decode=0)[0], None))
    plan = _packed(_plans(num_decode=1)[1])
    plan.decode.page_rows.append(7)  # a page for a row that is not there
    plan.decode.new_pages.append(3)
    with pytest.raises(ValueError, match="decode rows' lists disagree"):
        executor.launch(plan, None)
    plan = _packed(_plans(num_decode=1)[1])
    plan.decode.page_rows.append(0)  # a row with no page
    with pytest.raises(ValueError, match="name 1 rows for 0 new pages"):
        executor.launch(plan, None)
    plan = _packed(_plans(num_decode=1)[1])
    plan.decode.seq_ids[1] = 9  # a sequence the rank never held
    with pytest.raises(ValueError, match="sequence 9 is neither new"):
        executor.launch(plan, None)
