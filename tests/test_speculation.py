"""Speculative decoding in the scheduler: the n-gram proposer, how many proposals a sequence
makes, and verification rows against the rank model of test_scheduler, whose draws here are a
function of the KV context the rank holds (as a model's are), so a kept wrong proposal would
change every later token. Outputs with speculation equal outputs without, token for token."""

from __future__ import annotations

import random

import pytest

from runtime import scheduler
from runtime.sampling import SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig, Sequence
from runtime.speculation import (
    GUESS_MIN_RATE,
    MISSES_TO_PAUSE,
    NgramIndex,
    SpecState,
    SpeculationConfig,
)
from tests.test_scheduler import RankModel, _drive

SPEC = SpeculationConfig(num_tokens=4)


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(range(2, 4))
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    # suffix [5, 6] last occurred ending at 7 (-> 1, 2, 5, 6) and earlier at 2 (-> 7, 8, 9)
    assert index.propose(tokens, 3) == [1, 2, 5]
    # one more token: the suffix [6, 7] matches only at the start
    assert index.propose([7], 4) == [8, 9, 5, 6]
    # the 3-gram [8, 9, 5] beats any 2-gram, and runs out of known tokens
    index = NgramIndex(range(2, 4))
    assert index.propose([8, 9, 5, 1, 9, 5, 3, 8, 9, 5], 4) == [1, 9, 5, 3]
    assert NgramIndex(range(2, 4)).propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert NgramIndex(range(1, 2)).propose([4, 4], 3) == [4]  # only what is known follows


def test_a_sequence_proposes_fewer_when_they_fail_and_pauses_when_none_are_kept():
    state = SpecState(SpeculationConfig(num_tokens=4))
    assert state.k == 4 and state.active
    state.verified(4, 1)
    assert state.k == 4  # some kept: no change
    state.verified(4, 0)
    assert state.k == 2 and state.active
    state.verified(2, 2)
    assert state.k == 3
    for _ in range(MISSES_TO_PAUSE):
        state.verified(1, 0)
    assert not state.active and state.pause == 8
    state.decoded(8)
    assert state.active
    # finding nothing is a miss too, and after a fruitless pause one miss starts the next,
    # twice as long
    assert state.propose([1, 2, 3], limit=4) == []
    assert state.pause == 16
    state.decoded(16)
    state.verified(1, 1)
    assert (state.misses, state.pauses) == (0, 0)


def _config(spec: SpeculationConfig | None, **kw) -> SchedulerConfig:
    base = {
        "num_pages": 64,
        "page_size": 4,
        "max_batch": 8,
        "max_step_tokens": 32,
        "max_seq_len": 160,
    }
    return SchedulerConfig(**{**base, **kw}, speculation=spec)


def _context_model(rank: RankModel):
    """A deterministic 'model': the token at a position is drawn from the tokens whose KV the
    rank holds before it. It mostly repeats what came 6 tokens earlier (so n-grams match and
    proposals are kept) and now and then breaks the pattern (so some are rejected)."""

    def draw(seq: Sequence, position: int) -> int:
        ctx = rank.read(seq.seq_id, position)
        assert None not in ctx, "a draw read KV that was never written"
        return _next_token(ctx)

    return draw


def _next_token(ctx: list[int]) -> int:
    """The context model's token after ctx (the tokens at every earlier position)."""
    position = len(ctx)
    h = (sum(ctx[-5:]) * 2654435761 + position) % 97
    if position < 6 or h < 12:
        return 200 + h
    return ctx[-6]


