"""A rank's step execution, split in two so that the next step can be queued on the GPU before
this one's samples reach the host:

- `launch(plan, previous)`: apply the plan's sequence changes, build the inputs, run the model
  (`forward`) and draw the samples (`draw`). On CUDA nothing here waits for the GPU, except a
  masked draw (below): the tokens stay on the device, a copy to pinned host memory is queued
  behind them, and a `follows_sample` row whose token the previous (still unfinished) step
  draws is fed from the device (runner.feed + fed_row).
- `finish(launched)`: wait for that copy, remember each sequence's token (what a later
  `follows_sample` row of a finished step uses), and build the StepResult.

The frontend sends step N+1 before N's result (orbit/core/engine.py), so the rank finds it waiting:
it launches N+1 and then finishes N, and the GPU runs N+1 while the host reports N. On the CPU
path every step completes in launch, and the same two calls run in the same order.

Every rank draws every sampling row (all ranks hold the same logits; draws are seeded per
(seed, position)), so each can feed its own samples; only rank 0 reports them, and only rank 0
computes logprobs. A step in which a row asks for logprobs is sampled synchronously.

A sequence with a grammar (structured output, runtime/grammar.py) has its logits masked before
the draw, which needs its matcher to have consumed every earlier sample. So a step with a
constrained row first makes sure the previous step's tokens were accepted (`_accept`): the model
of this step is already queued when the rank waits for them, so on a GPU the forward runs while
the host reads the previous samples and fills the masks. The rank reports the previous step
between the two (ranks/worker.py), so the frontend plans the next step meanwhile. Tokens are
accepted once per step, in `_accept`, called from the next draw or from finish, whichever
comes first. A new sequence's grammar compiles in the background from the moment it joins;
its first masked row waits for it (`_grammar_ready`), on every rank at the same row, so the
ranks stay in lock-step.

A draw that raises fails only its own sequence: the batch is drawn again row by row, a row
that still fails gets token 0 and an error in its Sample, and the frontend ends that sequence.
Every rank runs the same code on the same logits, so all agree on which rows failed.

Rank 0 of a group started with a draft package (speculative decoding's draft proposer) drafts
in finish, once the draws are on the host, for the rows that ask (ranks/drafting.py); the
proposals go back in each such row's last Sample.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from proto import wire_pb2
from ranks.drafting import Drafter, DraftRow, DraftState
from runtime.grammar import GrammarError, GrammarMasks, SeqGrammar
from runtime.runner import SeqInput
from runtime.sampling import Sampled, SamplingParams

log = logging.getLogger("orbit.rank")


@dataclass
class SeqState:
    sampling: SamplingParams
    pages: list[int] = field(default_factory=list)
    last_token: int | None = None  # this rank's latest finished sample: what follows_sample feeds
    grammar: SeqGrammar | None = None  # the output's matcher, for a constrained sequence
    error: str = ""  # why its grammar failed to compile: each of its samples reports it
    draft: DraftState | None = None  # what the drafter knows of it (rank 0 with a draft)


@dataclass
class Launched:
    """A step whose work is queued (CUDA) or done (CPU), not yet reported."""

    step_id: int
    started: float  # perf_counter at launch
    # Sampling rows: (seq_id, state, predicted position); a verification row's are consecutive.
    rows: list[tuple[int, SeqState, int]]
    tokens: torch.Tensor | None  # the rows' tokens on the runner's device (None: no rows)
    drawn: list[Sampled] | None  # set when sampled synchronously
    errors: dict[int, str] = field(default_factory=dict)  # row -> why its draw failed
    idle_before_s: float = 0.0  # nothing was queued for this long before the launch
    host: torch.Tensor | None = None  # pinned copy of tokens, filled in stream order
    copied: torch.cuda.Event | None = None
    gpu_start: torch.cuda.Event | None = None
    accepted: bool = False  # the rows' tokens went into their grammar matchers
    logits: torch.Tensor | None = None  # between forward and draw
    draft_rows: list[DraftRow] = field(default_factory=list)  # with a drafter: every row

    def __post_init__(self) -> None:
        # A scan of rows per follows_sample row of the next step would be quadratic in batch.
        # A verification row's last draw is the sequence's latest sample.
        self._row_by_seq = {seq_id: i for i, (seq_id, _, _) in enumerate(self.rows)}

    @property
    def masked(self) -> bool:
        """Whether a row is constrained: its draw waits for the previous step's tokens."""
        return any(state.grammar is not None for _, state, _ in self.rows)

    def row_of(self, seq_id: int) -> int:
        """This step's (last) sampling row of seq_id, or -1."""
        return self._row_by_seq.get(seq_id, -1)


