"""Speculative decoding's proposals and how many to make: plain CPU code the scheduler calls.

A proposer guesses the next tokens of a sequence; the ranks then score the last known token and
the guesses in one verification row, drawing after each exactly as they would draw after it
alone (same seed, same position: runtime/sampling.py), and the scheduler keeps the guesses that
equal the draws before them, plus the draw after the last kept one. Every proposal here is one
token, not a distribution, so keeping it when it equals the seeded draw is the standard
rejection-sampling rule for a point-mass draft (kept with probability p(token); after a
rejection the draw follows p without that token): the output is token for token the one
without speculation, greedy or seeded.

The proposer boundary is `propose(seq, k) -> tokens`. Two proposers:
- "ngram" (prompt lookup, below): no model; the continuation of the latest earlier match of the
  sequence's last few tokens.
- "draft": a second, smaller package with the same tokenizer, run whole by rank 0
  (ranks/drafting.py). A row planned with `draft` tokens asks rank 0 to propose that many
  greedy draft tokens after its last draw; they come back with the row's samples and are the
  sequence's next proposals (`SpecState.drafted`). Greedy draft tokens are point masses too, so
  the acceptance above holds unchanged. An EAGLE-style head would propose the same way, from
  rank 0: the verification row and the acceptance do not change.

How many to propose (`SpecState`) follows each sequence's own acceptance (its output never
depends on it): all kept -> one more next time (up to the maximum),
none kept -> half as many. A sequence that proposes nothing or keeps nothing `MISSES_TO_PAUSE`
times in a row pauses: it decodes without proposals, planned ahead like any other, for 8 tokens;
after a pause that nothing kept ended, one more miss starts the next, twice as long (capped).
While a step in flight draws a sequence's last token, a sequence whose tail repeats earlier
text gets a row chained behind that one whose first token guesses the draw; a wrong guess voids
the row (the sequence loses that step) and counts as a miss. With nothing in flight to chain
behind (a prefill chunk, the draft proposer) it waits for the token instead, which costs the
same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

METHODS = ("ngram", "draft")
MISSES_TO_PAUSE = 4
MAX_PAUSE_TOKENS = 256
# A sequence decoding alone guesses the token a step in flight draws (rather than waiting for
# it) while its guesses have been right often enough (an average over about GUESS_RATE_SPAN
# of them, those it would have made while waiting included). A wrong guess loses it a step; a
# wait loses the host's round trip, which the engine core measures (Scheduler.guess_min_rate
# = 1 - round trip / step): a small part of a step for a large model, where guessing pays only
# when guesses are nearly always right (as in copied passages: 91-95% on SmolLM2's copy-heavy
# outputs), a step or more for a small one. This rate holds until the core has measured.
GUESS_MIN_RATE = 0.85
GUESS_RATE_SPAN = 8


def num_kept(proposals, drawn) -> int:
    """How many proposals a verification keeps: those equal to the draws before them. The
    frontend (runtime/scheduler.py) and rank 0's drafter (ranks/drafting.py) must agree."""
    kept = 0
    while kept < len(proposals) and proposals[kept] == drawn[kept]:
        kept += 1
    return kept


@dataclass(frozen=True)
class SpeculationConfig:
    method: str = "ngram"
    num_tokens: int = 4  # the most proposals in one verification row
    ngram_max: int = 4  # the longest suffix the n-gram proposer looks up
    ngram_min: int = 2  # the shortest
    # Adapt k to each sequence's acceptance and pause after fruitless verifications; off (k
    # fixed, never a pause) only for benchmarks that time verification rounds.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculation method {self.method!r} is unknown; use one of {', '.join(METHODS)}"
            )
        if not 1 <= self.num_tokens <= 16:
            raise ValueError(f"speculative tokens must be 1 to 16, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}"
            )