def _run(
    spec, prompts, max_tokens, depth=2, stop=frozenset(), aborts=None, guess_min_rate=None, **kw
):
    """Drive the prompts to their ends; aborts: seq_id -> the step count at which it is
    cancelled, as a client disconnect does; guess_min_rate: the rate of right guesses a lone
    sequence must beat (the engine core sets it as it measures)."""
    sched = Scheduler(_config(spec, **kw))
    if guess_min_rate is not None:
        sched.guess_min_rate = guess_min_rate
    rank = RankModel(sched.config.page_size)
    seqs = [
        Sequence(i + 1, list(p), m, SamplingParams(), stop_token_ids=frozenset(stop))
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for s in seqs:
        sched.add(s)

    def cancel(steps: int) -> None:
        for s in seqs:
            if aborts.get(s.seq_id) == steps:
                sched.abort(s)  # (a no-op for one already finished)

    _, steps = _drive(sched, rank, _context_model(rank), depth, before=cancel if aborts else None)
    assert not sched.has_work and all(s.finish_reason for s in seqs)
    return [(s.output_ids, s.finish_reason) for s in seqs], sched, steps


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 60) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_with_speculation_equal_outputs_without(depth):
    prompts = _prompts(6)
    max_tokens = [40, 17, 33, 5, 60, 23]  # several end inside what a verification would add
    without, _, steps_off = _run(None, prompts, max_tokens, depth)
    with_spec, sched, steps_on = _run(SPEC, prompts, max_tokens, depth)
    assert with_spec == without
    assert all(reason == "length" for _, reason in with_spec)
    assert [len(out) for out, _ in with_spec] == max_tokens
    assert sched.spec_kept > 0 and sched.spec_proposed > sched.spec_kept  # kept and rejected
    assert steps_on < steps_off


def test_a_stop_token_inside_a_kept_run_ends_the_sequence_there():
    prompts = _prompts(4, seed=3)
    without, _, _ = _run(None, prompts, [50] * 4)
    # a token every output repeats somewhere after its start, so speculation likely keeps it
    stop = {without[0][0][30]}
    without, _, _ = _run(None, prompts, [50] * 4, stop=stop)
    with_spec, sched, _ = _run(SPEC, prompts, [50] * 4, stop=stop)
    assert with_spec == without
    assert any(reason == "stop" for _, reason in with_spec)
    assert sched.spec_kept > 0


def test_preemption_and_a_small_pool_keep_outputs_exact():
    prompts = _prompts(8, seed=5)
    max_tokens = [45] * 8
    kw = {"num_pages": 40, "max_batch": 6, "max_step_tokens": 24}
    without, _, _ = _run(None, prompts, max_tokens, **kw)
    with_spec, sched, _ = _run(SPEC, prompts, max_tokens, **kw)
    assert with_spec == without
    assert sched.num_preemptions > 0 and sched.spec_kept > 0
    assert sched.pages_in_use == 0  # every page came back, surplus pages of rejections too


def test_a_verification_never_passes_the_step_limits():
    sched = Scheduler(_config(SpeculationConfig(num_tokens=16), max_batch=4, max_step_tokens=12))
    rank = RankModel(4)
    draw = _context_model(rank)
    for i, p in enumerate(_prompts(4, seed=7)):
        sched.add(Sequence(i + 1, p, 40, SamplingParams()))
    verified = 0
    while sched.has_work:
        step = sched.schedule()
        assert sum(c.num_tokens for c in step.chunks) <= 12
        assert sum(c.num_samples for c in step.chunks) <= 4  # sampling rows
        for c in step.chunks:
            assert c.start_pos + c.num_tokens <= 160
            if c.proposals:
                verified += 1
                assert len(c.seq.output_ids) + len(c.proposals) + 1 <= c.seq.max_tokens
        sched.apply(step, rank.run(step, draw))
        rank.check_tokens(sched)
    assert verified > 0


def _decode_step_rows(steps: list) -> list[int]:
    """Rows of each planned step made only of decode and verification rows (the steps the
    ranks run through their decode graphs)."""
    return [
        sum(c.num_tokens for c in step.chunks)
        for step in steps
        if all(c.sample and c.num_tokens == c.num_samples for c in step.chunks)
    ]


