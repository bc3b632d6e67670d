"""Continuous batching over a paged KV cache. Plain CPU code: `schedule()` returns the next
step, `apply()` takes what the ranks sampled.

How a step is built:
1. Running sequences that decode (one token each) come first, oldest first. A decode that needs
   a new page when none is free preempts the youngest running sequence: its pages are freed
   and it goes back to the front of the queue to be recomputed later (prompt + output so far
   as a new prefill), so no request is lost.
2. The remaining token budget (the package's largest prefill chunk) goes to prompts: first
   those already part-way through their prefill, then waiting ones in arrival order, each in
   a chunk no longer than what is left. A prompt is admitted only when its chunk's pages are
   free, so prefill never preempts decodes. With the package's token buckets
   (SchedulerConfig.token_buckets), a step whose prompts would fill less than half of the way
   from one bucket to the next ends its prompt chunks on the lower bucket instead: on a GPU a
   step replays the smallest bucket that holds it and computes every row of it, so the cut
   tokens, computed in the next step, cost less than the padding they spare
   (`Scheduler._prompt_room`).
3. A sequence samples when its chunk reaches the end of its known tokens.

Planning ahead: the engine sends the next step before the previous one's samples are applied,
so the ranks never wait for the frontend. A chunk counts as computed once it is scheduled
(`num_computed`), and a token that a step in flight will sample counts in `pending`. A sequence
whose only uncomputed token is a pending one decodes with `follows_sample`: each rank feeds it
the token it sampled itself (all ranks sample alike). A sequence that its pending token will
end by length is not planned ahead; one that ends by EOS has its next row in the step already
in flight, whose sample is then discarded (one wasted row). A result for a sequence's earlier
incarnation (before a preemption) is ignored: its tokens are recomputed and, sampling being
seeded by position, drawn again the same. Pages freed by apply() may be given to another
sequence in the next step while a step in flight still writes them: safe, because every rank
executes the plans in the order they were sent.

Prefix caching (runtime/prefix_cache.py, on unless SchedulerConfig.prefix_cache is off): a
waiting sequence is admitted with the cached pages its tokens start with already in its page
table and counted as computed, so its prefill starts after them. At least its last known token
is always computed (its logits are needed), and a sequence with a grammar takes cached pages of
its prompt only, because its rank-side matcher replays recomputed output tokens. A sequence whose
next page is being computed by the step under construction waits one step for it rather than
computing it again (this is how the choices of an n > 1 request share their prompt). Pages a
sequence completes are cached as soon as their tokens are known here; a sequence's pages go back
to the pool when it ends, cached ones as idle pages evicted least recently used.

Speculative decoding (SchedulerConfig.speculation, runtime/speculation.py): a decoding sequence
may be a verification row of its last known token and proposals, sampled after each token; apply()
keeps the proposals equal to the draws before them plus the draw after the last, and rolls the
sequence's computed length back to them. A row in flight (a verification row, or a plain one of
a sequence whose tail repeats earlier text) may have the sequence's next row chained behind it
(`_chain`), its first token a guess of that row's last draw; a wrong guess voids it. With the
draft proposer, a row that samples asks the ranks for `draft` proposals after its last draw,
with pages for the draft's KV of them; the sequence then waits for that row's result, which
carries them, instead of chaining. docs/scheduler.md has the
rules.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams
from runtime.spec import token_bucket
from runtime.speculation import GUESS_MIN_RATE, SpecState, SpeculationConfig, num_kept

# The draft proposer's gate: when the draft's proposals are kept less often than this (an
# average over its recent verification rows), no sequence asks for drafts for a while. On the
# H200 a rejected round costs 1.7-2x a plain step (docs/performance.md), so below this rate no
# k pays: a round of k proposals then yields at most 1.43 tokens.
DRAFT_MIN_RATE = 0.3
DRAFT_RATE_ROWS = 16  # rows the average spans (weight 1/16), and rows before it is trusted
DRAFT_PAUSE_STEPS = (64, 4096)  # the gate's first and longest pause, doubling in between
# A step's prompt chunks are cut to end on a token bucket only where that bucket is at least
# this many tokens: below it a step costs about its weights' read whatever its rows (on Hopper
# the 8B's products turn compute-bound at about 250-300 rows), so padding there is nearly free
# and a cut would only delay the prompt.
TRIM_MIN_TOKENS = 512


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache or computed by a step in flight
    pending: int = 0  # tokens that steps in flight sample, not yet applied (output_ids lacks them)
    on_rank: bool = False  # the ranks hold its state (page table, sampling)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    arrival: int = 0
    num_preemptions: int = 0
    has_grammar: bool = False  # its output is replayed into a matcher on the ranks
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache at admission
    page_keys: list[bytes] = field(default_factory=list)  # prefix keys of its first full pages
    num_registered: int = 0  # leading pages offered to the prefix cache
    spec: SpecState | None = None  # its speculative decoding, when on and it has no grammar
    new_tokens: int = 0  # output tokens the last apply() gave it
    verifying: list[SeqChunk] = field(default_factory=list)  # its verification rows in flight
    # Its latest one-token decode row without proposals (with speculation): what a row that
    # guesses its draw can be chained behind (Scheduler._decoding).
    plain_row: SeqChunk | None = None

    # its prompt and output tokens: kept by Scheduler.apply, the one place output_ids grows
    # (read several times a sequence a step, where a property's call showed in the profile)
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, i: int, j: int) -> list[int]:
        n = len(self.prompt_ids)
        if j <= n:
            return self.prompt_ids[i:j]
        return self.prompt_ids[i:] + self.output_ids[max(i - n, 0) : j - n]


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_size: int
    max_batch: int
    max_step_tokens: int
    max_seq_len: int
    prefix_cache: bool = True
    cache_salt: bytes = b""  # names what else shapes the KV (the package digest)
    speculation: SpeculationConfig | None = None
    # Decode steps of up to this many rows compute each row as it is computed alone (the
    # ranks' exact graphs, --exact-verification; 0: none): proposals are capped so that a
    # step of decode and verification rows stays within them, where batching and
    # speculation change no row's rounding (a step with a prompt chunk is not one of them).
    exact_rows: int = 0
    # The package's prefill token buckets (capacities.prefill_chunk_sizes), which steps with
    # prompt chunks replay on a GPU; (): steps are not cut to them.
    token_buckets: tuple[int, ...] = ()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass(slots=True)  # one per row of every step: slots make it cheaper to build
class SeqChunk:
    seq: Sequence
    start_pos: int
    num_tokens: int
    new_pages: list[int]
    sample: bool
    is_new: bool  # the ranks have no state for it yet
    # Its one input token is a pending one: each rank feeds the token it sampled itself.
    follows_sample: bool = False
    incarnation: int = 0  # seq.num_preemptions when scheduled; apply() ignores older ones
    # A verification row: the last known token, then these proposals; it samples after each.
    proposals: list[int] = field(default_factory=list)
    # A verification row chained behind the sequence's one in flight: its first token is this
    # guess of that row's last draw, in place of a known token (see Scheduler._chain).
    guess: int | None = None
    void: bool = False  # a chained row whose guess proved wrong: apply() ignores its draws
    draft: int = 0  # draft proposals the ranks make after this row's last draw

    @property
    def verifies(self) -> bool:
        return bool(self.proposals) or self.guess is not None

    @property
    def token_ids(self) -> list[int]:
        if self.follows_sample:
            return []
        if self.guess is not None:
            return [self.guess, *self.proposals]
        if self.proposals:
            return self.seq.tokens(self.start_pos, self.start_pos + 1) + self.proposals
        return self.seq.tokens(self.start_pos, self.start_pos + self.num_tokens)

    @property
    def num_samples(self) -> int:
        return len(self.proposals) + 1 if self.sample else 0


@dataclass
class Step:
    step_id: int
    released: list[int]  # seq ids whose rank state is dropped before the step
    chunks: list[SeqChunk]
    num_tokens: int = 0  # the tokens its chunks compute, together
    prompt_tokens: int = 0  # of those, the prompts' chunks' (the rest are decode rows)

    @property
    def sampling_chunks(self) -> list[SeqChunk]:
        return [c for c in self.chunks if c.sample]

    @property
    def verifies(self) -> bool:
        return any(c.verifies for c in self.chunks)


class CapacityError(ValueError):
    """A request that can never be served within the package's capacities."""


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.free_pages: list[int] = list(range(config.num_pages - 1, -1, -1))  # not cached
        self.cache = (
            PrefixCache(config.cache_salt, config.page_size) if config.prefix_cache else None
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self._released: list[int] = []
        self._arrivals = itertools.count()
        self._next_step_id = 1
        self.num_preemptions = 0
        # For /metrics: proposal tokens sent (chained rows' guesses too) and kept, verification
        # rows applied, and the tokens those rows gave.
        self.spec_proposed = self.spec_kept = self.spec_verifications = self.spec_tokens = 0
        self.spec_waits = 0  # decodes held back a step to propose after a token being drawn
        # The rate of right guesses above which a sequence decoding alone guesses the token a
        # step in flight draws rather than waiting for it: 1 - the cost of a wait (the host's
        # round trip) over a step's, set by the engine core as it measures both.
        self.guess_min_rate = GUESS_MIN_RATE
        # The draft proposer's recent acceptance, and the step before which no sequence asks
        # for drafts (DRAFT_MIN_RATE).
        self.draft_rate, self._draft_rows = DRAFT_MIN_RATE, 0  # (the first rows decide)
        self.draft_gate_until, self._draft_pause = 0, 0
        # Pages granted to a sequence since the ranks last saw it: sent as its new_pages.
        self._pending_pages: dict[int, int] = {}

    # ---- requests -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        total = len(seq.prompt_ids) + seq.max_tokens
        if total > self.config.max_seq_len:
            raise CapacityError(
                f"prompt ({len(seq.prompt_ids)}) + max_tokens ({seq.max_tokens}) exceeds "
                f"max_seq_len {self.config.max_seq_len}"
            )
        if self.config.pages_for(total) > self.config.num_pages:
            raise CapacityError(
                f"the sequence needs {self.config.pages_for(total)} KV pages; the pool has "
                f"{self.config.num_pages}"
            )
        if self.config.speculation is not None and not seq.has_grammar:
            seq.spec = SpecState(self.config.speculation)
        seq.arrival = next(self._arrivals)
        self.waiting.append(seq)

    def abort(self, seq: Sequence, left_out_of: int | None = None) -> None:
        """Stop a sequence; its pages are released with the next step. left_out_of: the id of
        a step whose plan was sent without this sequence, so the pages it would have completed
        hold nothing and must not stay cached."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if left_out_of is not None and self.cache is not None:
            self.cache.unregister_from(seq.pages, left_out_of)
        self._finish(seq, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def pages_in_use(self) -> int:
        """Pages some sequence holds (idle cached pages are not in use)."""
        return self.config.num_pages - self._available()

    def _available(self) -> int:
        return len(self.free_pages) + (self.cache.num_idle if self.cache is not None else 0)

    # ---- building a step -----------------------------------------------------------------
    def schedule(self) -> Step | None:
        step_id = self._next_step_id
        budget, chunks = self.config.max_step_tokens, []
        decoding = self._decoding()
        extra = 0  # sampling rows beyond one per sequence (proposals): they count in max_batch
        for i, seq in enumerate(decoding):
            if seq.status is not Status.RUNNING:
                continue  # preempted while making room for an older one
            if seq.spec is None:
                # One token, as the general path below plans it without proposals: the short
                # way, since this runs every step for every decoding sequence.
                if self._reserve(seq, seq.num_computed + 1, preempt=True):
                    chunks.append(self._chunk(seq, 1, step_id))
                    budget -= 1
                continue
            # Room for proposals: each decode keeps one token of the budget and one sampling
            # row, and the step samples at most max_batch rows.
            later = len(decoding) - i
            room = min(budget - later, self.config.max_batch - extra - len(decoding))
            if self.config.exact_rows:
                room = max(0, min(room, self.config.exact_rows - extra - len(decoding)))
            chunk = self._chain(seq, room, step_id) if seq.verifying else None
            if chunk is None and seq.verifying:
                if seq.verifying[0].verifies:
                    continue  # it waits for its verification's result
                seq.verifying.clear()  # nothing to guess after its plain row: planned ahead
            if chunk is None:
                proposals = self._propose(seq, room) if seq.spec is not None else []
                need = seq.num_computed + 1 + len(proposals)
                if proposals and not self._reserve(seq, need, preempt=False):
                    proposals = []
                if not self._reserve(seq, seq.num_computed + 1, preempt=True):
                    continue
                chunk = self._chunk(seq, 1 + len(proposals), step_id, proposals)
                if proposals:
                    seq.verifying.append(chunk)
                elif seq.spec is not None:
                    seq.plain_row = chunk
                self._ask_draft(seq, chunk)
            chunks.append(chunk)
            budget -= chunk.num_tokens
            extra += chunk.num_tokens - 1
        decode_budget = budget
        candidates = self._prefill_candidates()
        room = self._prompt_room(candidates, budget, len(chunks) + extra)
        for seq in candidates:
            if room <= 0 or len(chunks) + extra >= self.config.max_batch:
                break
            if seq.status is Status.WAITING and len(self.running) >= self.config.max_batch:
                break  # running sequences that are not planned ahead still hold their slot
            waiting = seq.status is Status.WAITING
            if waiting and self.cache is not None and not self._take_cached(seq, step_id):
                continue  # its next page is being computed: it takes it next step
            n = min(self._uncomputed(seq), room)
            if not self._reserve(seq, seq.num_computed + n, preempt=False):
                if waiting:
                    self._free(seq)  # the cached pages it took go back
                    seq.num_computed = 0
                break  # keep arrival order: no younger prompt jumps a waiting one
            if waiting:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                self._count_hits(seq)
            chunk = self._chunk(seq, n, step_id)
            self._ask_draft(seq, chunk)
            chunks.append(chunk)
            budget -= n
            room -= n
        released, self._released = self._released, []
        if not chunks and not released:
            return None
        self._next_step_id += 1
        return Step(
            step_id, released, chunks, self.config.max_step_tokens - budget, decode_budget - budget
        )

    def _prompt_room(self, candidates: list[Sequence], budget: int, rows: int) -> int:
        """The prompt tokens this step may take: the budget left after its decode rows, or, when
        the prompts it would take fill it to less than halfway from a token bucket of at least
        TRIM_MIN_TOKENS to the next, up to that bucket. The tokens cut wait a step; fewer than
        the padding rows they spare, they cost less there (in a step that decodes anyway, or
        one of a smaller bucket) than the padding would have here.

        What the step would take is worked out as the loop in schedule() takes it (the batch's
        rows, the running limit, the pages free), but without a waiting prompt's cached pages.
        With them it computes fewer tokens, and the cut is smaller or none; it also needs fewer
        pages, so where pages are short the step might have taken more than counted, and the
        cut then defers more than it spares. That needs a full pool and a cache hit at once,
        and it only moves tokens to the next step."""
        buckets = self.config.token_buckets
        if not buckets or budget <= 0:
            return budget
        pages, running, slots = self._available(), len(self.running), self.config.max_batch - rows
        offered = 0
        for seq in candidates:
            if offered >= budget or slots <= 0:
                break
            if seq.status is Status.WAITING:
                if running >= self.config.max_batch:
                    break
                running += 1
            n = min(self._uncomputed(seq), budget - offered)
            need = self.config.pages_for(seq.num_computed + n) - len(seq.pages)
            if need > pages:
                break
            pages -= max(need, 0)
            offered += n
            slots -= 1
        if offered >= budget:
            return budget  # a full step replays the largest bucket, every row of it used
        used = self.config.max_step_tokens - budget
        total = used + offered
        below = max((b for b in buckets if b < total), default=0)
        if below < TRIM_MIN_TOKENS or below <= used:
            return budget
        if total - below >= token_bucket(buckets, total) - total:
            return budget
        return below - used

    def _take_cached(self, seq: Sequence, step_id: int) -> bool:
        """Put the cached pages seq starts with in its page table, counted as computed; False
        (taking none) when the next one is computed by step step_id: seq waits for it."""
        cache, ps = self.cache, self.config.page_size
        last = seq.num_tokens - 1  # the last known token is computed again for its logits
        if seq.has_grammar:
            last = min(last, len(seq.prompt_ids))
        cache.extend_keys(seq.page_keys, seq.tokens, last // ps)
        pages, wait = cache.lookup(seq.page_keys[: last // ps], step_id)
        if wait:
            return False
        cache.hold(pages)  # out of the idle list: the reservation that follows cannot evict them
        seq.pages = list(pages)
        seq.num_registered = len(pages)
        seq.num_computed = len(pages) * ps
        self._pending_pages[seq.seq_id] = len(pages)
        return True

    def _count_hits(self, seq: Sequence) -> None:
        """On a sequence's first admission: its prompt tokens that came from the cache."""
        if self.cache is not None and seq.cached_tokens is None:
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt_ids))
            self.cache.prompt_tokens += len(seq.prompt_ids)
            self.cache.hit_tokens += seq.cached_tokens

    def _decoding(self) -> list[Sequence]:
        """Running sequences that decode this step: one token each, proposals, or a
        verification row chained behind theirs in flight."""
        out = []
        # With other sequences in the step, a wait costs the sequence the step, as a wrong guess
        # does; alone, it costs only the host's round trip
        alone = len(self.running) == 1
        max_seq_len = self.config.max_seq_len
        for s in self.running:
            # Not one whose tokens that steps in flight sample end it by length: planning its
            # next token would only waste a row.
            ahead = s.num_tokens + s.pending  # (with num_computed: _uncomputed, written out)
            if (
                not s.num_computed
                or len(s.output_ids) + s.pending >= s.max_tokens
                or ahead >= max_seq_len
            ):
                continue
            if s.verifying:  # (a chain is one deep: two steps in flight at most)
                if len(s.verifying) == 1 and s.pending == 1:
                    out.append(s)
            elif ahead - s.num_computed == 1:
                if s.pending and s.spec is not None and self._waits_to_propose(s):
                    if self._guesses(s, alone):
                        s.verifying.append(s.plain_row)  # _chain guesses the row's draw
                        out.append(s)
                    else:
                        self.spec_waits += 1  # left out of this step, to propose after its draw
                        if s.spec.index is not None:  # the guess it could have made, to score
                            s.spec.expected = next(iter(s.spec.index.propose([], 1)), None)
                else:
                    out.append(s)
        return out

    def _guesses(self, seq: Sequence, alone: bool) -> bool:
        """Whether seq, whose tail repeats earlier text while its plain row in flight draws
        its next token, gets a row chained behind that one instead of waiting for the draw:
        the row's first token guesses the draw (what followed the tail where it occurred
        before; right about nine times in ten where outputs copy, docs/performance.md), then
        proposals after it. A wrong guess voids the row (the step without a token) and a right
        one keeps two steps in flight. A sequence decoding alone would lose only the host's
        round trip by waiting, so it guesses while its guesses are right often enough for that
        (guess_min_rate)."""
        row = seq.plain_row
        return (
            row is not None
            and not seq.spec.drafts
            and (not alone or seq.spec.guess_rate >= self.guess_min_rate)
            and row.sample
            and row.incarnation == seq.num_preemptions
            and row.start_pos + 1 == seq.num_computed  # the last row planned, still in flight
        )

    def _chain(self, seq: Sequence, room: int, step_id: int) -> SeqChunk | None:
        """A verification row planned behind seq's one in flight, assuming that one keeps every
        proposal: its first token is the guess of that row's last draw (what followed its
        proposals in the n-gram match), then proposals after it. If the row in flight keeps
        less or draws otherwise, this one is void: apply() rolls seq back to what was kept and
        ignores this row's draws, and its KV is overwritten later. None: nothing to guess, or
        no room; seq waits for the row in flight."""
        spec, ahead = seq.spec, seq.verifying[0]
        if not spec.active or spec.drafts:
            return None
        start = ahead.start_pos + 1 + len(ahead.proposals)  # the guessed draw's position
        limit = min(  # proposals after the guess
            room,
            spec.k,
            seq.max_tokens - len(seq.output_ids) - len(ahead.proposals) - 2,
            self.config.max_seq_len - start - 1,
        )
        if limit < 0:
            return None
        found = spec.index.propose_after(_unindexed(seq), ahead.proposals, limit + 1)
        if not found or not self._reserve(seq, start + len(found), preempt=False):
            return None
        chunk = self._chunk(seq, len(found), step_id, found[1:])
        chunk.guess, chunk.follows_sample = found[0], False
        seq.verifying.append(chunk)
        return chunk

    def _waits_to_propose(self, seq: Sequence) -> bool:
        """Whether seq, whose last token a step in flight draws, waits for that token to
        propose after it rather than being planned ahead."""
        spec = seq.spec
        if not spec.active:
            return False
        return spec.may_propose_next(_unindexed(seq))

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """Proposals for seq's next decode (none while it pauses or a step in flight samples
        its last token), at most `room` and never past its max_tokens or max_seq_len: the
        row's last draw is always kept, so k proposals can add k + 1 tokens."""
        spec = seq.spec
        if not spec.active or seq.pending:
            return []
        limit = min(
            room,
            seq.max_tokens - len(seq.output_ids) - 1,
            self.config.max_seq_len - seq.num_tokens,
        )
        return spec.propose(_unindexed(seq), limit)

    def _ask_draft(self, seq: Sequence, chunk: SeqChunk) -> None:
        """With the draft proposer: have the ranks propose after chunk's last draw, as many as
        seq's next verification could use, with pages (sent with the chunk) for the draft's KV
        of all but the last. No request while the draft gate is closed, when pages are short,
        or when the running sequences fill the batch (a step samples at most max_batch rows,
        so no proposal would fit): the row goes on alone."""
        spec = seq.spec
        if spec is None or not spec.drafts or not spec.active or not chunk.sample:
            return
        if self._next_step_id <= self.draft_gate_until:
            return
        end = chunk.start_pos + chunk.num_tokens  # the row's draw lands here
        k = min(
            spec.k,
            # rows the next step will likely have for proposals: one per running sequence
            self.config.max_batch - len(self.running),
            seq.max_tokens - len(seq.output_ids) - seq.pending - 1,
            self.config.max_seq_len - end - 1,
        )
        if k <= 0 or not self._reserve(seq, end + k, preempt=False):
            return
        added = self._pending_pages.pop(seq.seq_id, 0)
        if added:
            chunk.new_pages = chunk.new_pages + seq.pages[-added:]
        chunk.draft, spec.awaiting_draft = k, True

    def _prefill_candidates(self) -> list[Sequence]:
        partial = [
            s  # (_uncomputed, written out: this runs for every sequence every step)
            for s in self.running
            if s.num_tokens + s.pending - s.num_computed > 1 or not s.num_computed
        ]
        return partial + list(self.waiting)

    @staticmethod
    def _uncomputed(seq: Sequence) -> int:
        return seq.num_tokens + seq.pending - seq.num_computed

    def _chunk(self, seq: Sequence, n: int, step_id: int, proposals=()) -> SeqChunk:
        first, ps = not seq.on_rank, self.config.page_size
        new_pages = seq.pages[len(seq.pages) - self._pending_pages.pop(seq.seq_id, 0) :]
        seq.on_rank = True
        start, seq.num_computed = seq.num_computed, seq.num_computed + n
        follows = start >= seq.num_tokens  # its token is sampled by a step not yet applied
        # (proposals are computed past the known tokens: a verification row samples too)
        sample = seq.num_computed >= seq.num_tokens + seq.pending
        if sample:
            seq.pending += 1
        if self.cache is not None and seq.num_computed >= (seq.num_registered + 1) * ps:
            self._register(seq, step_id)
        chunk = SeqChunk(seq, start, n, new_pages, sample, first, follows, seq.num_preemptions)
        if proposals:
            chunk.proposals = list(proposals)
        return chunk

    def _register(self, seq: Sequence, step_id: int) -> None:
        """Offer the prefix cache seq's pages that are full of known, planned tokens; step_id
        is the last step that computes any of them. The two callers that run for every
        sequence every step call it only once seq.num_computed has passed its registered pages
        by a page: before, it has none to offer."""
        if self.cache is None:
            return
        full = min(seq.num_computed, seq.num_tokens) // self.config.page_size
        if full <= seq.num_registered:
            return
        self.cache.extend_keys(seq.page_keys, seq.tokens, full)
        for i in range(seq.num_registered, full):
            self.cache.register(seq.pages[i], seq.page_keys[i], step_id)
        seq.num_registered = full

    def _reserve(self, seq: Sequence, num_tokens: int, preempt: bool) -> bool:
        """Give seq pages for num_tokens tokens, preempting the youngest if allowed."""
        need = self.config.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        while need > self._available():
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        seq.pages.extend(self._take_page() for _ in range(need))
        self._pending_pages[seq.seq_id] = self._pending_pages.get(seq.seq_id, 0) + need
        return True

    def _take_page(self) -> int:
        """A free page, else the least recently used idle cached one."""
        if self.free_pages:
            return self.free_pages.pop()
        return self.cache.evict()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = seq.pending = 0  # the samples in flight are dropped by apply()
        seq.verifying.clear()
        if seq.spec is not None:
            seq.spec.drafted, seq.spec.awaiting_draft = [], False
            seq.spec.expected = None
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        # Last page first: a sequence's tail is the part least likely to be shared, so its idle
        # pages are evicted before its head's.
        for page in reversed(seq.pages):
            if self.cache is None or not self.cache.release(page):
                self.free_pages.append(page)
        seq.pages = []
        seq.num_registered = 0
        self._pending_pages.pop(seq.seq_id, None)
        if seq.on_rank:
            self._released.append(seq.seq_id)
            seq.on_rank = False

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # ---- results ------------------------------------------------------------------------
    def apply(
        self,
        step: Step,
        sampled: dict[int, int | list[int]],
        drafted: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Record a step's outcome: seq_id -> its sampled token (a verification row: its draws,
        in position order), and the draft proposals the ranks made after them. Steps are
        applied in the order they were scheduled. Returns the sequences that got tokens
        (`new_tokens` of them), with finish_reason set on those that are done."""
        updated = []
        max_seq_len, cache, ps = self.config.max_seq_len, self.cache, self.config.page_size
        for c in step.chunks:
            seq = c.seq
            if (
                not c.sample
                or c.void
                or seq.status is not Status.RUNNING
                or c.incarnation != seq.num_preemptions
            ):
                continue  # void, finished, aborted or preempted since the step was planned
            seq.pending -= 1
            if c.verifies:
                drawn = sampled[seq.seq_id]
                tokens = self._verified(c, [drawn] if isinstance(drawn, int) else drawn)
            else:
                tokens = (sampled[seq.seq_id],)
                if seq.spec is not None:
                    seq.spec.decoded(1)
                    if seq.verifying and seq.verifying[0] is c:
                        self._check_guess(c, tokens[0])
                    elif seq.spec.expected is not None:
                        seq.spec.guessed(tokens[0] == seq.spec.expected)
                        seq.spec.expected = None
            updated.append(seq)
            reason, output = None, seq.output_ids
            for n, token in enumerate(tokens, 1):
                output.append(token)
                seq.num_tokens += 1
                if token in seq.stop_token_ids:
                    reason = "stop"
                elif len(output) >= seq.max_tokens or seq.num_tokens >= max_seq_len:
                    reason = "length"
                if reason:
                    break
            seq.new_tokens = n
            if c.draft:
                seq.spec.awaiting_draft = False
                seq.spec.drafted = list((drafted or {}).get(seq.seq_id, ()))
            if cache is not None and seq.num_computed >= (seq.num_registered + 1) * ps:
                self._register(seq, self._next_step_id - 1)  # planned by a step already sent
            if reason:
                self._finish(seq, reason)
        return updated

    def _check_guess(self, c: SeqChunk, drawn: int) -> None:
        """A plain row with a row chained behind it on a guess of its draw: a wrong guess voids
        that row and rolls the sequence back to this row's token, and counts as a miss."""
        seq = c.seq
        seq.verifying.pop(0)
        chained = seq.verifying[0] if seq.verifying else None
        if chained is None:
            return
        seq.spec.guessed(drawn == chained.guess)
        if drawn == chained.guess:
            return
        chained.void = True
        seq.verifying.clear()
        seq.pending -= 1
        seq.num_computed = c.start_pos + 1
        self.spec_proposed += 1 + len(chained.proposals)
        seq.spec.missed()

    def _verified(self, c: SeqChunk, drawn: list[int]) -> list[int]:
        """A verification row's new tokens: the proposals equal to the draws before them, then
        the draw after the last of those. The KV of the rest is left behind: the sequence's
        computed length goes back to its accepted tokens (their pages stay its own, and its
        next tokens overwrite them), unless the row chained behind this one guessed exactly
        these tokens: then that row's KV and draws stand."""
        seq, proposals = c.seq, c.proposals
        if seq.verifying and seq.verifying[0] is c:  # (by identity: chunks hold sequences)
            seq.verifying.pop(0)
        kept = num_kept(proposals, drawn)
        chained = seq.verifying[0] if seq.verifying else None
        if chained is None or kept < len(proposals) or drawn[kept] != chained.guess:
            seq.num_computed = c.start_pos + 1 + kept
            if chained is not None:
                chained.void = True
                seq.verifying.clear()
                seq.pending -= 1
                self.spec_proposed += 1 + len(chained.proposals)
        if proposals:  # (a chained row may be its guess alone)
            seq.spec.verified(len(proposals), kept)
        if seq.spec.drafts and proposals:
            self._draft_verified(kept / len(proposals))
        guessed = c.guess is not None  # its guess proved right, or it would be void
        self.spec_proposed += len(proposals) + guessed
        self.spec_kept += kept + guessed
        self.spec_verifications += 1
        self.spec_tokens += kept + 1
        return drawn[: kept + 1]

    def _draft_verified(self, rate: float) -> None:
        """Average the draft's acceptance; below DRAFT_MIN_RATE, close the gate for the next
        pause (twice the last, reset once the rate is good), then trust a few fresh rows."""
        self.draft_rate += (rate - self.draft_rate) / DRAFT_RATE_ROWS
        self._draft_rows += 1
        if self.draft_rate >= DRAFT_MIN_RATE:
            self._draft_pause = 0
        elif self._draft_rows >= DRAFT_RATE_ROWS:
            first, longest = DRAFT_PAUSE_STEPS
            self._draft_pause = min(max(2 * self._draft_pause, first), longest)
            self.draft_gate_until = self._next_step_id + self._draft_pause
            self._draft_rows = DRAFT_RATE_ROWS - 4  # after the pause, four rows decide again


def _unindexed(seq: Sequence) -> list[int]:
    """seq's known tokens that its n-gram index has not been given yet (none: no index)."""
    index = seq.spec.index
    return seq.tokens(len(index.tokens), seq.num_tokens) if index is not None else []
