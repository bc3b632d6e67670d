"""The scheduler on its own: fed hand-made sampled tokens, checked for the plans it builds."""

from __future__ import annotations

import random
from collections import deque

import pytest

from runtime.sampling import SamplingParams
from runtime.scheduler import CapacityError, Scheduler, SchedulerConfig, Sequence, Status
from runtime.spec import token_bucket


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
    """What the ranks hold: page tables built only from the plans' deltas, the KV pages
    themselves (the token whose KV each slot holds), and the last token sampled per sequence
    (what follows_sample feeds). Checks that plans are consistent and complete: a chunk
    continues where its sequence's KV ends, reads a context whose every page holds that
    sequence's tokens (its own or a prefix cached by another), and never writes a page that
    another live sequence's table holds. Steps run when they are sent, as ranks run them."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.pages: dict[int, list[int]] = {}
        self.kv_len: dict[int, int] = {}  # positions computed, per sequence
        self.slots: dict[int, dict[int, int]] = {}  # page -> slot -> token whose KV is there
        self.last_token: dict[int, int] = {}
        self.verified_from: dict[int, int] = {}  # seq -> start of its last verification row

    def run(self, step, next_token=lambda seq, pos: 0) -> dict[int, int]:
        """Execute a step; next_token(seq, position) is the token the model draws there.
        Returns what rank 0 would report: seq_id -> sampled token."""
        for seq_id in step.released:
            self.pages.pop(seq_id, None)
            self.kv_len.pop(seq_id, None)
            self.last_token.pop(seq_id, None)
            self.verified_from.pop(seq_id, None)
        sampled = {}
        for c in step.chunks:
            sid = c.seq.seq_id
            if c.is_new:
                assert sid not in self.pages
                self.pages[sid], self.kv_len[sid] = [], c.start_pos  # a cached prefix or none
                assert c.start_pos % self.page_size == 0
                # Its matcher replays recomputed output: a grammar's output is never cached.
                assert not c.seq.has_grammar or c.start_pos <= len(c.seq.prompt_ids)
            elif sid in self.verified_from:  # its KV after the kept proposals is left behind
                start = self.verified_from[sid]
                assert start < c.start_pos <= self.kv_len[sid], "a verification's tokens lost"
                if not c.verifies:
                    del self.verified_from[sid]
            else:
                assert c.start_pos == self.kv_len[sid], "a chunk must continue where its KV ends"
            self.pages[sid].extend(c.new_pages)
            holders = {}
            for seq_id, pages in self.pages.items():
                for p in pages:
                    holders[p] = holders.get(p, 0) + 1
            table = self.pages[sid]
            needed = -(-(c.start_pos + c.num_tokens) // self.page_size)
            assert len(table) >= needed, "tokens written past the page table"
            for i, token in enumerate(self._inputs(c)):
                page, slot = divmod(c.start_pos + i, self.page_size)
                assert holders[table[page]] == 1, "a shared page is written"
                self.slots.setdefault(table[page], {})[slot] = token
            self.kv_len[sid] = c.start_pos + c.num_tokens
            known = min(self.kv_len[sid], c.seq.num_tokens)
            assert self.read(sid, known) == c.seq.tokens(0, known), "the context's KV is wrong"
            if c.sample and c.verifies:  # a draw after each of its tokens, in position order
                end = self.kv_len[sid]
                draws = [next_token(c.seq, p) for p in range(end - len(c.proposals), end + 1)]
                sampled[sid], self.last_token[sid] = draws, draws[-1]
                # (a row whose first token guesses a plain row's draw may be rolled back to
                # its start: the guess is not a known token)
                self.verified_from.setdefault(sid, c.start_pos - (c.guess is not None))
            elif c.sample:
                sampled[sid] = self.last_token[sid] = next_token(c.seq, self.kv_len[sid])
        return sampled

    def read(self, seq_id: int, n: int) -> list[int]:
        """The tokens whose KV seq_id's first n positions hold, through its page table."""
        ps, table = self.page_size, self.pages[seq_id]
        return [self.slots.get(table[i // ps], {}).get(i % ps) for i in range(n)]

    def _inputs(self, c) -> list[int]:
        if not c.follows_sample:
            return c.token_ids
        assert c.token_ids == [] and c.num_tokens == 1
        return [self.last_token[c.seq.seq_id]]

    def check_tokens(self, sched: Scheduler) -> None:
        """The KV of every running sequence holds its tokens as the scheduler knows them."""
        for seq in sched.running:
            # (beyond num_computed lies the KV of rejected proposals, left to be overwritten)
            n = min(self.kv_len[seq.seq_id], seq.num_computed, seq.num_tokens)
            assert self.read(seq.seq_id, n) == seq.tokens(0, n)


def _drive(
    sched: Scheduler, rank: RankModel, next_token, depth: int = 1, max_steps=10_000, before=None
):
    """Run to completion with up to `depth` steps in flight, as the engine does; before(n), if
    given, runs before each turn of the loop with the number of steps sent so far (to cancel
    sequences on the way, as clients do)."""
    finished, steps, in_flight = {}, 0, deque()
    while steps < max_steps:
        if before is not None:
            before(steps)
        if not (sched.has_work or in_flight):
            break
        step = sched.schedule() if len(in_flight) < depth else None
        if step is not None:
            assert len(step.chunks) <= sched.config.max_batch
            assert sum(c.num_tokens for c in step.chunks) <= sched.config.max_step_tokens
            in_flight.append((step, rank.run(step, next_token)))
            steps += 1
            continue
        assert in_flight, "work left but nothing to schedule"
        for seq in sched.apply(*in_flight.popleft()):
            if seq.finish_reason:
                finished[seq.seq_id] = seq
        rank.check_tokens(sched)
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


def _seeded(seq: Sequence, position: int) -> int:
    """The token drawn at `position`, a function of the request and position as seeded
    sampling is (so a recomputed sequence draws the same tokens)."""
    return (sum(seq.prompt_ids) + 31 * position) % 997


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_request_finishes_with_its_exact_tokens_under_pressure(depth):
    rng = random.Random(0)
    sched = Scheduler(_config(num_pages=24))
    rank = RankModel(4)
    seqs = [_seq(i, rng.randint(1, 40), rng.randint(1, 30)) for i in range(1, 21)]
    for s in seqs:
        sched.add(s)
    finished, _ = _drive(sched, rank, _seeded, depth)
    assert sorted(finished) == [s.seq_id for s in seqs]
    for s in seqs:
        assert s.finish_reason == "length" and len(s.output_ids) == s.max_tokens
        n = len(s.prompt_ids)
        assert s.output_ids == [_seeded(s, n + i) for i in range(s.max_tokens)]
    assert sched.num_preemptions > 0
    assert sched.pages_in_use == 0 and not sched.running


@pytest.mark.parametrize("depth", [1, 2])
def test_stop_token_finishes_and_frees(depth):
    sched = Scheduler(_config())
    seq = _seq(1, 5, 100, stop={2})
    sched.add(seq)
    tokens, drawn, rank = iter([5, 6, 2, 9]), [], RankModel(4)

    def draw(seq, position):
        drawn.append(next(tokens))
        return drawn[-1]

    finished, _ = _drive(sched, rank, draw, depth)
    assert finished[1].finish_reason == "stop" and seq.output_ids == [5, 6, 2]
    assert drawn == [5, 6, 2, 9][: 2 + depth]  # one step ahead: one wasted row, its 9 dropped
    assert sched.pages_in_use == 0
    if depth == 1:
        step = sched.schedule()
        assert step.released == [1] and not step.chunks
        rank.run(step)
    assert sched.schedule() is None and not rank.pages  # (with a step ahead, sent in the loop)


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


# ---- planning one step ahead: the next step is scheduled before the last one is applied ----
def _shape(step) -> list[tuple]:
    return [
        (c.seq.seq_id, c.start_pos, c.num_tokens, c.token_ids, c.sample, c.follows_sample)
        for c in step.chunks
    ]


def test_decode_ahead_follows_the_sample_in_flight():
    sched = Scheduler(_config())
    seq = _seq(1, 5, 10)
    sched.add(seq)
    first = sched.schedule()
    assert _shape(first) == [(1, 0, 5, list(range(100, 105)), True, False)]
    ahead = sched.schedule()  # before the first step's sample is known
    assert _shape(ahead) == [(1, 5, 1, [], True, True)]
    assert seq.pending == 2 and seq.num_computed == 6
    sched.apply(first, {1: 7})
    third = sched.schedule()
    assert _shape(third) == [(1, 6, 1, [], True, True)]
    sched.apply(ahead, {1: 8})
    sched.apply(third, {1: 9})
    assert seq.output_ids == [7, 8, 9] and seq.pending == 0
    assert _shape(sched.schedule()) == [(1, 7, 1, [9], True, False)]  # nothing in flight


def test_no_step_ahead_for_a_sequence_that_its_pending_token_ends():
    sched = Scheduler(_config(prefix_cache=False))  # the same prompt twice: no waiting for it
    one, two = _seq(1, 5, 1), _seq(2, 5, 2)
    sched.add(one)
    sched.add(two)
    first = sched.schedule()
    ahead = sched.schedule()
    assert [c.seq.seq_id for c in ahead.chunks] == [2]  # seq 1's pending token is its last
    sched.apply(first, {1: 7, 2: 7})
    assert one.finish_reason == "length"
    step = sched.schedule()
    assert step.released == [1] and not step.chunks  # seq 2 too is done once `ahead` applies
    sched.apply(step, {})
    sched.apply(ahead, {2: 8})
    assert two.finish_reason == "length" and two.output_ids == [7, 8]


def test_eos_while_the_next_step_is_in_flight_wastes_one_row():
    sched = Scheduler(_config(num_pages=3, page_size=4))
    rank = RankModel(4)
    a, b = _seq(1, 4, 4, stop={2}), _seq(2, 9, 3)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [c.seq.seq_id for c in first.chunks] == [1]  # b waits for pages
    first_sampled = rank.run(first, lambda s, pos: 2)  # EOS
    ahead = sched.schedule()
    assert _shape(ahead) == [(1, 4, 1, [], True, True)]  # a's EOS is not known yet
    ahead_sampled = rank.run(ahead, lambda s, pos: 5)
    assert sched.apply(first, first_sampled) == [a]
    assert a.finish_reason == "stop" and a.output_ids == [2] and sched.pages_in_use == 0
    nxt = sched.schedule()  # a's pages go to b while `ahead` still writes them: ranks run in order
    assert nxt.released == [1] and [c.seq.seq_id for c in nxt.chunks] == [2]
    assert sorted(nxt.chunks[0].new_pages) == [0, 1, 2]
    rank.run(nxt)
    assert sched.apply(ahead, ahead_sampled) == []  # the wasted row's sample is dropped
    assert a.output_ids == [2]


def test_preemption_while_a_step_is_in_flight_discards_its_stale_sample():
    # Three pages of four tokens: a and b fill two; a's decode at position 4 takes the third,
    # b's then preempts b itself, which is re-admitted in the same step with a fresh prefill.
    sched = Scheduler(_config(num_pages=3, page_size=4))
    rank = RankModel(4)
    a, b = _seq(1, 4, 3), _seq(2, 4, 3)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    first_sampled = rank.run(first, _seeded)
    ahead = sched.schedule()
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert ahead.released == [2]
    assert _shape(ahead) == [
        (1, 4, 1, [], True, True),
        (2, 0, 4, list(range(100, 104)), True, False),
    ]
    assert ahead.chunks[1].is_new
    ahead_sampled = rank.run(ahead, _seeded)
    assert sched.apply(first, first_sampled) == [a]  # b's sample is from before its preemption
    assert b.output_ids == [] and b.pending == 1
    assert sched.apply(ahead, ahead_sampled) == [a, b]
    assert b.output_ids == [_seeded(b, 4)]  # the same token, drawn again at the same position
    finished, _ = _drive(sched, rank, _seeded, depth=2)
    assert sorted(finished) == [1, 2]
    assert a.output_ids == b.output_ids == [_seeded(a, p) for p in (4, 5, 6)]


def test_abort_while_in_flight_drops_the_results():
    sched = Scheduler(_config())
    a, b = _seq(1, 4, 10), _seq(2, 4, 10)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    ahead = sched.schedule()
    sched.abort(a)
    assert sched.pages_in_use == len(b.pages)
    assert sched.apply(first, {1: 7, 2: 8}) == [b]
    step = sched.schedule()
    assert step.released == [1] and [c.seq.seq_id for c in step.chunks] == [2]
    assert sched.apply(ahead, {1: 7, 2: 9}) == [b]
    assert a.output_ids == [] and a.finish_reason == "abort"
    assert b.output_ids == [8, 9]


def test_a_sequence_not_planned_ahead_still_holds_its_batch_slot():
    sched = Scheduler(_config(max_batch=2))
    done, going, waiting = _seq(1, 4, 1), _seq(2, 4, 5), _seq(3, 4, 5)
    for s in (done, going, waiting):
        sched.add(s)
    first = sched.schedule()
    ahead = sched.schedule()  # seq 1 ends with its pending token; seq 3 must still wait
    assert [c.seq.seq_id for c in ahead.chunks] == [2] and waiting.status is Status.WAITING
    sched.apply(first, {1: 7, 2: 7})
    step = sched.schedule()
    assert step.released == [1] and [c.seq.seq_id for c in step.chunks] == [2, 3]


# ---- prompt chunks cut to end on a token bucket ----------------------------------------------
POW2 = (16, 32, 64, 128, 256, 512, 1024, 2048)


def _gpu_config(**kw) -> SchedulerConfig:
    """A package's scale: 16-token pages, a 2,048-token step, its power-of-two buckets."""
    base = {
        "num_pages": 4096, "page_size": 16, "max_batch": 256, "max_step_tokens": 2048,
        "max_seq_len": 4096, "token_buckets": POW2,
    }  # fmt: skip
    return SchedulerConfig(**{**base, **kw})


def _own(seq: Sequence) -> Sequence:
    """seq with a prompt of its own: none of it in another's cached pages."""
    seq.prompt_ids = [t + 2000 * seq.seq_id for t in seq.prompt_ids]
    return seq


def _prompt_chunks(step) -> list[int]:
    return [c.num_tokens for c in step.chunks if c.num_tokens > 1 or not c.seq.output_ids]


@pytest.mark.parametrize(
    ("buckets", "prompts", "first", "second"),
    [
        # 600 tokens would replay 1,024 rows: 512 now and 88 next step
        (POW2, [600], [512], [88]),
        # two prompts, 700 together: the second is cut
        (POW2, [400, 300], [400, 112], [188]),
        # 1,600 of 2,048: cutting 576 tokens to spare 448 padding rows does not pay
        (POW2, [1600], [1600], None),
        # 300 tokens: under TRIM_MIN_TOKENS a step costs about its weights' read, padded or not
        (POW2, [300], [300], None),
        # a full step has no padding
        (POW2, [3000], [2048], [952]),
        # denser buckets: 1,100 would replay 1,280 rows; cut to 1,024, 76 wait
        ((*POW2[:7], 1280, 1536, 1792, 2048), [1100], [1024], [76]),
        # no buckets (a package read without them): nothing is cut
        ((), [600], [600], None),
    ],
)
def test_prompt_chunks_end_on_a_bucket_when_that_spares_padding(buckets, prompts, first, second):
    sched = Scheduler(_gpu_config(token_buckets=buckets))
    for i, n in enumerate(prompts, 1):
        sched.add(_own(_seq(i, n, 4)))
    step = sched.schedule()
    assert _prompt_chunks(step) == first
    sched.apply(step, {c.seq.seq_id: 7 for c in step.sampling_chunks})
    step = sched.schedule()
    assert step.prompt_tokens == sum(second or [])
    if second is not None:
        assert _prompt_chunks(step) == second


def test_a_cut_leaves_the_decode_rows_whole_and_fills_its_bucket():
    sched = Scheduler(_gpu_config())
    decoding = [_own(_seq(i, 8, 50)) for i in range(1, 101)]
    for s in decoding:
        sched.add(s)
    step = sched.schedule()
    sched.apply(step, {s.seq_id: 7 for s in decoding})
    sched.add(_own(_seq(101, 1000, 4)))
    step = sched.schedule()  # 100 decode rows + 1,000 prompt tokens would replay 2,048 rows
    assert len(step.chunks) == 101 and step.prompt_tokens == 924 and step.num_tokens == 1024


def _padding(buckets: tuple[int, ...], cut: bool, depth: int) -> tuple[int, int]:
    """A mixed load over the RankModel, with the scheduler cutting prompt chunks to the
    buckets or not: (padding rows of the steps with prompt chunks, their tokens)."""
    rng = random.Random(3)
    sched = Scheduler(_gpu_config(num_pages=120, token_buckets=buckets if cut else ()))
    rank, padding, tokens = RankModel(16), 0, 0
    seqs = [_own(_seq(i, rng.randint(1, 1500), rng.randint(1, 40))) for i in range(1, 81)]
    for s in seqs[:20]:
        sched.add(s)

    def count(step):
        nonlocal padding, tokens
        if step.prompt_tokens:
            padding += token_bucket(buckets, step.num_tokens) - step.num_tokens
            tokens += step.num_tokens

    def arrive(n):  # four more requests every fifth step, as a stream of clients would
        due = seqs[: 20 + 4 * (n // 5 + 1)]
        for s in due[len(added) :]:
            sched.add(s)
            added.append(s)

    added = seqs[:20]

    original = sched.schedule

    def schedule():
        step = original()
        if step is not None:
            count(step)
        return step

    sched.schedule = schedule
    finished, _ = _drive(sched, rank, _seeded, depth, before=arrive)
    assert sorted(finished) == [s.seq_id for s in seqs]
    for s in seqs:
        n = len(s.prompt_ids)
        assert s.output_ids == [_seeded(s, n + i) for i in range(s.max_tokens)]
    assert sched.pages_in_use == 0 and not sched.running and sched.num_preemptions > 0
    return padding, tokens


@pytest.mark.parametrize("depth", [1, 3])
def test_cutting_prompt_chunks_spares_padding_and_keeps_every_token_exact(depth):
    padded, tokens = _padding(POW2, cut=False, depth=depth)
    cut_padding, cut_tokens = _padding(POW2, cut=True, depth=depth)
    # (the tokens computed, in the message, differ a little: preemptions recompute some)
    assert cut_padding < 0.75 * padded, (cut_padding, padded, tokens, cut_tokens)
