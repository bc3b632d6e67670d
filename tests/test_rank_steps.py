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
from tests.tp_harness import load_runner

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
    return [s.token_id for s in result.samples]


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