SampleFn = Callable[[torch.Tensor, list[SamplingParams], list[int]], list[Sampled]]
TokensFn = Callable[[torch.Tensor, list[SamplingParams], list[int]], torch.Tensor]


class StepExecutor:
    def __init__(
        self,
        runner,
        rank: int,
        device: torch.device,
        sample: SampleFn,
        sample_tokens: TokensFn | None,
        max_batch: int,
        grammars: GrammarMasks | None = None,
        drafter: Drafter | None = None,
    ):
        """sample: draws and reads the tokens back (runtime/sampling.py or cuda_sampling.py);
        sample_tokens: CUDA only, draws leaving the tokens on the device; grammars: masks for
        constrained sequences (None: a plan with a grammar fails the rank); drafter: the draft
        proposer (rank 0 only; None: a plan that asks for draft tokens gets none)."""
        self.runner, self.rank, self.device = runner, rank, device
        self.drafter = drafter
        self.grammars = grammars
        self.sample, self.sample_tokens = sample, sample_tokens
        self.seqs: dict[int, SeqState] = {}
        self.cuda = device.type == "cuda"
        # Two launched steps at most are unfinished at once: one pinned buffer each.
        self._host = [
            torch.zeros(max_batch, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)
        ]
        self._next_host = 0

    def reset(self) -> None:
        """A new frontend session: forget every sequence."""
        self.seqs.clear()

    def launch(
        self, plan: wire_pb2.StepPlan, previous: Launched | None, idle_before_s: float = 0.0
    ) -> Launched:
        """Run the plan's model step and draw its samples (forward, then draw)."""
        launched = self.forward(plan, previous, idle_before_s)
        self.draw(launched, previous)
        return launched

    def forward(
        self, plan: wire_pb2.StepPlan, previous: Launched | None, idle_before_s: float = 0.0
    ) -> Launched:
        """Apply the plan's sequence changes and queue its model step; `draw` samples it.
        idle_before_s: how long the rank had nothing queued before this plan arrived."""
        started = time.perf_counter()
        for seq_id in plan.release_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._new_state(new.sampling)
        inputs, rows, feeds, errors, draft_rows = [], [], False, {}, []
        for s in plan.seqs:
            state = self._state(s.seq_id)
            state.pages.extend(s.new_pages)
            fed_row = previous.row_of(s.seq_id) if s.follows_sample and previous else -1
            if fed_row >= 0:
                token_ids, feeds = [0], True
            else:
                token_ids = _input_tokens(s, state)
                if _replays_output(s, state) and _grammar_ready(state):
                    state.grammar.replay(list(s.token_ids), s.start_pos)
            m = _num_samples(s, state, len(token_ids))
            inputs.append(SeqInput(token_ids, s.start_pos, state.pages, s.sample, fed_row, m))
            if self.drafter is not None:
                if state.draft is None:
                    state.draft = self.drafter.start(s.start_pos)
                known = None if s.follows_sample else token_ids
                asks = s.draft_tokens if s.sample else 0
                draft_rows.append(
                    DraftRow(state.draft, state.pages, s.start_pos, known, len(rows), m, asks)
                )
            end = s.start_pos + len(token_ids)
            for pos in range(end - m + 1, end + 1):
                rows.append((s.seq_id, state, pos))
                if state.error:
                    errors[len(rows) - 1] = state.error
        if plan.HasField("decode"):
            fed = self._decode_rows(plan.decode, previous, inputs, rows, errors, draft_rows)
            feeds = feeds or fed
        if feeds:
            self.runner.feed(previous.tokens)
        gpu_start = None
        if self.cuda:
            gpu_start = torch.cuda.Event(enable_timing=True)
            gpu_start.record()
        logits = self.runner.step(inputs) if inputs else None
        launched = Launched(plan.step_id, started, rows, None, None, errors, gpu_start=gpu_start)
        launched.idle_before_s = idle_before_s
        launched.logits = logits
        launched.draft_rows = draft_rows
        return launched

    def _decode_rows(
        self,
        d: wire_pb2.DecodeRows,
        previous: Launched | None,
        inputs: list,
        rows: list,
        errors: dict,
        draft_rows: list,
    ) -> bool:
        """The plan's packed decode rows (wire.proto DecodeRows) as the loop in forward turns
        a SeqStep with follows_sample and sample; returns whether a row is fed from the
        previous step's samples on the device."""
        page_rows, new_pages = list(d.page_rows), list(d.new_pages)
        if len(page_rows) != len(new_pages):
            raise ValueError(
                f"step plan: the decode rows name {len(page_rows)} rows for "
                f"{len(new_pages)} new pages"
            )
        feeds, j = False, 0
        for i, (seq_id, pos) in enumerate(zip(d.seq_ids, d.start_pos)):
            state = self._state(seq_id)
            while j < len(page_rows) and page_rows[j] == i:
                state.pages.append(new_pages[j])
                j += 1
            fed_row = previous.row_of(seq_id) if previous else -1
            if fed_row >= 0:
                token_ids, feeds = [0], True
            else:
                token_ids = [_last_token(seq_id, state)]
            inputs.append(SeqInput(token_ids, pos, state.pages, True, fed_row))
            if self.drafter is not None:
                if state.draft is None:
                    state.draft = self.drafter.start(pos)
                draft_rows.append(DraftRow(state.draft, state.pages, pos, None, len(rows), 1, 0))
            rows.append((seq_id, state, pos + 1))
            if state.error:
                errors[len(rows) - 1] = state.error
        if j != len(page_rows) or len(d.seq_ids) != len(d.start_pos):
            raise ValueError(
                "step plan: the decode rows' lists disagree (a page for a row that is not "
                "there, rows out of order, or more sequences than positions)"
            )
        return feeds

    def _state(self, seq_id: int) -> SeqState:
        state = self.seqs.get(seq_id)
        if state is None:
            raise ValueError(
                f"step plan: sequence {seq_id} is neither new in this plan nor held by this "
                "rank: the frontend and the rank disagree"
            )
        return state

    def draw(self, launched: Launched, previous: Launched | None) -> None:
        """Mask (once `previous`'s tokens are accepted) and draw the rows of a forward step."""
        logits, launched.logits = launched.logits, None
        if not launched.rows:
            return
        if launched.masked:
            self._mask(launched, logits, previous)
        self._draw(launched, logits)
        if launched.drawn is not None:
            self._accept(launched)

    def _new_state(self, p: wire_pb2.SamplingParams) -> SeqState:
        params = SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
            num_logprobs=p.num_logprobs,
        )
        if not p.HasField("grammar"):
            return SeqState(params)
        if self.grammars is None:
            raise ValueError("step plan: a sequence has a grammar, but this rank has no masks")
        return SeqState(params, grammar=self.grammars.start(p.grammar))

    def _mask(self, launched: Launched, logits: torch.Tensor, previous: Launched | None) -> None:
        """Mask the constrained rows once their matchers consumed every earlier sample."""
        if previous is not None:
            self._accept(previous)
        for i, (_, state, _) in enumerate(launched.rows):
            if state.grammar is not None and not _grammar_ready(state):
                launched.errors[i] = state.error
        self.grammars.mask(logits, [state.grammar for _, state, _ in launched.rows])

    def _accept(self, launched: Launched) -> None:
        """Feed the step's tokens to their sequences' matchers, once; a token a matcher
        refuses fails that sequence alone."""
        if launched.accepted or all(state.grammar is None for _, state, _ in launched.rows):
            return
        launched.accepted = True
        for i, ((_, state, pos), token) in enumerate(zip(launched.rows, self._token_ids(launched))):
            if state.grammar is None or i in launched.errors:
                continue
            try:
                state.grammar.accept(token, pos)
            except ValueError as e:
                launched.errors[i] = str(e)

    def _token_ids(self, launched: Launched) -> list[int]:
        if launched.drawn is not None:
            return [d.token_id for d in launched.drawn]
        launched.copied.synchronize()
        return launched.host.tolist()

    def _draw(self, launched: Launched, logits: torch.Tensor) -> None:
        params = [state.sampling for _, state, _ in launched.rows]
        if self.rank != 0:
            params = [dataclasses.replace(p, num_logprobs=-1) for p in params]
        positions = [pos for _, _, pos in launched.rows]
        try:
            self._draw_batch(launched, logits, params, positions)
        except Exception:  # one bad row must not end the step for the others
            log.exception("step %d: drawing the batch failed; drawing row by row", launched.step_id)
            self._draw_rows(launched, logits, params, positions)

    def _draw_rows(self, launched: Launched, logits, params, positions) -> None:
        drawn = []
        for i, (p, pos) in enumerate(zip(params, positions)):
            try:
                drawn += self.sample(logits[i : i + 1], [p], [pos])
            except Exception as e:  # noqa: BLE001 - reported for this row; the others go on
                launched.errors[i] = f"{type(e).__name__}: {e}"
                drawn.append(Sampled(0, float("nan"), ()))
        launched.drawn, launched.copied, launched.host = drawn, None, None
        ids = [d.token_id for d in drawn]
        launched.tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _draw_batch(self, launched: Launched, logits, params, positions) -> None:
        n = len(params)
        if self.sample_tokens is not None and all(p.num_logprobs < 0 for p in params):
            launched.tokens = self.sample_tokens(logits, params, positions)
            launched.host = self._host[self._next_host][:n]
            self._next_host ^= 1
            launched.host.copy_(launched.tokens, non_blocking=True)
            launched.copied = torch.cuda.Event(enable_timing=True)
            launched.copied.record()
            return
        launched.drawn = self.sample(logits, params, positions)
        ids = [d.token_id for d in launched.drawn]
        launched.tokens = torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _draft(self, launched: Launched, draws: list[int]) -> dict[int, list[int]]:
        """The drafter's proposals after the step's rows that ask, by their last sampling
        row's index; draws: the rows' tokens."""
        rows = launched.draft_rows
        if not rows:
            return {}
        for r in rows:
            r.failed = any(
                i in launched.errors for i in range(r.first_row, r.first_row + r.num_samples)
            )
        self.drafter.record(rows, draws)
        return {
            r.first_row + r.num_samples - 1: tokens
            for r, tokens in zip(rows, self.drafter.propose(rows))
            if tokens
        }

    def ready(self, launched: Launched) -> bool:
        """Whether finish() would return without waiting for the GPU."""
        return launched.copied is None or launched.copied.query()

    def finish(self, launched: Launched) -> wire_pb2.StepResult:
        result = wire_pb2.StepResult(step_id=launched.step_id, rank=self.rank)
        self._accept(launched)
        rows = launched.rows
        tokens = self._token_ids(launched) if rows else []
        proposals = self._draft(launched, tokens)
        for (_, state, _), token in zip(rows, tokens):
            state.last_token = token
        if self.rank == 0 and rows:
            # (a step sampled on the device asked for no logprobs: launched.drawn is None)
            if proposals or launched.errors or launched.drawn and _asks_logprobs(rows):
                drawn = launched.drawn or [Sampled(t, float("nan"), ()) for t in tokens]
                for i, ((seq_id, _, _), d) in enumerate(zip(rows, drawn)):
                    result.samples.append(
                        wire_pb2.Sample(
                            seq_id=seq_id,
                            token_id=d.token_id,
                            logprob=d.logprob,
                            top_token_ids=[t for t, _ in d.top],
                            top_logprobs=[lp for _, lp in d.top],
                            error=launched.errors.get(i, ""),
                            proposals=proposals.get(i, ()),
                        )
                    )
            else:  # tokens alone: packed (wire.proto StepResult.sample_seq_ids)
                result.sample_seq_ids.extend([seq_id for seq_id, _, _ in rows])
                result.sample_token_ids.extend(tokens)
        if launched.gpu_start is not None and launched.copied is not None:
            result.gpu_s = launched.gpu_start.elapsed_time(launched.copied) / 1e3
        result.execute_s = time.perf_counter() - launched.started
        result.idle_before_s = launched.idle_before_s
        return result


