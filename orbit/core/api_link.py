"""The engine core's side of the link to its API servers: one ROUTER on an IPC socket, one
DEALER per API server (proto/core.proto).

Each API server is a `Sink` of the engine: the engine hands it one list of outputs per step,
sent as one StepOutputs message. A server whose messages back up (it stopped reading) or whose
process exits is dropped: its sequences are aborted and the others go on. The core's status is
sent to every server when it changes and every second, so a server notices a dead core.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import zmq

from orbit.core.engine import Engine, Refused, Sink
from proto import core_pb2
from runtime.zmq_reader import LoopReader

log = logging.getLogger("orbit.core")

STATUS_INTERVAL_S = 1.0
STATUS_POLL_S = 0.1
# Step messages queued for one API server before it counts as stuck (ROUTER_MANDATORY then
# refuses the send): minutes of steps at any real step rate.
SEND_HWM = 100_000
MAX_MESSAGE_BYTES = 64 << 20


class ApiServerSink(Sink):
    """One API server: its sequences' outputs go out as one message per step."""

    def __init__(self, link: ApiLink, identity: bytes):
        super().__init__()
        self.link, self.identity = link, identity
        self.metrics_text = ""
        self.pid = 0  # from its ApiHello

    def deliver(self, outputs: core_pb2.StepOutputs) -> None:
        # A change of status goes out before the outputs it explains: after a stream ends for a
        # failed rank group, /health must already say so.
        self.link.send_status_if_changed()
        msg = core_pb2.ToApiServer()
        msg.outputs.CopyFrom(outputs)  # one copy of the step's outputs into the envelope
        self.link.send(self, msg)