@dataclass
class NgramIndex:
    """A copy of a sequence's tokens and where each of their n-grams (n in `sizes`) last ended,
    indexed up to (not including) the current end, so the suffix never finds itself. Indexed
    when asked (`may_follow`, `propose`): a token at a time by a short loop, a prompt in bulk."""

    sizes: range  # the n-gram lengths looked up
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # `ends` holds the n-grams ending before this position

    def extend(self, new_tokens: list[int]) -> None:
        """Append the sequence's tokens since the last call."""
        self.tokens += new_tokens

    def _index(self) -> None:
        """Bring `ends` up to the current end. A prompt's n-grams go in through zip, in C rather
        than a Python loop (0.4 ms for a 512-token prompt on a 2-core VM: a wave of new
        sequences pays it on the step loop); a decode's one or two new positions by a loop."""
        tokens, start, ends = self.tokens, self.indexed, self.ends
        last = len(tokens) - 1  # n-grams ending at e in [start, last] are new (e < the end)
        if last - start < 4:
            for e in range(start, last + 1):
                for n in self.sizes:
                    if n <= e:
                        ends[tuple(tokens[e - n : e])] = e
        else:
            for n in self.sizes:
                lo = max(start, n)
                if lo <= last:
                    grams = zip(*(tokens[lo - n + i : last - n + i + 1] for i in range(n)))
                    ends.update(zip(grams, range(lo, last + 1)))
        self.indexed = max(start, last + 1)

    def may_follow(self) -> bool:
        """Whether the sequence's known tail repeats earlier text: its last `sizes[0]` tokens
        (the shortest n-gram) occurred before, with a token after them. Then the next token,
        once known, likely continues that match, so a proposal after it is worth waiting a
        step for. Text that merely reuses a token (every "the", every comma) does not repeat
        this way, so outputs that never copy never wait (a wait costs a sequence its step at
        large batches)."""
        n = self.sizes[0]
        if len(self.tokens) <= n:
            return False
        self._index()
        return tuple(self.tokens[-n:]) in self.ends

    def propose(self, new_tokens: list[int], k: int) -> list[int]:
        """Append the sequence's tokens since the last call; then up to k tokens that followed
        the latest earlier occurrence of the longest suffix that occurred before."""
        return self.propose_after(new_tokens, [], k)

    def propose_after(self, new_tokens: list[int], assumed: list[int], k: int) -> list[int]:
        """As propose, for the sequence followed by `assumed` tokens (not indexed: they are
        proposals in flight)."""
        self.extend(new_tokens)
        self._index()
        tokens = self.tokens + assumed if assumed else self.tokens
        end = len(tokens)
        for n in reversed(self.sizes):
            if n <= end:
                at = self.ends.get(tuple(tokens[end - n :]))
                if at is not None:
                    return tokens[at : at + k]
        return []


@dataclass
class SpecState:
    """One sequence's speculation: its proposer's index and how many to propose."""

    config: SpeculationConfig
    k: int = 0
    misses: int = 0  # verifications in a row that kept nothing (or proposed nothing)
    pause: int = 0  # tokens left to decode without proposals
    pauses: int = 0  # pauses so far in a row: each is twice as long as the one before
    index: NgramIndex | None = None  # the n-gram proposer's
    # The draft proposer's: the ranks' proposals after the sequence's last known token, and
    # whether a row in flight asked for more (the sequence then waits for them).
    drafted: list[int] = field(default_factory=list)
    awaiting_draft: bool = False
    guess_rate: float = 1.0  # how often its guesses of a token being drawn were right
    expected: int | None = None  # while it waits for a token: the guess it did not make

    def guessed(self, right: bool) -> None:
        self.guess_rate += (float(right) - self.guess_rate) / GUESS_RATE_SPAN

    def __post_init__(self) -> None:
        self.k = self.config.num_tokens
        c = self.config
        if c.method == "ngram":
            self.index = NgramIndex(range(c.ngram_min, c.ngram_max + 1))

    @property
    def drafts(self) -> bool:
        return self.config.method == "draft"

    @property
    def active(self) -> bool:
        """Whether the sequence proposes at its next decode (so is not planned ahead)."""
        return self.pause == 0

    def may_propose_next(self, new_tokens: list[int]) -> bool:
        """Given the sequence's known tokens since the last call, whether its next decode, once
        the token being drawn now is known, could have proposals: when not, it is planned
        ahead like any other rather than waiting for that token."""
        if self.drafts:
            return self.awaiting_draft
        self.index.extend(new_tokens)
        return self.index.may_follow()

    def propose(self, new_tokens: list[int], limit: int) -> list[int]:
        """At most min(k, limit) proposals to follow the sequence, given its tokens since the
        last call; finding none counts as a miss."""
        if self.drafts:
            found, self.drafted = self.drafted[: min(self.k, limit)], []
        else:
            found = self.index.propose(new_tokens, min(self.k, limit)) if limit > 0 else []
        if not found and limit > 0:
            self.missed()
        return found

    def verified(self, proposed: int, kept: int) -> None:
        if not self.config.adaptive:
            return
        if kept == proposed:
            self.k = min(self.k + 1, self.config.num_tokens)
        if kept:
            self.misses = self.pauses = 0
            return
        self.k = max(self.k // 2, 1)
        self.missed()

    def decoded(self, num_tokens: int) -> None:
        """Tokens decoded without proposals count down a pause."""
        self.pause = max(self.pause - num_tokens, 0)

    def missed(self) -> None:
        if not self.config.adaptive:
            return
        self.misses += 1
        # after a pause that nothing kept ended, one more miss starts the next
        if self.misses >= (MISSES_TO_PAUSE if self.pauses == 0 else 1):
            self.misses = 0
            self.pauses += 1
            self.pause = min(2 ** (self.pauses + 2), MAX_PAUSE_TOKENS)
