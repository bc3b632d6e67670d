"""The scheduler on its own: fed hand-made sampled tokens, checked for the plans it builds."""

from __future__ import annotations

import random

import pytest

from runtime.sampling import SamplingParams
from runtime.scheduler import CapacityError, Scheduler, SchedulerConfig, Sequence, Status


def _config(**kw) -> SchedulerConfig:
    base = dict(num_pages=64, page_size=4, max_batch=8, max_step_tokens=16, max_seq_len=128)
    return SchedulerConfig(**{**base, **kw})


def _seq(seq_id: int, prompt_len: int, max_tokens: int, stop=frozenset()) -> Sequence:
    return Sequence(
        seq_id,
        list(range(100, 100 + prompt_len)),
        max_tokens,
        SamplingParams(),
        stop_token_ids=frozenset(stop),
    )


class RankModel:
    """What the ranks hold: page tables built only from the plans' deltas, and every token
    whose KV was computed. Checks that plans are consistent and complete."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: dict[int, list[int]] = {}
        self.kv: dict[int, list[int]] = {}  # tokens computed, per sequence

    def run(self, step) -> None:
        for seq_id in step.released:
            self.pages.pop(seq_id, None)
            self.kv.pop(seq_id, None)
        for c in step.chunks:
            sid = c.seq.seq_id
            if c.is_new:
                assert sid not in self.pages
                self.pages[sid], self.kv[sid] = [], []
            self.pages[sid].extend(c.new_pages)
            assert c.start_pos == len(self.kv[sid]), "a chunk must continue where the cache ends"
            self.kv[sid].extend(c.token_ids)
            needed = -(-len(self.kv[sid]) // self.page_size)
            assert len(self.pages[sid]) >= needed, "tokens written past the page table"
        used = [p for pages in self.pages.values() for p in pages]
        assert len(used) == len(set(used)), "a page is held by two sequences"


def _drive(sched: Scheduler, rank: RankModel, next_token, max_steps: int = 10_000):
    finished, steps = {}, 0
    while sched.has_work and steps < max_steps:
        step = sched.schedule()
        assert step is not None
        assert len(step.chunks) <= sched.config.max_batch
        assert sum(c.num_tokens for c in step.chunks) <= sched.config.max_step_tokens
        rank.run(step)
        sampled = {c.seq.seq_id: next_token(c.seq) for c in step.sampling_chunks}
        for seq in sched.apply(step, sampled):
            if seq.finish_reason:
                finished[seq.seq_id] = seq
        steps += 1
    return finished, steps


def test_prompt_longer_than_budget_is_prefilled_in_chunks():
    sched = Scheduler(_config())
    sched.add(_seq(1, 40, 3))
    step = sched.schedule()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in step.chunks] == [(0, 16, False)]
    sched.apply(step, {})
    step = sched.schedule()
    assert [(c.start_pos, c.num_tokens, c.sample) for c in step.chunks] == [(16, 16, False)]


def test_decodes_are_not_stalled_by_a_long_prompt():
    sched = Scheduler(_config())
    sched.add(_seq(1, 4, 50))
    step = sched.schedule()
    sched.apply(step, {1: 7})
    sched.add(_seq(2, 100, 5))
    for _ in range(5):
        step = sched.schedule()
        ids = {c.seq.seq_id: c for c in step.chunks}
        assert ids[1].num_tokens == 1 and ids[1].sample
        assert 2 in ids and ids[2].num_tokens == 15
        sched.apply(step, {1: 7, **({2: 9} if ids[2].sample else {})})


def test_every_request_finishes_with_its_exact_tokens_under_pressure():
    rng = random.Random(0)
    sched = Scheduler(_config(num_pages=24))
    rank = RankModel(4)
    seqs = [_seq(i, rng.randint(1, 40), rng.randint(1, 30)) for i in range(1, 21)]
    for s in seqs:
        sched.add(s)
    # The next token is a function of the sequence's tokens so far, as a real model's would be.
    finished, _ = _drive(sched, rank, lambda s: (sum(s.prompt_ids) + 31 * len(s.output_ids)) % 997)
    assert sorted(finished) == [s.seq_id for s in seqs]
    for s in seqs:
        assert s.finish_reason == "length" and len(s.output_ids) == s.max_tokens
        assert s.output_ids == [(sum(s.prompt_ids) + 31 * i) % 997 for i in range(s.max_tokens)]
    assert sched.num_preemptions > 0
    assert sched.pages_in_use == 0 and not sched.running


def test_stop_token_finishes_and_frees():
    sched = Scheduler(_config())
    seq = _seq(1, 5, 100, stop={2})
    sched.add(seq)
    tokens = iter([5, 6, 2, 9])
    finished, _ = _drive(sched, RankModel(4), lambda s: next(tokens))
    assert finished[1].finish_reason == "stop" and seq.output_ids == [5, 6, 2]
    assert sched.pages_in_use == 0
    step = sched.schedule()
    assert step.released == [1] and not step.chunks


def test_abort_releases_pages_at_next_step():
    sched = Scheduler(_config())
    a, b = _seq(1, 8, 20), _seq(2, 8, 20)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.apply(step, {1: 3, 2: 4})
    sched.abort(a)
    assert a.status is Status.FINISHED and a.finish_reason == "abort"
    step = sched.schedule()
    assert step.released == [1]
    assert [c.seq.seq_id for c in step.chunks] == [2]


def test_max_batch_caps_a_step():
    sched = Scheduler(_config(max_batch=3, max_step_tokens=64))
    for i in range(1, 6):
        sched.add(_seq(i, 2, 4))
    step = sched.schedule()
    assert [c.seq.seq_id for c in step.chunks] == [1, 2, 3]


def test_requests_that_can_never_fit_are_refused():
    sched = Scheduler(_config(num_pages=8, max_seq_len=64))
    with pytest.raises(CapacityError, match="exceeds max_seq_len 64"):
        sched.add(_seq(1, 60, 10))
    with pytest.raises(CapacityError, match="needs 10 KV pages; the pool has 8"):
        sched.add(_seq(2, 30, 10))