@pytest.mark.parametrize("exact_rows", [0, 12])
def test_exact_rows_cap_what_a_step_of_decode_and_verification_rows_holds(exact_rows):
    """With the ranks' exact graphs (SchedulerConfig.exact_rows, --exact-verification) the
    proposals of sequences decoding together are cut so that such a step never holds more
    rows than the graphs (where each row is computed as alone); without, it may (the
    control), and either way the outputs are those without speculation."""
    prompts, max_tokens = _prompts(4, seed=11), [60] * 4
    kw = {"max_batch": 64, "max_step_tokens": 128, "exact_rows": exact_rows}
    without, _, _ = _run(None, prompts, max_tokens, **kw)
    sched = Scheduler(_config(SpeculationConfig(num_tokens=16), **kw))
    planned = []
    original = sched.schedule

    def schedule():
        step = original()
        planned.append(step)
        return step

    sched.schedule = schedule
    rank = RankModel(sched.config.page_size)
    seqs = [
        Sequence(i + 1, list(p), m, SamplingParams())
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for s in seqs:
        sched.add(s)
    _drive(sched, rank, _context_model(rank), 2)
    assert [(s.output_ids, s.finish_reason) for s in seqs] == without
    assert sched.spec_kept > 0
    rows = _decode_step_rows([s for s in planned if s is not None])
    if exact_rows:
        assert max(rows) <= exact_rows
    else:
        assert max(rows) > 12


def test_a_sequence_whose_proposals_fail_pauses_and_is_planned_ahead_again():
    # Draws from 5 tokens at random: n-grams match often, and their proposals mostly fail.
    def draw(seq, pos):
        return 10 + random.Random(pos).randrange(5)

    sched = Scheduler(_config(SPEC, max_seq_len=256, num_pages=80))
    rank = RankModel(4)
    seq = Sequence(1, [10, 11, 12, 13, 14, 10, 11], 200, SamplingParams())
    sched.add(seq)
    decodes = ahead = 0
    in_flight = []
    while sched.has_work or in_flight:
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            in_flight.append((step, rank.run(step, draw)))
            for c in step.chunks:
                decodes += c.start_pos >= len(c.seq.prompt_ids)
                ahead += c.follows_sample
            continue
        sched.apply(*in_flight.pop(0))
    assert seq.output_ids == [draw(seq, p) for p in range(7, 207)]
    assert 0 < sched.spec_kept < sched.spec_proposed / 2
    assert ahead > decodes / 2  # most of its steps were planned ahead, without proposals


def test_prefix_cache_and_speculation_together_keep_outputs_exact():
    shared = _prompts(1, seed=9)[0] * 2
    prompts = [shared + [i] for i in range(5)] * 2
    without, _, _ = _run(None, prompts, [30] * 10, prefix_cache=False)
    with_spec, sched, _ = _run(SPEC, prompts, [30] * 10)
    assert with_spec == without
    assert sched.cache.hit_tokens > 0 and sched.spec_kept > 0


def test_a_sequence_that_cannot_match_is_planned_ahead_from_its_first_decode():
    # Tokens that never repeat: no n-gram can match, so it never waits for its last token.
    sched = Scheduler(_config(SPEC))
    rank = RankModel(4)
    seq = Sequence(1, list(range(10, 20)), 30, SamplingParams())
    sched.add(seq)
    rows = []
    in_flight = []
    while sched.has_work or in_flight:
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            in_flight.append((step, rank.run(step, lambda s, pos: 1000 + pos)))
            rows += [c.follows_sample for c in step.chunks if c.start_pos >= 10]
            continue
        sched.apply(*in_flight.pop(0))
    assert seq.output_ids == [1000 + p for p in range(10, 40)]
    assert rows and all(rows)  # every decode was planned ahead
    assert sched.spec_verifications == 0 and seq.spec.misses == 0 and sched.spec_waits == 0
    assert NgramIndex(range(2, 4)).may_follow() is False
    index = NgramIndex(range(2, 4))
    index.extend([1, 2, 3, 1])
    assert not index.may_follow()  # a token seen before, but its tail [3, 1] never occurred
    index.extend([2])
    assert index.may_follow()  # the tail [1, 2] occurred, followed by 3: it may go on so
    index.extend([5])
    assert not index.may_follow()


def test_verification_rows_chain_two_steps_in_flight_and_a_wrong_guess_voids_its_row():
    """With two steps in flight, a sequence's next verification row goes out before the
    result of the one in flight, its first token guessing that row's last draw; a row whose
    guess (or whose predecessor's proposals) failed is void, and the outputs stay exact."""
    prompts = _prompts(3, seed=11)
    without, _, _ = _run(None, prompts, [60] * 3, depth=2)
    sched = Scheduler(_config(SPEC))
    rank = RankModel(4)
    draw = _context_model(rank)
    seqs = [Sequence(i + 1, p, 60, SamplingParams()) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    chained, in_flight = [], []
    while sched.has_work or in_flight:
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            chained += [c for c in step.chunks if c.guess is not None]
            assert all(len(c.proposals) <= SPEC.num_tokens for c in step.chunks)
            in_flight.append((step, rank.run(step, draw)))
            continue
        sched.apply(*in_flight.pop(0))
        rank.check_tokens(sched)
    assert [(s.output_ids, s.finish_reason) for s in seqs] == without
    void = [c for c in chained if c.void]
    assert chained and void and len(void) < len(chained)


def test_the_scheduler_benchmark_compares_both_modes():
    from benchmarks.speculation import main

    report = main(["schedule", "--users", "8", "--prompt-tokens", "40", "--new-tokens", "24"])
    for mode in ("off", "ngram"):
        assert report[mode]["steps"] >= 24 and report[mode]["schedule_ms_per_step"] > 0
    assert report["off"]["verifications"] == 0


def test_the_replay_benchmark_counts_what_the_proposer_keeps():
    """benchmarks.speculation's replay over an output that copies its prompt: with k fixed,
    once its tail repeats the prompt (after the first decode step), every step is a row
    chained behind the one in flight, its guess right and its k proposals kept; with adaptive
    k and an output that never repeats, nothing is guessed or proposed."""
    from benchmarks.speculation import replay

    prompt = list(range(100, 160))
    fixed = replay(SpeculationConfig(num_tokens=4, ngram_min=1, adaptive=False), prompt, prompt)
    # 59 tokens: one plain step (the prompt's last token never occurred before), then 11 x 5, 3
    assert fixed["rows"] == fixed["guesses"] == fixed["steps"] - 1 == 12 and fixed["void"] == 0
    assert fixed["kept"] == fixed["proposed"] == 4 * 11 + 2
    fresh = list(range(1000, 1200))
    adaptive = replay(SpeculationConfig(num_tokens=4), prompt, fresh)
    assert adaptive["rows"] == adaptive["proposed"] == 0
    assert adaptive["steps"] == len(fresh) - 1 and adaptive["guesses"] == adaptive["void"] == 0


def _run_draft(prompts, max_tokens, propose):
    """The scheduler with the draft proposer over the context model: propose(tokens, k) gives
    the draft tokens after a row's known tokens (what rank 0 would send back). Returns
    (outputs, scheduler, number of rows that asked for drafts)."""
    spec = SpeculationConfig("draft", num_tokens=4)
    sched = Scheduler(_config(spec, max_batch=32, num_pages=256))
    rank = RankModel(sched.config.page_size)
    draw = _context_model(rank)
    seqs = [
        Sequence(i + 1, list(p), m, SamplingParams())
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for s in seqs:
        sched.add(s)
    asked, in_flight = 0, []
    while sched.has_work or in_flight:
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            asking = [c for c in step.chunks if c.draft]
            asked += len(asking)
            in_flight.append((step, rank.run(step, draw), asking))
            continue
        step, sampled, asking = in_flight.pop(0)
        drafted = {c.seq.seq_id: propose(_known_after(c, sampled), c.draft) for c in asking}
        sched.apply(step, sampled, drafted)
        rank.check_tokens(sched)
    return [s.output_ids for s in seqs], sched, asked


def _known_after(c, sampled) -> list[int]:
    """The tokens of c's sequence once c's draws are applied: what rank 0 drafts after."""
    seq, drawn = c.seq, sampled[c.seq.seq_id]
    kept = 0
    if c.proposals:
        while kept < len(c.proposals) and c.proposals[kept] == drawn[kept]:
            kept += 1
        new = c.proposals[:kept] + [drawn[kept]]
    else:
        new = [drawn]
    return seq.tokens(0, seq.num_tokens) + new


def _perfect_draft(tokens: list[int], k: int) -> list[int]:
    out = []
    for _ in range(k):
        out.append(_next_token(tokens + out))
    return out


def test_a_draft_that_keeps_failing_is_gated_for_every_sequence():
    """Proposals that are never kept: outputs as without speculation; each sequence alone would
    try MISSES_TO_PAUSE times before its first pause, but once the draft's average acceptance
    is below DRAFT_MIN_RATE no sequence asks for a while, then a few rows probe again."""
    from runtime.scheduler import DRAFT_RATE_ROWS

    prompts, max_tokens = _prompts(24, seed=5), [80] * 24
    without, _, _ = _run(None, prompts, max_tokens, max_batch=32, num_pages=256)
    outputs, sched, asked = _run_draft(prompts, max_tokens, lambda tokens, k: [999] * k)
    assert outputs == [out for out, _ in without]
    assert sched.spec_kept == 0 and sched.spec_verifications >= DRAFT_RATE_ROWS
    assert sched.draft_gate_until > 0  # the gate closed, and reopened to probe
    assert asked < len(prompts) * MISSES_TO_PAUSE


def test_a_draft_that_is_right_is_never_gated():
    """A draft that proposes what the context model will draw: every proposal is kept, each
    row brings k + 1 tokens, and the gate stays open."""
    prompts, max_tokens = _prompts(8, seed=6), [60] * 8
    without, _, _ = _run(None, prompts, max_tokens, max_batch=32, num_pages=256)
    outputs, sched, asked = _run_draft(prompts, max_tokens, _perfect_draft)
    assert outputs == [out for out, _ in without]
    assert sched.spec_kept == sched.spec_proposed > 0
    assert sched.draft_gate_until == 0 and asked > 0


def test_a_repeating_tail_with_no_plain_row_in_flight_waits_and_is_counted():
    """Right after its prefill a sequence whose prompt ends by repeating itself has no plain
    row to chain a guess behind: its first decode waits one step for the first token, to
    propose after it, and the scheduler counts the wait (orbit_spec_waits_total)."""
    sched = Scheduler(_config(SPEC))
    rank = RankModel(4)
    seq = Sequence(1, [7, 8, 9, 5, 7, 8], 6, SamplingParams())
    sched.add(seq)
    prefill = sched.schedule()
    assert sched.schedule() is None and sched.spec_waits == 1  # held back, counted
    sched.apply(prefill, rank.run(prefill, lambda s, pos: 9))
    step = sched.schedule()
    assert step.chunks[0].proposals == [5, 7, 8, 9]  # after the first token, 9: [7, 8, 9] again
    assert sched.spec_waits == 1


def _mostly_repeating(seq, pos: int) -> int:
    """10, 11, 12 repeating (as the prompts of these tests start), broken every 11th token."""
    return 300 + pos if pos % 11 == 0 else 10 + pos % 3


def test_a_repeating_tail_chains_a_guess_behind_its_plain_row_instead_of_waiting():
    """A decode whose tail repeats earlier text while its plain row in flight draws its next
    token is not held back: a row chained behind that one guesses the draw (what followed the
    tail before) and proposes after it. A right guess keeps both steps in flight, a wrong one
    voids the row, and the output is exact either way; once its guesses are too often wrong the
    sequence waits for the token instead."""

    sched = Scheduler(_config(SPEC))
    rank = RankModel(4)
    seq = Sequence(1, list(range(10, 20)), 60, SamplingParams())
    sched.add(seq)
    behind_plain, in_flight = [], []
    while sched.has_work or in_flight:
        plain = seq.pending == 1 and not seq.verifying
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            behind_plain += [c for c in step.chunks if c.guess is not None and plain]
            in_flight.append((step, rank.run(step, _mostly_repeating)))
            continue
        sched.apply(*in_flight.pop(0))
        rank.check_tokens(sched)
    assert seq.output_ids == [_mostly_repeating(seq, p) for p in range(10, 70)]
    void = [c for c in behind_plain if c.void]
    assert behind_plain and void and len(void) < len(behind_plain)
    assert sched.spec_kept > len(behind_plain) - len(void)  # proposals kept after right guesses
    assert sched.spec_waits > 0 and seq.spec.guess_rate < sched.guess_min_rate


def test_a_sequence_guesses_ahead_while_its_guesses_are_right_often_enough():
    state = SpecState(SPEC)
    assert state.guess_rate == 1.0
    state.guessed(False)
    assert state.guess_rate >= GUESS_MIN_RATE  # one wrong guess in a run of right ones
    state.guessed(False)
    assert state.guess_rate < GUESS_MIN_RATE  # alone, it waits now (its guesses still scored)
    rights = 0
    while state.guess_rate < GUESS_MIN_RATE:
        state.guessed(True)
        rights += 1
    assert rights == 4


def test_sequences_decoding_together_guess_whatever_their_rate():
    """With other sequences in the step a wait costs a sequence that step, as a wrong guess
    does, so sequences decoding together guess even when their guesses have been poor; the
    one left alone waits."""

    sched = Scheduler(_config(SPEC))
    rank = RankModel(4)
    seqs = [
        Sequence(i + 1, list(range(10, 20)), m, SamplingParams()) for i, m in ((0, 30), (1, 60))
    ]
    for seq in seqs:
        sched.add(seq)
    guessed_together = waits_together = 0
    in_flight = []
    while sched.has_work or in_flight:
        for seq in seqs:
            seq.spec.guess_rate = 0.0  # as if every guess so far had been wrong
        together = len(sched.running) == 2
        plain = {s.seq_id for s in seqs if s.pending == 1 and not s.verifying}
        waits = sched.spec_waits
        step = sched.schedule() if len(in_flight) < 2 else None
        if step is not None:
            if together:
                guessed_together += sum(
                    c.guess is not None and c.seq.seq_id in plain for c in step.chunks
                )
                waits_together += sched.spec_waits - waits
            in_flight.append((step, rank.run(step, _mostly_repeating)))
            continue
        sched.apply(*in_flight.pop(0))
    assert [s.output_ids for s in seqs] == [
        [_mostly_repeating(s, p) for p in range(10, 10 + s.max_tokens)] for s in seqs
    ]
    assert guessed_together > 0 and waits_together == 0
    assert sched.spec_waits > 0  # the longer one, alone at the end


@pytest.mark.parametrize("cut", [False, True], ids=["padded", "cut"])
@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_keep_outputs_exact_and_return_every_page(seed, cut, monkeypatch):
    """The cases above at random and together: proposal depth and n-gram sizes, one or two
    steps in flight, pools and step budgets small enough to preempt, shared prefixes (the
    cache), stop tokens, cancellations, and whether a lone sequence guesses. Every sequence
    not cancelled ends as it does without speculation, and every page comes back. cut: with
    power-of-two token buckets, and prompt chunks cut to them from 4 tokens up (from 512 in
    serving; these budgets are small)."""
    if cut:
        monkeypatch.setattr(scheduler, "TRIM_MIN_TOKENS", 4)
    rng = random.Random(seed)
    ngram_min = rng.randint(1, 3)
    spec = SpeculationConfig(
        num_tokens=rng.choice([1, 2, 4, 8, 16]),
        ngram_min=ngram_min,
        ngram_max=rng.randint(ngram_min, 4),
    )
    n = rng.randint(1, 8)
    shared = _prompts(1, seed=1000 + seed)[0]
    prompts = [(shared if rng.random() < 0.5 else []) + p for p in _prompts(n, seed=seed)]
    max_tokens = [rng.randint(1, 80) for _ in range(n)]
    stop = {200 + rng.randrange(12)} if rng.random() < 0.3 else set()
    page_size = rng.choice([2, 4, 16])
    kw = {
        "page_size": page_size,
        "num_pages": rng.choice([48, 64, 256]) * 4 // page_size,
        "max_batch": rng.randint(1, 8),
        "max_step_tokens": rng.choice([8, 24, 32, 64]),
        "max_seq_len": 192,
    }
    if cut:
        budget = kw["max_step_tokens"]
        kw["token_buckets"] = (*(b for b in (2, 4, 8, 16, 32) if b < budget), budget)
    depth = rng.choice([1, 2])
    aborts = {i + 1: rng.randrange(60) for i in range(n) if rng.random() < 0.2}
    rate = rng.choice([0.0, GUESS_MIN_RATE, 1.01])
    without, _, _ = _run(None, prompts, max_tokens, depth, stop, **kw)
    with_spec, sched, _ = _run(spec, prompts, max_tokens, depth, stop, aborts, rate, **kw)
    for off, on in zip(without, with_spec):
        if on[1] != "abort":
            assert on == off
        else:  # what it had produced when cancelled is what it produces uncancelled
            assert on[0] == off[0][: len(on[0])]
    assert sched.pages_in_use == 0
    assert sched.spec_kept <= sched.spec_proposed
