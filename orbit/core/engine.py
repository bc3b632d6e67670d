"""The engine core's engine: admits sequences into the scheduler, runs the step loop against the
ranks, and hands each step's new tokens to the sequences' owners, once per step per owner.

An owner (a `Sink`) is an API server process (orbit/core/api_link.py), or, in this process, a
caller of `generate` (tests, benchmarks). Each owner names its sequences with keys of its own;
every step, each owner with sequences in it gets one `StepOutputs` message (proto/core.proto),
built in place, so an API server receives one message per step whatever its number of streams.

The loop keeps up to two steps in flight (EngineConfig.overlap): right after sending step N
it schedules and sends N+1 without waiting for N's samples, so the ranks find the next plan
waiting when they finish one; when N's result arrives it is applied and N+2 is sent. With many
sequences running it keeps three (EngineConfig.three_ahead_min_running): N+3 is planned while
rank 0 launches N+2 and reports N+1, not between the two. Steps are sent and applied in order.
A token that N samples is not known here when N+1 is planned: N+1 tells the ranks to feed the
token each sampled itself (follows_sample, see runtime/scheduler.py). Everything runs on one
asyncio event loop, so the scheduler is never touched from two places at once.

A request can fail only itself: a sequence whose part of a plan cannot be built, or whose draw
fails on the ranks, ends alone with ERROR_SEQUENCE_FAILED. A step loop that dies of a bug fails
the engine (every sequence ends with ERROR_ENGINE_FAILED, `is_ready` turns false) and logs why.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from orbit.core.rank_link import PackageMismatch, RankFailure, RankLink
from proto import core_pb2, wire_pb2
from proto.outputs import seq_outputs
from runtime.scheduler import CapacityError, Scheduler, SchedulerConfig, Sequence, Status, Step
from runtime.spec import token_bucket
from runtime.speculation import SpeculationConfig

log = logging.getLogger("orbit.core.engine")

_UINT64_MASK = (1 << 64) - 1
_FINISH = {"stop": core_pb2.FINISH_STOP, "length": core_pb2.FINISH_LENGTH}


class Refused(Exception):
    """A sequence the engine will not admit; `kind` is its core_pb2.ErrorKind."""

    def __init__(self, kind: int, message: str):
        super().__init__(message)
        self.kind = kind


class EngineError(Exception):
    """The ranks failed or the engine stopped; nothing can be served."""


class SequenceFailed(Exception):
    """The in-process `generate` of a sequence that ended with an error (its output says
    which kind)."""

    def __init__(self, output: core_pb2.SeqOutput):
        super().__init__(output.error_message)
        self.output = output


@dataclass(frozen=True)
class EngineConfig:
    max_seq_len: int
    max_batch: int
    page_size: int
    max_step_tokens: int
    eos_token_ids: tuple[int, ...]
    step_timeout_s: float = 60.0
    # Sequences waiting for their first step beyond this are refused (ERROR_OVERLOADED, 429),
    # so a flood costs bounded memory.
    max_queue: int = 1024
    # Plan and send the next step while the last one runs (two in flight), so the ranks do not
    # wait for the core between steps. False: one step at a time (benchmarks compare).
    overlap: bool = True
    # With overlap, no speculation and at least this many sequences running, three steps in
    # flight. With two, the host's chain between two steps (rank 0 reports N, the core applies
    # it and plans N+2, rank 0 stages N+2) must fit in one GPU step. With three, the core
    # plans while rank 0 stages and reports, so the GPU waits only when either one alone
    # outlasts a step: a margin for short steps and slow links (TP across hosts). On an H100
    # the 256-row FP8 step (12.6 ms) outlasts the 1.6 ms chain, and two or three gave the same
    # interval (docs/performance.md, 2026-12-06 15:48). Few sequences keep two: a new request
    # would wait one more step to join, and their chain is short. Speculation keeps two: a
    # verification row is chained behind at most one in flight (runtime/scheduler.py). 0:
    # never three.
    three_ahead_min_running: int = 64
    # Automatic prefix caching (runtime/prefix_cache.py); cache_salt names the package's KV.
    prefix_cache: bool = True
    cache_salt: bytes = b""
    # Speculative decoding (runtime/speculation.py); None: off.
    speculation: SpeculationConfig | None = None
    # A sequence's tokens go to its owner once this many have gathered or on every this-many-th
    # step (its first token, its last and an error at once): above 1, each API server gets a
    # message and writes a stream once per that many steps instead of every step, for less
    # CPU per token at many streams.
    stream_interval: int = 1
    # The package's prefill token buckets (capacities.prefill_chunk_sizes): the scheduler cuts
    # a step's prompt chunks to end on one where that spares padding (runtime/scheduler.py),
    # and the core counts the tokens a GPU computes in steps with prompt chunks, padding
    # included; (): neither.
    token_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream interval must be 1 or more, got {self.stream_interval}")


@dataclass(eq=False)
class Sink:
    """An owner of sequences: `deliver` gets each step's outputs of its sequences in one call.
    `live` maps the owner's keys to its sequences that have not ended (the engine keeps it)."""

    live: dict[int, Sequence] = field(default_factory=dict)

    def deliver(self, outputs: core_pb2.StepOutputs) -> None:
        raise NotImplementedError


