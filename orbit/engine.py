"""The frontend's engine: admits requests into the scheduler, runs the step loop against the
ranks, and streams each sequence's tokens back to its HTTP handler.

The loop keeps up to two steps in flight (EngineConfig.overlap): right after sending step N
it schedules and sends N+1 without waiting for N's samples, so the ranks find the next plan
waiting when they finish one; when N's result arrives it is applied and N+2 is sent. Steps are
sent and applied in order. A token that N samples is not known to the frontend when N+1 is
planned: N+1 tells the ranks to feed the token each sampled itself (follows_sample, see
runtime/scheduler.py). Handlers and the loop share one asyncio event loop, so the scheduler is
never touched from two places at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from orbit.rank_link import RankFailure, RankLink
from proto import wire_pb2
from runtime import sampling
from runtime.scheduler import CapacityError, Scheduler, SchedulerConfig, Sequence, Status, Step

log = logging.getLogger("orbit.engine")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob and k alternatives
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None  # None while running; "stop" (EOS) or "length" on the last event


class EngineError(Exception):
    """The ranks failed or the engine stopped; requests cannot be served (503)."""


class EngineNotReady(EngineError):
    """The ranks are still starting (503)."""


class EngineOverloaded(EngineError):
    """The admission queue is full (429 with Retry-After)."""


class RequestTooLarge(ValueError):
    """A request that can never fit the package's prepared capacities (400)."""


class SequenceFailed(Exception):
    """Planning or sampling this one sequence failed; the engine and other requests go on."""


@dataclass(frozen=True)
class EngineConfig:
    model_name: str
    max_seq_len: int
    max_batch: int
    page_size: int
    max_step_tokens: int
    eos_token_ids: tuple[int, ...]
    step_timeout_s: float = 60.0
    # Requests waiting for their first step beyond this are refused with 429, so a flood
    # costs bounded memory.
    max_queue: int = 1024
    # Plan and send the next step while the last one runs (two in flight), so the ranks do not
    # wait for the frontend between steps. False: one step at a time (benchmarks compare).
    overlap: bool = True

    @property
    def max_steps_in_flight(self) -> int:
        return 2 if self.overlap else 1


