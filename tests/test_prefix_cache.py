"""Prefix caching in the scheduler, against the rank model of test_scheduler (which holds the KV
pages themselves and checks that every context a step reads holds its sequence's tokens)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from runtime import scheduler
from runtime.sampling import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig, Sequence, Status
from tests.test_scheduler import RankModel, _drive, _seeded

PS = 4


def _config(**kw) -> SchedulerConfig:
    base = {"num_pages": 64, "page_size": PS, "max_batch": 8, "max_step_tokens": 16}
    base["max_seq_len"] = 128
    return SchedulerConfig(**{**base, **kw})


def _seq(seq_id: int, prompt: list[int], max_tokens: int, grammar: bool = False) -> Sequence:
    return Sequence(seq_id, list(prompt), max_tokens, SamplingParams(), has_grammar=grammar)


def _first_chunk(step, seq_id):
    [c] = [c for c in step.chunks if c.seq.seq_id == seq_id]
    return c


def test_a_prompt_that_starts_like_an_earlier_one_starts_after_the_shared_pages():
    sched, rank = Scheduler(_config()), RankModel(PS)
    system = list(range(500, 514))  # 3 full pages and 2 tokens
    a = _seq(1, system + [1, 2, 3], 3)
    sched.add(a)
    _drive(sched, rank, _seeded)
    b = _seq(2, system + [7, 8], 3)
    sched.add(b)
    step = sched.schedule()
    c = _first_chunk(step, 2)
    assert c.is_new and c.start_pos == 12 and c.num_tokens == 4
    assert len(c.new_pages) == 4 and all(sched.cache.is_cached(p) for p in c.new_pages[:3])
    assert b.cached_tokens == 12
    rank.run(step, _seeded)
    sched.apply(step, {2: _seeded(b, 16)})
    _drive(sched, rank, _seeded)
    assert b.output_ids == [_seeded(b, 16 + i) for i in range(3)]
    assert (sched.cache.hit_tokens, sched.cache.prompt_tokens) == (12, 17 + 16)


def test_the_last_token_is_computed_even_when_every_page_is_cached():
    sched, rank = Scheduler(_config()), RankModel(PS)
    prompt = list(range(200, 208))  # exactly 2 pages
    sched.add(_seq(1, prompt, 2))
    _drive(sched, rank, _seeded)
    b = _seq(2, prompt, 2)
    sched.add(b)
    step = sched.schedule()
    c = _first_chunk(step, 2)
    assert (c.start_pos, c.num_tokens, c.sample) == (4, 4, True)  # page 2 holds the last token
    assert b.cached_tokens == 4


def test_choices_of_one_prompt_share_its_pages():
    """n > 1: the choices arrive together; the first computes the prompt, the others wait one
    step for its pages instead of computing them again."""
    sched, rank = Scheduler(_config(max_step_tokens=64)), RankModel(PS)
    prompt = list(range(300, 322))
    seqs = [_seq(i, prompt, 4) for i in (1, 2, 3)]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [1]
    first_sampled = rank.run(first, _seeded)
    second = sched.schedule()
    starts = {c.seq.seq_id: c.start_pos for c in second.chunks if c.is_new}
    assert starts == {2: 20, 3: 20}
    tables = [s.pages[:5] for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    second_sampled = rank.run(second, _seeded)
    sched.apply(first, first_sampled)
    sched.apply(second, second_sampled)
    _drive(sched, rank, _seeded)
    for s in seqs:
        assert s.output_ids == [_seeded(s, 22 + i) for i in range(4)]


def test_a_step_left_out_of_the_plan_leaves_nothing_cached():
    """A sequence whose part of a plan could not be built is aborted: the pages that step would
    have written hold nothing, so nobody may take them."""
    sched, rank = Scheduler(_config()), RankModel(PS)
    prompt = list(range(10, 22))
    a = _seq(1, prompt, 2)
    sched.add(a)
    step = sched.schedule()
    sched.abort(a, left_out_of=step.step_id)
    step.chunks = []  # sent without it
    rank.run(step)
    assert sched.cache.num_pages == 0 and sched.pages_in_use == 0
    b = _seq(2, prompt, 2)
    sched.add(b)
    assert _first_chunk(sched.schedule(), 2).start_pos == 0


def test_idle_cached_pages_are_evicted_least_recently_used():
    sched, rank = Scheduler(_config(num_pages=12)), RankModel(PS)
    old, recent = list(range(1000, 1016)), list(range(2000, 2016))
    for i, prompt in enumerate((old, recent)):
        sched.add(_seq(i + 1, prompt + [i], 1))
        _drive(sched, rank, _seeded)
    assert sched.cache.num_idle == 8 and sched.pages_in_use == 0
    big = _seq(3, list(range(3000, 3024)), 2)  # 7 pages: the 4 free ones, then 3 evicted
    sched.add(big)
    _drive(sched, rank, _seeded)
    again_recent, again_old = _seq(4, recent + [9], 1), _seq(5, old + [9], 1)
    sched.add(again_recent)
    sched.add(again_old)
    _drive(sched, rank, _seeded)
    assert again_recent.cached_tokens == 16
    assert again_old.cached_tokens == 4  # the older prefix lost its last 3 pages


def test_a_constrained_sequence_recomputes_its_output_after_a_preemption():
    """Its rank-side matcher replays recomputed output tokens, so a sequence with a grammar
    takes cached pages of its prompt only (RankModel checks each admission's start)."""
    rng = random.Random(3)
    sched, rank = Scheduler(_config(num_pages=14)), RankModel(PS)
    shared = list(range(40, 48))
    seqs = [_seq(i, shared + [i] * rng.randint(1, 9), 18, grammar=True) for i in range(1, 9)]
    for s in seqs:
        sched.add(s)
    finished, _ = _drive(sched, rank, _seeded, depth=2)
    assert sched.num_preemptions > 0 and sorted(finished) == [s.seq_id for s in seqs]
    for s in seqs:
        assert s.output_ids == [_seeded(s, len(s.prompt_ids) + i) for i in range(18)]


def test_cache_off_shares_nothing():
    sched, rank = Scheduler(_config(prefix_cache=False)), RankModel(PS)
    prompt = list(range(60, 80))
    for i in (1, 2):
        sched.add(_seq(i, prompt, 2))
    starts = []
    while sched.has_work:
        step = sched.schedule()
        starts += [c.start_pos for c in step.chunks if c.is_new]
        sched.apply(step, rank.run(step, _seeded))
    assert starts == [0, 0] and sched.cache is None and len(sched.free_pages) == 64


def _check_accounting(sched: Scheduler) -> None:
    """Every page is exactly one of: free, idle in the cache, or held; a cached page's count of
    holders is exact and an uncached one has one holder."""
    cfg, cache = sched.config, sched.cache
    holders: dict[int, int] = {}
    for seq in sched.running + list(sched.waiting):
        for p in seq.pages:
            holders[p] = holders.get(p, 0) + 1
    free, idle = set(sched.free_pages), set(cache.idle_pages())
    assert len(free) == len(sched.free_pages)
    assert not free & idle and not free & holders.keys() and not idle & holders.keys()
    assert free | idle | holders.keys() == set(range(cfg.num_pages))
    for p, n in holders.items():
        assert n == (cache.refs(p) if cache.is_cached(p) else 1)
    assert all(cache.is_cached(p) and cache.refs(p) == 0 for p in idle)
    assert sched.pages_in_use == len(holders)


@pytest.mark.parametrize("cut", [False, True], ids=["padded", "cut"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_thousand_mixed_requests_keep_exact_accounting_and_tokens(depth, cut, monkeypatch):
    """Shared system prompts, multi-turn conversations that resend their history, n > 1
    choices, aborts and a pool small enough to evict and preempt: every sequence ends with the
    tokens a cache-less run draws, and the pool's accounting is exact at every step. cut: with
    token buckets, and prompt chunks cut to them from 8 tokens up (from 512 in serving)."""
    rng = random.Random(depth)
    buckets = (4, 8, 16, 24) if cut else ()
    if cut:
        monkeypatch.setattr(scheduler, "TRIM_MIN_TOKENS", 8)
    config = _config(num_pages=40, max_batch=12, max_step_tokens=24, token_buckets=buckets)
    sched, rank = Scheduler(config), RankModel(PS)
    systems = [[rng.randrange(5000) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    conversations: list[list[int]] = []
    seq_ids, submitted, in_flight = iter(range(1, 10**6)), [], deque()
    aborted = set()

    def new_requests() -> list[Sequence]:
        kind = rng.random()
        if kind < 0.3 and conversations:  # the next turn resends the conversation
            history = rng.choice(conversations)
            prompt = history + [rng.randrange(5000) for _ in range(rng.randint(1, 6))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(5000) for _ in range(rng.randint(1, 9))]
        n = 3 if kind > 0.9 else 1
        max_tokens = rng.randint(1, 12)
        return [_seq(next(seq_ids), prompt, max_tokens, grammar=kind < 0.05) for _ in range(n)]

    for _ in range(100_000):  # bounded: a wedge fails below instead of hanging
        if len(submitted) >= 1000 and not (sched.has_work or in_flight):
            break
        if len(submitted) < 1000 and rng.random() < 0.5:
            for s in new_requests():
                sched.add(s)
                submitted.append(s)
        if sched.running and rng.random() < 0.02:
            victim = rng.choice(sched.running)
            sched.abort(victim)
            aborted.add(victim.seq_id)
        step = sched.schedule() if len(in_flight) < depth else None
        if step is not None:
            in_flight.append((step, rank.run(step, _seeded)))
        elif in_flight:
            for seq in sched.apply(*in_flight.popleft()):
                if seq.finish_reason and len(conversations) < 200:
                    conversations.append(seq.prompt_ids + seq.output_ids)
            rank.check_tokens(sched)
        _check_accounting(sched)
    assert len(submitted) >= 1000
    for s in submitted:
        assert s.status is Status.FINISHED
        if s.seq_id not in aborted:
            n = len(s.prompt_ids)
            assert s.output_ids == [_seeded(s, n + i) for i in range(s.max_tokens)]
    step = sched.schedule()
    if step is not None:
        rank.run(step)
    assert sched.pages_in_use == 0 and not rank.pages
    assert len(sched.free_pages) + sched.cache.num_idle == 40
    assert sched.num_preemptions > 0 and sched.cache.hit_tokens > 0