@dataclass(eq=False, slots=True)
class _Owner:
    sink: Sink
    key: int
    logprobs: bool
    sent_at: float = 0.0  # when the API server sent it (its monotonic clock, this host's)
    arrived_s: float = 0.0  # when the core took it (time.monotonic)
    planned_s: float | None = None  # when the plan of its first step went to the ranks
    held: int = 0  # its latest tokens not yet delivered (EngineConfig.stream_interval)
    held_samples: list = field(default_factory=list)  # their samples, when it wants logprobs


class _Queues(Sink):
    """In-process owner: each sequence's outputs go to an asyncio queue of its own."""

    def __init__(self):
        super().__init__()
        self.queues: dict[int, asyncio.Queue] = {}

    def deliver(self, outputs: core_pb2.StepOutputs) -> None:
        for out in seq_outputs(outputs):
            queue = self.queues.get(out.seq_key)
            if queue is not None:
                queue.put_nowait(out)


class Engine:
    def __init__(self, config: EngineConfig, link: RankLink | None):
        self.config = config
        self.link = link
        self.scheduler: Scheduler | None = None
        self._owners: dict[int, _Owner] = {}  # seq_id -> who gets its outputs
        self._wake = asyncio.Event()
        self._seq_ids = itertools.count(1)
        self._ready = False
        self._error: EngineError | None = None
        self._stopping = False
        self._local = _Queues()
        self._local_keys = itertools.count(1)
        self.steps = 0
        self.step_tokens = 0  # tokens the answered steps computed (prompt chunks and decode rows)
        self.gpu_seconds = 0.0  # rank 0's GPU time in them (StepResult.gpu_s; 0 on the CPU)
        # The same three for the steps that computed part of a prompt (beside any decode rows),
        # and the steps of decode rows alone: whether a workload's steps are fewer-rowed or
        # more mixed. (The rest only release sequences' state and compute nothing.)
        self.prompt_steps = self.prompt_step_tokens = self.decode_steps = 0
        self.prompt_bucket_tokens = 0  # the token buckets those steps replay on a GPU
        self.prompt_gpu_seconds = 0.0
        self.step_seconds = 0.0  # wall time with a step in flight, each second counted once
        # Time rank 0 sat with nothing queued while this engine was preparing the next step.
        self.rank_wait_seconds = 0.0
        self._last_result_at = 0.0
        # Averages of a step's time on rank 0 and of the ranks' idle before a step sent the
        # moment the one before answered with nothing else in flight (the round trip a
        # speculating sequence waits through): the scheduler's guess_min_rate.
        self.step_cost_s = self.round_trip_s = 0.0
        self._after_result = False  # the loop has not waited for work since the last result
        self._sent_on_result: set[int] = set()  # steps sent then with nothing else in flight
        # Rank 0's (execute_s, gpu_s) of the latest steps, for benchmarks.
        self.recent_timings: deque[tuple[float, float]] = deque(maxlen=4096)

    # ---- what owners call ------------------------------------------------------------------
    def is_ready(self) -> bool:
        return self._ready and self._error is None and not self._stopping

    def submit(
        self,
        sink: Sink,
        key: int,
        prompt_ids,
        max_tokens: int,
        sampling: wire_pb2.SamplingParams,
        ignore_eos: bool = False,
        sent_at: float = 0.0,
    ) -> None:
        """Admit one sequence; raises Refused. Its outputs go to sink.deliver under key.
        sent_at: when its API server sent it (time.monotonic there), for its first output's
        timing."""
        arrived_s = time.monotonic()
        self._check_serving()
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise Refused(
                core_pb2.ERROR_OVERLOADED,
                f"{len(self.scheduler.waiting)} requests are already queued",
            )
        if not prompt_ids:
            raise Refused(core_pb2.ERROR_TOO_LARGE, "the prompt is empty")
        if key in sink.live:
            raise Refused(core_pb2.ERROR_TOO_LARGE, f"sequence key {key} is already in use")
        if sampling.HasField("grammar"):  # the ranks' matchers consume the tokens after it
            sampling.grammar.num_prompt_tokens = len(prompt_ids)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            prompt_ids=list(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=frozenset() if ignore_eos else frozenset(self.config.eos_token_ids),
            has_grammar=sampling.HasField("grammar"),
        )
        try:
            self.scheduler.add(seq)
        except CapacityError as e:
            raise Refused(core_pb2.ERROR_TOO_LARGE, str(e)) from None
        sink.live[key] = seq
        self._owners[seq.seq_id] = _Owner(
            sink, key, sampling.num_logprobs >= 0, sent_at or arrived_s, arrived_s
        )
        self._wake.set()

    def abort(self, sink: Sink, key: int) -> None:
        """End a sequence early (its client went away); its pages are released with the next
        step. Unknown keys (already ended) are ignored."""
        seq = sink.live.pop(key, None)
        if seq is not None:
            self._owners.pop(seq.seq_id, None)
            if self.scheduler is not None and seq.status is not Status.FINISHED:
                self.scheduler.abort(seq)
                self._wake.set()

    def drop(self, sink: Sink) -> None:
        """An owner is gone (an API server died): abort every sequence it had."""
        for key in list(sink.live):
            self.abort(sink, key)

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: wire_pb2.SamplingParams,
        ignore_eos: bool = False,
    ) -> AsyncIterator[core_pb2.SeqOutput]:
        """In-process: yield each step's output of one sequence; raises Refused at admission
        and SequenceFailed when it ends with an error. Closing the iterator early aborts it."""
        key = next(self._local_keys)
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(self._local, key, prompt_ids, max_tokens, sampling, ignore_eos)
        self._local.queues[key] = queue
        try:
            while True:
                out = await queue.get()
                if out.error:
                    raise SequenceFailed(out)
                yield out
                if out.finish:
                    return
        finally:
            self._local.queues.pop(key, None)
            self.abort(self._local, key)

    def metrics_text(self) -> str:
        s = self.scheduler
        lines = ["# TYPE orbit_ready gauge", f"orbit_ready {int(self.is_ready())}"]
        if s is not None:
            lines += [
                "# TYPE orbit_queue_length gauge",
                f"orbit_queue_length {len(s.waiting)}",
                "# TYPE orbit_running_sequences gauge",
                f"orbit_running_sequences {len(s.running)}",
                "# TYPE orbit_kv_pages_in_use gauge",
                f"orbit_kv_pages_in_use {s.pages_in_use}",
                "# TYPE orbit_kv_pages_total gauge",
                f"orbit_kv_pages_total {s.config.num_pages}",
                "# TYPE orbit_preemptions_total counter",
                f"orbit_preemptions_total {s.num_preemptions}",
            ]
            if s.cache is not None:
                c = s.cache
                rate = c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
                lines += [
                    "# HELP orbit_prefix_cache_pages KV pages holding a cached prefix.",
                    "# TYPE orbit_prefix_cache_pages gauge",
                    f"orbit_prefix_cache_pages {c.num_pages}",
                    "# HELP orbit_prefix_cache_hit_tokens_total Prompt tokens served from cache.",
                    "# TYPE orbit_prefix_cache_hit_tokens_total counter",
                    f"orbit_prefix_cache_hit_tokens_total {c.hit_tokens}",
                    "# HELP orbit_prefix_cache_prompt_tokens_total Prompt tokens admitted.",
                    "# TYPE orbit_prefix_cache_prompt_tokens_total counter",
                    f"orbit_prefix_cache_prompt_tokens_total {c.prompt_tokens}",
                    "# HELP orbit_prefix_cache_evictions_total Cached pages reused for others.",
                    "# TYPE orbit_prefix_cache_evictions_total counter",
                    f"orbit_prefix_cache_evictions_total {c.evictions}",
                    "# HELP orbit_prefix_cache_hit_rate Hit tokens / prompt tokens since start.",
                    "# TYPE orbit_prefix_cache_hit_rate gauge",
                    f"orbit_prefix_cache_hit_rate {rate:.6f}",
                ]
        if s is not None and s.config.speculation is not None:
            rows = s.spec_verifications
            mean = s.spec_tokens / rows if rows else 0.0
            lines += [
                "# HELP orbit_spec_proposed_tokens_total Proposed tokens sent for verification.",
                "# TYPE orbit_spec_proposed_tokens_total counter",
                f"orbit_spec_proposed_tokens_total {s.spec_proposed}",
                "# HELP orbit_spec_accepted_tokens_total Proposed tokens kept.",
                "# TYPE orbit_spec_accepted_tokens_total counter",
                f"orbit_spec_accepted_tokens_total {s.spec_kept}",
                "# HELP orbit_spec_verifications_total Verification rows run.",
                "# TYPE orbit_spec_verifications_total counter",
                f"orbit_spec_verifications_total {rows}",
                "# HELP orbit_spec_mean_acceptance_length Output tokens per verification row.",
                "# TYPE orbit_spec_mean_acceptance_length gauge",
                f"orbit_spec_mean_acceptance_length {mean:.6f}",
                "# HELP orbit_spec_waits_total Decodes held back a step to propose after a draw.",
                "# TYPE orbit_spec_waits_total counter",
                f"orbit_spec_waits_total {s.spec_waits}",
                "# HELP orbit_spec_guess_min_rate Right guesses needed to guess alone, not wait.",
                "# TYPE orbit_spec_guess_min_rate gauge",
                f"orbit_spec_guess_min_rate {s.guess_min_rate:.6f}",
            ]
        if self.link is not None:
            lines += [
                "# TYPE orbit_rank_messages_dropped_total counter",
                f"orbit_rank_messages_dropped_total {self.link.dropped_messages}",
            ]
        lines += [
            "# TYPE orbit_steps_total counter",
            f"orbit_steps_total {self.steps}",
            "# HELP orbit_step_tokens_total Tokens computed by the steps (prompt and decode).",
            "# TYPE orbit_step_tokens_total counter",
            f"orbit_step_tokens_total {self.step_tokens}",
            "# HELP orbit_gpu_seconds_total Rank 0's GPU time in the steps (0 on the CPU).",
            "# TYPE orbit_gpu_seconds_total counter",
            f"orbit_gpu_seconds_total {self.gpu_seconds:.6f}",
            "# HELP orbit_prompt_steps_total Steps that computed part of a prompt.",
            "# TYPE orbit_prompt_steps_total counter",
            f"orbit_prompt_steps_total {self.prompt_steps}",
            "# HELP orbit_prompt_step_tokens_total Tokens those steps computed (with decode rows).",
            "# TYPE orbit_prompt_step_tokens_total counter",
            f"orbit_prompt_step_tokens_total {self.prompt_step_tokens}",
            "# HELP orbit_prompt_gpu_seconds_total Rank 0's GPU time in those steps.",
            "# TYPE orbit_prompt_gpu_seconds_total counter",
            f"orbit_prompt_gpu_seconds_total {self.prompt_gpu_seconds:.6f}",
            "# HELP orbit_prompt_step_bucket_tokens_total Their graphs' token buckets (padded).",
            "# TYPE orbit_prompt_step_bucket_tokens_total counter",
            f"orbit_prompt_step_bucket_tokens_total {self.prompt_bucket_tokens}",
            "# HELP orbit_decode_steps_total Steps of decode rows alone.",
            "# TYPE orbit_decode_steps_total counter",
            f"orbit_decode_steps_total {self.decode_steps}",
            "# TYPE orbit_step_seconds_total counter",
            f"orbit_step_seconds_total {self.step_seconds:.6f}",
            "# HELP orbit_rank_wait_seconds_total Rank 0 idle, waiting for a step being planned.",
            "# TYPE orbit_rank_wait_seconds_total counter",
            f"orbit_rank_wait_seconds_total {self.rank_wait_seconds:.6f}",
        ]
        return "\n".join(lines) + "\n"

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, ready_timeout_s: float, link: RankLink | None = None) -> None:
        """Wait for every rank, then size the scheduler from the smallest KV pool. With a new
        link (ranks restarted after a failure) the engine serves again from a clean state."""
        if link is not None:
            self.link, self._error, self._ready = link, None, False
        await self.link.wait_ready(ready_timeout_s)
        c = self.config
        drafts = c.speculation is not None and c.speculation.method == "draft"
        if drafts and not self.link.ranks[0].ready.draft_digest:
            raise PackageMismatch(
                "--speculate draft, but rank 0 has no draft package; start the ranks with "
                "one (orbit up --draft PACKAGE) or serve with --speculate ngram or off",
                rank=0,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=self.link.num_kv_pages,
                page_size=c.page_size,
                max_batch=c.max_batch,
                max_step_tokens=c.max_step_tokens,
                max_seq_len=c.max_seq_len,
                prefix_cache=c.prefix_cache,
                cache_salt=c.cache_salt,
                speculation=c.speculation,
                exact_rows=self.link.exact_rows,
                token_buckets=c.token_buckets,
            )
        )
        self._ready = True

    def begin_stopping(self) -> None:
        """Refuse new sequences; running ones continue until they finish."""
        self._stopping = True

    @property
    def error(self) -> EngineError | None:
        """Why the engine stopped serving, once it has."""
        return self._error

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def idle(self) -> bool:
        return not self._owners

    def fail(self, error: EngineError) -> None:
        """End every sequence with `error`; the engine serves nothing more."""
        if self._error is None:
            self._error = error
            if not self._stopping:
                log.error("engine failed: %s", error)
        by_sink: dict[Sink, core_pb2.StepOutputs] = {}
        for owner in self._owners.values():
            outputs = by_sink.get(owner.sink) or by_sink.setdefault(
                owner.sink, core_pb2.StepOutputs()
            )
            outputs.outputs.add(
                seq_key=owner.key,
                finish=core_pb2.FINISH_ERROR,
                error=core_pb2.ERROR_ENGINE_FAILED,
                error_message=str(error),
            )
            owner.sink.live.pop(owner.key, None)
        self._owners.clear()
        for sink, outputs in by_sink.items():
            sink.deliver(outputs)
        self._wake.set()

    async def run(self) -> None:
        """The step loop; returns when the engine fails or is closed. A loop that dies of a bug
        fails the engine (every sequence ends, `is_ready` false) and says so in the log, so the
        server never looks healthy over a wedge."""
        try:
            await self._loop()
        except Exception as e:  # logged with its traceback, then the engine fails
            log.exception("the step loop failed")
            self.fail(EngineError(f"the step loop failed: {type(e).__name__}: {e}"))

    # ---- internals -------------------------------------------------------------------------
    async def _loop(self) -> None:
        # (step, its future, sent at, whether another step was in flight when it was sent)
        in_flight: deque[tuple[Step, asyncio.Future, float, bool]] = deque()
        try:
            while self._error is None:
                if len(in_flight) < self._steps_ahead() and self._send_next(in_flight):
                    continue
                if not in_flight:
                    self._after_result = False
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    step, result = await self._next_result(in_flight)
                except RankFailure as e:
                    self.fail(EngineError(str(e)))
                    return
                self._deliver(step, result)
                self._after_result = True
        finally:
            for step, fut, _, _ in in_flight:
                self.link.abandon(step.step_id, fut)

    def _steps_ahead(self) -> int:
        """How many steps may be in flight now (EngineConfig.overlap, three_ahead_min_running)."""
        c = self.config
        if not c.overlap:
            return 1
        least = c.three_ahead_min_running
        if least and c.speculation is None and len(self.scheduler.running) >= least:
            return 3
        return 2

    def _note_round_trip(self, result: wire_pb2.StepResult) -> None:
        """A decode step sent on the last result's account with nothing else in flight: the
        ranks' idle before it is the round trip a waiting sequence pays. Averaged with the
        step's time (over about 16 of each), it sets when a sequence decoding alone guesses
        rather than waits: when its guesses are right more often than 1 - round trip / step."""
        first = not self.step_cost_s
        for name, value in (
            ("step_cost_s", result.execute_s),
            ("round_trip_s", result.idle_before_s),
        ):
            old = getattr(self, name)
            setattr(self, name, value if first else old + (value - old) / 16)
        if self.step_cost_s > 0:
            rate = 1.0 - self.round_trip_s / self.step_cost_s
            self.scheduler.guess_min_rate = min(max(rate, 0.0), 0.95)

    def _check_serving(self) -> None:
        if self._error is not None:
            raise Refused(core_pb2.ERROR_ENGINE_FAILED, str(self._error))
        if self._stopping:
            raise Refused(core_pb2.ERROR_STOPPING, "the server is shutting down")
        if not self._ready:
            raise Refused(core_pb2.ERROR_NOT_READY, "the model is still loading")

    def _send_next(self, in_flight: deque) -> bool:
        step = self.scheduler.schedule()
        if step is None:
            return False
        plan = wire_pb2.StepPlan(step_id=step.step_id, release_seq_ids=step.released)
        planned_s = time.monotonic()
        rows = []
        for chunk in step.chunks:
            # A row the plan carries packed (wire.proto DecodeRows): it follows a sample, draws
            # once, asks for no draft tokens, and its sequence is known to the ranks. Nothing
            # in it can fail (write_decode_rows).
            if chunk.follows_sample and chunk.sample and not chunk.draft and not chunk.is_new:
                rows.append(chunk)
                continue
            try:
                _add_chunk(plan, chunk)
            except Exception as e:  # this sequence alone fails
                log.exception("planning sequence %d failed", chunk.seq.seq_id)
                self._fail_sequence(
                    chunk.seq, f"planning failed: {type(e).__name__}: {e}", step.step_id
                )
                continue
            # (is_new: a sequence's first chunk, or its first after a preemption)
            owner = self._owners.get(chunk.seq.seq_id) if chunk.is_new else None
            if owner is not None and owner.planned_s is None:
                owner.planned_s = planned_s
        if rows:
            write_decode_rows(plan, rows)
        busy = bool(in_flight)
        if not busy and self._after_result and self.config.speculation is not None:
            self._sent_on_result.add(step.step_id)
        in_flight.append((step, self.link.submit(plan), time.perf_counter(), busy))
        return True

    def _fail_sequence(self, seq: Sequence, why: str, left_out_of: int | None = None) -> None:
        """End one sequence with an error; its pages are released with the next step.
        left_out_of: the step whose plan was sent without it."""
        self.scheduler.abort(seq, left_out_of)
        owner = self._owners.pop(seq.seq_id, None)
        if owner is not None:
            owner.sink.live.pop(owner.key, None)
            outputs = core_pb2.StepOutputs()
            outputs.outputs.add(
                seq_key=owner.key,
                finish=core_pb2.FINISH_ERROR,
                error=core_pb2.ERROR_SEQUENCE_FAILED,
                error_message=why,
            )
            owner.sink.deliver(outputs)

    async def _next_result(self, in_flight: deque) -> tuple[Step, wire_pb2.StepResult]:
        step, fut, sent_at, busy = in_flight.popleft()
        result = await self.link.result(step.step_id, fut, self.config.step_timeout_s)
        if busy:  # the ranks had work queued from here: any idle before this step was ours
            self.rank_wait_seconds += result.idle_before_s
        elif step.step_id in self._sent_on_result:
            self._sent_on_result.discard(step.step_id)
            if not step.prompt_tokens:  # a prompt chunk's time is no decode step's
                self._note_round_trip(result)
        now = time.perf_counter()
        # A step's time starts when it was sent or when the one before it answered, whichever
        # is later, so that the overlapping steps' times add up to the time spent stepping.
        self.step_seconds += now - max(sent_at, self._last_result_at)
        self._last_result_at = now
        self.steps += 1
        self.step_tokens += step.num_tokens
        self.gpu_seconds += result.gpu_s
        if step.prompt_tokens:
            self.prompt_steps += 1
            self.prompt_step_tokens += step.num_tokens
            self.prompt_gpu_seconds += result.gpu_s
            if self.config.token_buckets:
                self.prompt_bucket_tokens += token_bucket(
                    self.config.token_buckets, step.num_tokens
                )
        elif step.num_tokens:
            self.decode_steps += 1
        self.recent_timings.append((result.execute_s, result.gpu_s))
        return step, result

    def _deliver(self, step: Step, result: wire_pb2.StepResult) -> None:
        verifies = self.config.speculation is not None and step.verifies  # (none without)
        if result.sample_seq_ids:  # tokens alone, packed: no logprobs, errors or proposals
            samples, drafted = {}, {}
            pairs = zip(result.sample_seq_ids, result.sample_token_ids, strict=True)
            tokens = _verification_tokens(pairs) if verifies else dict(pairs)
        else:
            if verifies:
                samples, tokens = _verification_samples(result.samples)
            else:
                samples = {s.seq_id: s for s in result.samples}
                tokens = {s.seq_id: s.token_id for s in result.samples}
            for s in result.samples:
                if s.error:
                    self._sample_failed(s)
            drafted = {s.seq_id: s.proposals for s in result.samples if s.proposals}
        owners, by_sink, interval = self._owners, {}, self.config.stream_interval
        # Every stream's held tokens go out on the same steps (every interval-th, and a
        # stream's first and last token at once), so that an owner gets one message per
        # interval steps rather than one per step for whichever streams filled up in it.
        due = self.steps % interval == 0
        for seq in self.scheduler.apply(step, tokens, drafted):
            owner = owners.get(seq.seq_id)
            if owner is None:
                continue
            new = seq.new_tokens
            if owner.logprobs:
                picked = samples[seq.seq_id]
                owner.held_samples += picked[:new] if verifies else (picked,)
            n = owner.held = owner.held + new
            first = len(seq.output_ids) == n
            if not (n and due) and n < interval and not first and seq.finish_reason is None:
                continue
            batch = by_sink.get(owner.sink)
            if batch is None:
                batch = by_sink[owner.sink] = _SinkOutputs()
            if n == 1 and not first and seq.finish_reason is None and not owner.logprobs:
                batch.keys.append(owner.key)  # packed (StepOutputs.next_keys)
                batch.tokens.append(seq.output_ids[-1])
                owner.held = 0
                continue
            outputs = batch.outputs
            ids = (seq.output_ids[-1],) if n == 1 else seq.output_ids[-n:]
            out = outputs.outputs.add(seq_key=owner.key, token_ids=ids)
            owner.held = 0
            if first:
                out.cached_tokens = seq.cached_tokens or 0
                _first_token_timing(out.first_token, owner, result)
            if owner.logprobs:
                for s in owner.held_samples:
                    out.logprobs.append(s.logprob)
                    out.top.add(token_ids=s.top_token_ids, logprobs=s.top_logprobs)
                owner.held_samples.clear()
            if seq.finish_reason is not None:
                out.finish = _FINISH[seq.finish_reason]
                del owners[seq.seq_id]
                owner.sink.live.pop(owner.key, None)
        for sink, batch in by_sink.items():
            batch.outputs.next_keys.extend(batch.keys)
            batch.outputs.next_tokens.extend(batch.tokens)
            sink.deliver(batch.outputs)

    def _sample_failed(self, sample: wire_pb2.Sample) -> None:
        owner = self._owners.get(sample.seq_id)
        seq = owner.sink.live.get(owner.key) if owner else None
        if seq is not None and seq.status is Status.RUNNING:
            log.error("sampling sequence %d failed on the ranks: %s", seq.seq_id, sample.error)
            self._fail_sequence(seq, f"sampling failed: {sample.error}")