class Engine:
    def __init__(self, config: EngineConfig, link: RankLink, tokenizer):
        self.config = config
        self.link = link
        self.tokenizer = tokenizer
        self.scheduler: Scheduler | None = None
        self._streams: dict[int, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._seq_ids = itertools.count(1)
        self._ready = False
        self._error: EngineError | None = None
        self._stopping = False
        self.steps = 0
        self.step_seconds = 0.0  # wall time with a step in flight, each second counted once
        self._last_result_at = 0.0
        # Rank 0's (execute_s, gpu_s) of the latest steps, for benchmarks.
        self.recent_timings: deque[tuple[float, float]] = deque(maxlen=4096)

    # ---- the interface the HTTP layer uses ---------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.config.eos_token_ids)

    def is_ready(self) -> bool:
        return self._ready and self._error is None and not self._stopping

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Yield one TokenEvent per generated token. Closing the iterator early aborts the
        sequence; its KV pages are released with the next step."""
        self._check_serving()
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are already queued")
        seq = self._sequence(prompt_ids, params)
        try:  # what the plan will carry: a value the wire cannot hold is refused here
            _wire_sampling(seq)
        except (ValueError, TypeError) as e:
            raise RequestTooLarge(f"a sampling parameter is out of range ({e})") from None
        scheduler = self.scheduler  # after a rank failure and restart, a new one takes over
        try:
            scheduler.add(seq)
        except CapacityError as e:
            raise RequestTooLarge(str(e)) from None
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[seq.seq_id] = queue
        self._wake.set()
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self._streams.pop(seq.seq_id, None)
            if seq.status is not Status.FINISHED:
                scheduler.abort(seq)
                self._wake.set()

    def metrics_text(self) -> str:
        s = self.scheduler
        lines = [
            "# TYPE orbit_ready gauge",
            f"orbit_ready {int(self.is_ready())}",
        ]
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
        if self.link is not None:
            lines += [
                "# TYPE orbit_rank_messages_dropped_total counter",
                f"orbit_rank_messages_dropped_total {self.link.dropped_messages}",
            ]
        lines += [
            "# TYPE orbit_steps_total counter",
            f"orbit_steps_total {self.steps}",
            "# TYPE orbit_step_seconds_total counter",
            f"orbit_step_seconds_total {self.step_seconds:.6f}",
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
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=self.link.num_kv_pages,
                page_size=c.page_size,
                max_batch=c.max_batch,
                max_step_tokens=c.max_step_tokens,
                max_seq_len=c.max_seq_len,
            )
        )
        self._ready = True

    def begin_stopping(self) -> None:
        """Refuse new requests; running ones continue until they finish."""
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
        return not self._streams

    def fail(self, error: EngineError) -> None:
        """End every request with `error`; the engine serves nothing more."""
        if self._error is None:
            self._error = error
            if not self._stopping:
                log.error("engine failed: %s", error)
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._wake.set()

    async def run(self) -> None:
        """The step loop; returns when the engine fails or is closed. A loop that dies of a bug
        fails the engine (every request ends, /health 503) and says so in the log, so the
        server never looks healthy over a wedge."""
        try:
            await self._loop()
        except Exception as e:  # logged with its traceback, then the engine fails
            log.exception("the step loop failed")
            self.fail(EngineError(f"the step loop failed: {type(e).__name__}: {e}"))

    async def _loop(self) -> None:
        in_flight: deque[tuple[Step, asyncio.Future, float]] = deque()  # sent, oldest first
        try:
            while self._error is None:
                if len(in_flight) < self.config.max_steps_in_flight and self._send_next(in_flight):
                    continue
                if not in_flight:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    step, result = await self._next_result(in_flight)
                except RankFailure as e:
                    self.fail(EngineError(str(e)))
                    return
                self._deliver(step, result)
        finally:
            for step, fut, _ in in_flight:
                self.link.abandon(step.step_id, fut)

    # ---- internals -------------------------------------------------------------------------
    def _check_serving(self) -> None:
        if self._error is not None:
            raise self._error
        if self._stopping:
            raise EngineError("the server is shutting down")
        if not self._ready:
            raise EngineNotReady("the model is still loading")

    def _sequence(self, prompt_ids: list[int], p: SamplingParams) -> Sequence:
        if not prompt_ids:
            raise RequestTooLarge("the prompt is empty")
        # Any int64 seed maps to a distinct uint64 (two's complement), so -1 and 2**63 - 1 differ.
        seed = p.seed & _UINT64_MASK if p.seed is not None else secrets.randbits(64)
        return Sequence(
            seq_id=next(self._seq_ids),
            prompt_ids=list(prompt_ids),
            max_tokens=p.max_tokens,
            sampling=sampling.SamplingParams(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=seed,
                num_logprobs=-1 if p.logprobs is None else p.logprobs,
            ),
            stop_token_ids=frozenset() if p.ignore_eos else frozenset(self.config.eos_token_ids),
        )

    def _send_next(self, in_flight: deque) -> bool:
        step = self.scheduler.schedule()
        if step is None:
            return False
        plan = wire_pb2.StepPlan(step_id=step.step_id, release_seq_ids=step.released)
        for chunk in step.chunks:
            try:
                _add_chunk(plan, chunk)
            except Exception as e:  # this sequence alone fails
                log.exception("planning sequence %d failed", chunk.seq.seq_id)
                self._fail_sequence(chunk.seq, f"planning failed: {type(e).__name__}: {e}")
        in_flight.append((step, self.link.submit(plan), time.perf_counter()))
        return True

    def _fail_sequence(self, seq: Sequence, why: str) -> None:
        """End one sequence with an error; its pages are released with the next step."""
        self.scheduler.abort(seq)
        queue = self._streams.get(seq.seq_id)
        if queue is not None:
            queue.put_nowait(SequenceFailed(why))

    async def _next_result(self, in_flight: deque) -> tuple[Step, wire_pb2.StepResult]:
        step, fut, sent_at = in_flight.popleft()
        result = await self.link.result(step.step_id, fut, self.config.step_timeout_s)
        now = time.perf_counter()
        # A step's time starts when it was sent or when the one before it answered, whichever
        # is later, so that the overlapping steps' times add up to the time spent stepping.
        self.step_seconds += now - max(sent_at, self._last_result_at)
        self._last_result_at = now
        self.steps += 1
        self.recent_timings.append((result.execute_s, result.gpu_s))
        return step, result

    def _deliver(self, step: Step, result: wire_pb2.StepResult) -> None:
        samples = {s.seq_id: s for s in result.samples}
        for c in step.sampling_chunks:
            failed = samples.get(c.seq.seq_id)
            if failed is not None and failed.error and c.seq.status is Status.RUNNING:
                log.error(
                    "sampling sequence %d failed on the ranks: %s", c.seq.seq_id, failed.error
                )
                self._fail_sequence(c.seq, f"sampling failed: {failed.error}")
        for seq in self.scheduler.apply(step, {k: s.token_id for k, s in samples.items()}):
            queue = self._streams.get(seq.seq_id)
            if queue is None:
                continue
            s = samples[seq.seq_id]
            asked = seq.sampling.num_logprobs >= 0
            queue.put_nowait(
                TokenEvent(
                    token_id=s.token_id,
                    logprob=s.logprob if asked else None,
                    top_logprobs=list(zip(s.top_token_ids, s.top_logprobs)),
                    finish_reason=seq.finish_reason,
                )
            )


_UINT64_MASK = (1 << 64) - 1


def _wire_sampling(seq: Sequence) -> wire_pb2.SamplingParams:
    """Raises ValueError or TypeError for a value the wire types cannot hold."""
    p = seq.sampling
    return wire_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        num_logprobs=p.num_logprobs,
    )


def _add_chunk(plan: wire_pb2.StepPlan, c) -> None:
    """Append one sequence's part of a step; a failure leaves the plan without it."""
    step = wire_pb2.SeqStep(
        seq_id=c.seq.seq_id,
        token_ids=c.token_ids,
        start_pos=c.start_pos,
        new_pages=c.new_pages,
        sample=c.sample,
        follows_sample=c.follows_sample,
    )
    if c.is_new:
        plan.new_seqs.append(
            wire_pb2.NewSequence(seq_id=c.seq.seq_id, sampling=_wire_sampling(c.seq))
        )
    plan.seqs.append(step)