def _asks_logprobs(rows: list[tuple[int, SeqState, int]]) -> bool:
    return any(state.sampling.num_logprobs >= 0 for _, state, _ in rows)


def _replays_output(s: wire_pb2.SeqStep, state: SeqState) -> bool:
    """Whether s brings output tokens its matcher has not consumed (a recompute): only then
    must the launch wait for the grammar; a prompt chunk goes on while it compiles."""
    g = state.grammar
    return g is not None and s.start_pos + len(s.token_ids) > g.next_pos


def _grammar_ready(state: SeqState) -> bool:
    """Wait for the sequence's grammar to compile; False when it has none or its schema failed
    to compile (the sequence then fails: state.error says why, in each of its samples)."""
    if state.grammar is None:
        return False
    try:
        state.grammar.wait()
    except GrammarError as e:  # fails this sequence, not the rank
        state.grammar, state.error = None, f"grammar: {e}"
        return False
    return True


def _num_samples(s: wire_pb2.SeqStep, state: SeqState, num_tokens: int) -> int:
    """The step's sampling rows for s: 0, 1, or a verification row's num_samples."""
    if not s.sample:
        return 0
    m = max(s.num_samples, 1)
    if m > 1 and (m > num_tokens or state.grammar is not None):
        raise ValueError(
            f"step plan: sequence {s.seq_id} samples {m} of its {num_tokens} tokens"
            + (" with a grammar, whose matcher cannot take proposals" if m <= num_tokens else "")
        )
    return m


def _input_tokens(s: wire_pb2.SeqStep, state: SeqState) -> list[int]:
    if not s.follows_sample:
        return list(s.token_ids)
    return [_last_token(s.seq_id, state)]


def _last_token(seq_id: int, state: SeqState) -> int:
    if state.last_token is None:
        raise ValueError(
            f"step plan: sequence {seq_id} follows a sample, but this rank has sampled none "
            "for it since it was added: the frontend and the rank disagree"
        )
    return state.last_token