class _SinkOutputs:
    """One owner's outputs of a step while _deliver builds them: the packed ones gathered in
    lists and added to the message at once."""

    __slots__ = ("keys", "outputs", "tokens")

    def __init__(self):
        self.outputs = core_pb2.StepOutputs()
        self.keys: list[int] = []
        self.tokens: list[int] = []


def _first_token_timing(
    timing: core_pb2.FirstTokenTiming, owner: _Owner, result: wire_pb2.StepResult
) -> None:
    now_s = time.monotonic()
    planned_s = owner.planned_s if owner.planned_s is not None else now_s
    timing.sent_at = owner.sent_at
    timing.to_core_s = max(owner.arrived_s - owner.sent_at, 0.0)
    timing.queued_s = planned_s - owner.arrived_s
    timing.prefill_s = now_s - planned_s
    timing.rank_s = result.execute_s
    timing.gpu_s = result.gpu_s


def random_seed() -> int:
    return secrets.randbits(64)


def seed_of(seed: int | None) -> int:
    """The wire seed of a request's: any int64 maps to a distinct uint64 (two's complement),
    so -1 and 2**63 - 1 differ; None draws one."""
    return random_seed() if seed is None else seed & _UINT64_MASK


def _verification_samples(samples) -> tuple[dict, dict]:
    """A step's samples by sequence (a verification row has several, in position order), and
    what Scheduler.apply takes: each sequence's token, or its verification row's tokens."""
    by_seq: dict[int, list] = {}
    for s in samples:
        by_seq.setdefault(s.seq_id, []).append(s)
    return by_seq, _verification_tokens((s.seq_id, s.token_id) for s in samples)


