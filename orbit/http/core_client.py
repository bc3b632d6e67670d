"""An API server's side of the link to the engine core (proto/core.proto): one DEALER socket.

`generate` sends a sequence to the core and yields what the core sends back for it, one
`SeqOutput` per step (the new tokens, logprobs when asked, and on the last one the finish
reason), or one for all the steps that arrived while the stream was busy; the event loop's
reader callback (runtime/zmq_reader.py) routes each step's message to the sequences' queues. A
sequence that the core refused or ended with an error raises the matching exception below. The
core's status arrives when it changes and every second: when it has been silent for
CORE_SILENCE_S the core counts as dead, every sequence ends with EngineError and the server is
not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import zmq

from proto import core_pb2, wire_pb2
from proto.outputs import seq_outputs
from runtime.zmq_reader import LoopReader

log = logging.getLogger("orbit.http")

CORE_SILENCE_S = 3.0
STATUS_INTERVAL_S = 1.0
METRICS_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 64 << 20
_UINT64_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """One choice's generation settings, as the HTTP layer validated them."""

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None  # any int64; None: drawn at random
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob and k alternatives
    ignore_eos: bool = False
    json_schema: str | None = None  # constrain the output to this JSON schema (structured.py)

    def wire(self) -> wire_pb2.SamplingParams:
        """Raises ValueError for a value the wire's types cannot hold."""
        # Any int64 seed maps to a distinct uint64 (two's complement): -1 and 2**63 - 1 differ.
        seed = secrets.randbits(64) if self.seed is None else self.seed & _UINT64_MASK
        grammar = (
            None if self.json_schema is None else wire_pb2.Grammar(json_schema=self.json_schema)
        )
        return wire_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            num_logprobs=-1 if self.logprobs is None else self.logprobs,
            grammar=grammar,
        )


class EngineError(Exception):
    """The ranks failed, the core stopped or is shutting down: nothing can be served (503)."""


class EngineNotReady(EngineError):
    """No rank group is ready yet (503)."""


class EngineOverloaded(EngineError):
    """The core's admission queue is full (429 with Retry-After)."""


class RequestTooLarge(ValueError):
    """A request that can never fit the served capacities (400)."""


class SequenceFailed(Exception):
    """Planning or drawing this one sequence failed; other requests go on (500)."""


_ERRORS = {
    core_pb2.ERROR_NOT_READY: EngineNotReady,
    core_pb2.ERROR_STOPPING: EngineError,
    core_pb2.ERROR_OVERLOADED: EngineOverloaded,
    core_pb2.ERROR_TOO_LARGE: RequestTooLarge,
    core_pb2.ERROR_ENGINE_FAILED: EngineError,
    core_pb2.ERROR_SEQUENCE_FAILED: SequenceFailed,
}


def error_of(out: core_pb2.SeqOutput) -> Exception:
    return _ERRORS.get(out.error, EngineError)(out.error_message or "the engine core failed")


class _Outputs:
    """One sequence's outputs not taken yet. The reader puts one per step; the sequence's
    generate() takes them. An asyncio.Queue costs several times this per output (its
    unfinished-task count and the event behind it, a getter list), and every streamed token
    passes here once."""

    __slots__ = ("items", "waiter")

    def __init__(self):
        self.items: deque[core_pb2.SeqOutput] = deque()
        self.waiter: asyncio.Future | None = None  # set while generate() waits for an output

    def put(self, out: core_pb2.SeqOutput) -> None:
        self.items.append(out)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> core_pb2.SeqOutput:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


def _take_waiting(out: core_pb2.SeqOutput, waiting: deque[core_pb2.SeqOutput]) -> None:
    """Merge into out the outputs that arrived while its sequence's stream was busy (up to an
    error, which goes out on its own): a server that falls behind then writes each stream once
    per catch-up rather than once per step, so its cost per token falls as it lags and it
    catches up instead of queueing ever more. Repeated fields (tokens, logprobs) append; the
    finish reason is the last one's; what only a first output carries stays."""
    while waiting and out.finish == core_pb2.FINISH_NONE and not waiting[0].error:
        out.MergeFrom(waiting.popleft())