class ApiLink:
    def __init__(self, engine: Engine, endpoint: str, core_metrics: Callable[[], str]):
        """endpoint: ipc://PATH in a folder only this user can open. core_metrics: the core's
        own Prometheus text, appended to the API servers' merged metrics."""
        self.engine, self.endpoint, self.core_metrics = engine, endpoint, core_metrics
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._reader = LoopReader(self.sock, self._take)
        self._tasks: list[asyncio.Task] = []
        try:
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.sock.bind(endpoint)
        except BaseException:
            self.close()  # nothing left open for the collector to hang on (RankLink.close)
            raise
        self.sinks: dict[bytes, ApiServerSink] = {}
        self.dropped_messages = 0
        self._sent_status: tuple[bool, bool] | None = None  # (ready, stopping) last sent
        self._sent_at = 0.0
        self._greeted_pids: set[int] = set()

    def start(self) -> None:
        self._reader.start()
        self._tasks = [asyncio.get_running_loop().create_task(self._status())]

    def send(self, sink: ApiServerSink, msg: core_pb2.ToApiServer) -> None:
        try:
            self._reader.send([sink.identity, msg.SerializeToString()])
        except zmq.ZMQError as e:
            if self.sinks.get(sink.identity) is sink:
                # gone (EHOSTUNREACH) or not reading (EAGAIN at the high-water mark)
                log.error("API server %s cannot be reached (%s); dropping it", _name(sink), e)
                self.forget(sink.identity)

    def forget(self, identity: bytes) -> None:
        """An API server is gone: abort its sequences."""
        sink = self.sinks.pop(identity, None)
        if sink is not None:
            self.engine.drop(sink)

    def reached(self, pid: int) -> bool:
        """Whether the API server process pid has said hello since it started."""
        return pid in self._greeted_pids

    def forget_pid(self, pid: int) -> None:
        """The API server process pid exited."""
        self._greeted_pids.discard(pid)  # a later process may be given the same pid
        for identity, sink in list(self.sinks.items()):
            if sink.pid == pid:
                self.forget(identity)

    def merged_metrics(self) -> str:
        texts = [s.metrics_text for s in self.sinks.values() if s.metrics_text]
        return merge_prometheus(texts) + self.core_metrics()

    def _take(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.dropped_messages += 1
            return
        identity, msg = frames[0].bytes, core_pb2.FromApiServer()
        try:
            msg.ParseFromString(frames[1].bytes)
        except Exception:  # noqa: BLE001 - a malformed message is dropped, never interpreted
            self.dropped_messages += 1
            return
        try:
            self._handle(identity, msg)
        except Exception:  # the reader must outlive any one message
            log.exception("a message from API server %r could not be handled", identity)
            self.dropped_messages += 1

    def _handle(self, identity: bytes, msg: core_pb2.FromApiServer) -> None:
        kind = msg.WhichOneof("kind")
        sink = self.sinks.get(identity)
        if sink is None:
            sink = self.sinks[identity] = ApiServerSink(self, identity)
            self.send(sink, self._status_message())
        if kind == "generate":
            self._generate(sink, msg.generate)
        elif kind == "hello":
            sink.pid = msg.hello.pid
            self._greeted_pids.add(sink.pid)
        elif kind == "abort":
            for key in msg.abort.seq_keys:
                self.engine.abort(sink, key)
        elif kind == "status":
            sink.metrics_text = msg.status.metrics_text
        elif kind == "metrics":
            reply = core_pb2.MetricsReply(query_id=msg.metrics.query_id, text=self.merged_metrics())
            self.send(sink, core_pb2.ToApiServer(metrics=reply))
        elif kind is None:
            self.dropped_messages += 1

    def _generate(self, sink: ApiServerSink, g: core_pb2.Generate) -> None:
        try:
            self.engine.submit(
                sink, g.seq_key, g.prompt_ids, g.max_tokens, g.sampling, g.ignore_eos, g.sent_at
            )
        except Refused as e:
            outputs = core_pb2.StepOutputs()
            outputs.outputs.add(
                seq_key=g.seq_key, finish=core_pb2.FINISH_ERROR, error=e.kind, error_message=str(e)
            )
            sink.deliver(outputs)

    def _status_message(self) -> core_pb2.ToApiServer:
        e = self.engine
        status = core_pb2.CoreStatus(
            ready=e.is_ready(), stopping=e.stopping, max_queue=e.config.max_queue
        )
        return core_pb2.ToApiServer(status=status)

    def send_status_if_changed(self, heartbeat: bool = False) -> None:
        """To every server: the status when it changed, or with heartbeat a second after the
        last."""
        e = self.engine
        # compared as a tuple: this runs before every delivery, and a message is built only
        # when one goes out
        status = (e.is_ready(), e.stopping)
        now = time.monotonic()
        if status != self._sent_status or (heartbeat and now - self._sent_at >= STATUS_INTERVAL_S):
            self._sent_status, self._sent_at = status, now
            msg = self._status_message()
            for sink in list(self.sinks.values()):
                self.send(sink, msg)

    async def _status(self) -> None:
        """The status when it changes (checked every STATUS_POLL_S, and before every delivery
        of outputs), and every second as a heartbeat."""
        while True:
            self.send_status_if_changed(heartbeat=True)
            await asyncio.sleep(STATUS_POLL_S)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._reader.stop()
        self.sock.close(linger=0)
        self.ctx.term()


def _name(sink: ApiServerSink) -> str:
    return sink.identity.decode(errors="replace")


def merge_prometheus(texts: list[str]) -> str:
    """Sum Prometheus texts of processes that export the same families: samples with the same
    name and labels add up (counters, histogram buckets and sums, rates). A family is the
    comment lines that open it and the samples after them, kept together in first-seen order."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}
    for text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith("# "):
                name = line.split()[2] if len(line.split()) > 2 else line
                if current is None or current[0] != name:
                    current = (name, families.setdefault(name, ([], {})))
                if line not in current[1][0]:
                    current[1][0].append(line)
            elif line and current is not None:
                key, _, value = line.rpartition(" ")
                samples = current[1][1]
                samples[key] = samples.get(key, 0.0) + float(value)
    out = []
    for comments, samples in families.values():
        out += comments + [f"{key} {_number(value)}" for key, value in samples.items()]
    return "\n".join(out) + ("\n" if out else "")


def _number(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)