def _verification_tokens(pairs) -> dict:
    """What Scheduler.apply takes from a verification step's (seq_id, token) pairs: each
    sequence's token, or its verification row's tokens in position order."""
    by_seq: dict[int, list[int]] = {}
    for seq_id, token in pairs:
        by_seq.setdefault(seq_id, []).append(token)
    return {seq_id: ts if len(ts) > 1 else ts[0] for seq_id, ts in by_seq.items()}


def write_decode_rows(plan: wire_pb2.StepPlan, rows: list) -> None:
    """A plan's packed decode rows (chunks, in the step's order), one protobuf call per field
    rather than one message per row. Nothing here can be out of the wire's range (positions
    below max_seq_len, pages below the pool's size), as for a decode row's SeqStep in
    _add_chunk."""
    d = plan.decode
    d.seq_ids.extend([c.seq.seq_id for c in rows])
    d.start_pos.extend([c.start_pos for c in rows])
    for row, c in enumerate(rows):
        if c.new_pages:  # about one row in page_size a step
            d.page_rows.extend([row] * len(c.new_pages))
            d.new_pages.extend(c.new_pages)


def _add_chunk(plan: wire_pb2.StepPlan, c) -> None:
    """Append one sequence's part of a step; a failure leaves the plan without it."""
    # Checked before anything is added, so a value the wire cannot hold leaves no half entry.
    step = (
        wire_pb2.SeqStep(
            seq_id=c.seq.seq_id,
            token_ids=c.token_ids,
            start_pos=c.start_pos,
            new_pages=c.new_pages,
            sample=c.sample,
            follows_sample=c.follows_sample,
            num_samples=c.num_samples if c.verifies else 0,
            draft_tokens=c.draft,
        )
        if not c.follows_sample
        else None
    )
    if c.is_new:
        plan.new_seqs.add(seq_id=c.seq.seq_id, sampling=c.seq.sampling)
    if step is None:  # a decode row: nothing in it can be out of range
        plan.seqs.add(
            seq_id=c.seq.seq_id, start_pos=c.start_pos, new_pages=c.new_pages,
            sample=c.sample, follows_sample=True, draft_tokens=c.draft,
        )  # fmt: skip
    else:
        plan.seqs.append(step)