class CoreClient:
    def __init__(
        self,
        endpoint: str,
        index: int,
        metrics_text: Callable[[], str],
        tokenizer,
        max_seq_len: int,
    ):
        """metrics_text: this server's own HTTP metrics, sent to the core every second;
        tokenizer and max_seq_len: the served package's, for the HTTP layer."""
        self.endpoint, self.index, self._own_metrics = endpoint, index, metrics_text
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self._reader = LoopReader(self.sock, self._take)
        self.sock.setsockopt(zmq.IDENTITY, f"api-{index}-{os.getpid()}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._outputs: dict[int, _Outputs] = {}
        self._keys = itertools.count(1)
        self._status = core_pb2.CoreStatus()
        self._status_at = 0.0
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._dead = False

    async def start(self) -> None:
        self.sock.connect(self.endpoint)
        hello = core_pb2.ApiHello(api_server=self.index, pid=os.getpid())
        self._send(core_pb2.FromApiServer(hello=hello))
        self._reader.start()
        self._tasks = [asyncio.get_running_loop().create_task(self._watch())]

    def is_ready(self) -> bool:
        return self._status.ready and not self._dead

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[core_pb2.SeqOutput]:
        """Yield the sequence's outputs, one per step (or per catch-up, _take_waiting); closing
        the iterator early aborts it."""
        self._check_serving()
        try:
            sampling = params.wire()
        except ValueError as e:
            raise RequestTooLarge(f"a sampling parameter is out of range ({e})") from None
        key = next(self._keys)
        outputs = self._outputs[key] = _Outputs()
        generate = core_pb2.Generate(
            seq_key=key,
            prompt_ids=prompt_ids,
            max_tokens=params.max_tokens,
            sampling=sampling,
            ignore_eos=params.ignore_eos,
        )
        finished = False
        try:
            generate.sent_at = time.monotonic()
            try:
                self._send(core_pb2.FromApiServer(generate=generate))
            except zmq.ZMQError as e:
                finished = True  # it never reached the core: nothing to abort
                raise EngineOverloaded(f"the link to the engine core is full ({e})") from None
            while True:
                out = await outputs.get()
                if out.error:
                    finished = True
                    raise error_of(out)
                _take_waiting(out, outputs.items)
                finished = out.finish != core_pb2.FINISH_NONE
                yield out
                if finished:
                    return
        finally:
            self._outputs.pop(key, None)
            if not finished and not self._dead:
                with contextlib.suppress(zmq.ZMQError):  # it runs on to max_tokens, unread
                    self._send(core_pb2.FromApiServer(abort=core_pb2.Abort(seq_keys=[key])))

    async def metrics_text(self) -> str:
        """Every API server's HTTP metrics, summed, and the core's own."""
        self._check_alive()
        query_id = next(self._query_ids)
        reply = asyncio.get_running_loop().create_future()
        self._queries[query_id] = reply
        try:
            self._send_status()  # so that this server's part is current
            self._send(core_pb2.FromApiServer(metrics=core_pb2.MetricsQuery(query_id=query_id)))
            return await asyncio.wait_for(reply, METRICS_TIMEOUT_S)
        finally:
            self._queries.pop(query_id, None)

    @property
    def stopping(self) -> bool:
        return self._status.stopping

    @property
    def dead(self) -> bool:
        return self._dead

    def fail_all(self, why: str) -> None:
        """End every sequence with EngineError(why); the server serves nothing more."""
        self._dead = True
        dead = core_pb2.SeqOutput(
            finish=core_pb2.FINISH_ERROR, error=core_pb2.ERROR_ENGINE_FAILED, error_message=why
        )
        for outputs in self._outputs.values():
            outputs.put(dead)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._reader.stop()
        self.sock.close(linger=0)
        self.ctx.term()

    # ---- internals -------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead:
            raise EngineError("the engine core stopped answering")

    def _check_serving(self) -> None:
        self._check_alive()
        if self._status.stopping:
            raise EngineError("the server is shutting down")
        if not self._status.ready:
            raise EngineNotReady("the model is still loading")

    def _send(self, msg: core_pb2.FromApiServer) -> None:
        """Queue msg for the core; raises zmq.ZMQError when the link takes no more now (the
        core stopped reading and the queue reached its high-water mark)."""
        self._reader.send([msg.SerializeToString()])

    def _send_status(self) -> None:
        status = core_pb2.ApiStatus(metrics_text=self._own_metrics())
        with contextlib.suppress(zmq.ZMQError):
            self._send(core_pb2.FromApiServer(status=status))

    def _take(self, frames: list[zmq.Frame]) -> None:
        msg = core_pb2.ToApiServer()
        try:
            msg.ParseFromString(frames[-1].bytes)
        except Exception:  # noqa: BLE001 - a malformed message is dropped, never interpreted
            return
        kind = msg.WhichOneof("kind")
        if kind == "outputs":
            self._put_outputs(msg.outputs)
        elif kind == "status":
            self._status, self._status_at = msg.status, time.monotonic()
        elif kind == "metrics":
            reply = self._queries.get(msg.metrics.query_id)
            if reply is not None and not reply.done():
                reply.set_result(msg.metrics.text)

    def _put_outputs(self, step: core_pb2.StepOutputs) -> None:
        by_key = self._outputs
        try:
            for out in seq_outputs(step):
                outputs = by_key.get(out.seq_key)
                if outputs is not None:
                    outputs.put(out)
        except ValueError as e:
            log.error("dropped a step's packed outputs: %s", e)

    async def _watch(self) -> None:
        """Send this server's status every second; a core silent for CORE_SILENCE_S is dead."""
        started = time.monotonic()
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            self._send_status()
            heard = self._status_at or started
            if time.monotonic() - heard > CORE_SILENCE_S and not self._dead:
                self._core_died()

    def _core_died(self) -> None:
        log.error("the engine core sent nothing for %g s; ending every stream", CORE_SILENCE_S)
        self.fail_all("the engine core stopped answering")
