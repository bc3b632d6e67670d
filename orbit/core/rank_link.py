"""The frontend's side of the ZeroMQ link to its ranks: one ROUTER socket, one DEALER per rank.

The link is always CURVE-secured (runtime/curve.py): in local mode too, any process on the
machine could otherwise connect and speak for a rank. A message's rank is the one whose key
authenticated the connection (ZeroMQ's User-Id), never a field of the message body; a message
that is malformed, unauthenticated or claims another rank is dropped and counted.

The event loop's reader callback takes every message from the ranks (runtime/zmq_reader.py):
step results resolve the step's future, heartbeats refresh each rank's last-seen time, and a
Failure fails everything waiting.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from proto import wire_pb2
from runtime.curve import ServerKeys, require_curve, secure_server
from runtime.zmq_reader import LoopReader

MAX_MESSAGE_BYTES = 64 << 20
HEARTBEAT_SILENCE_S = 5.0  # five missed one-second heartbeats

log = logging.getLogger("orbit.core.rank_link")


class RankFailure(Exception):
    """A rank failed, exited or stopped answering; the TP group cannot continue."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank  # the rank that reported or caused the failure, when known


class PackageMismatch(RankFailure):
    """The ranks run a different package from the one this frontend opened, or lack what it
    needs of them (a draft for --speculate draft)."""


@dataclass
class RankInfo:
    rank: int
    hello: wire_pb2.Hello | None = None
    ready: wire_pb2.Ready | None = None
    last_seen: float = 0.0


class RankLink:
    def __init__(
        self,
        tp_size: int,
        curve: ServerKeys,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        package_digest: str = "",
    ):
        """Only ranks holding an allowed client key can connect, and the traffic is encrypted.
        With package_digest, a rank whose Hello names another package fails the link. Construct
        inside a running event loop (the authenticator is an asyncio task)."""
        self.tp_size = tp_size
        self.package_digest = package_digest
        self._rank_of_user = curve.rank_of_user
        require_curve()
        self.ctx = zmq.asyncio.Context()  # (for the authenticator, an asyncio task)
        self.auth = AsyncioAuthenticator(self.ctx)
        self.sock = zmq.Socket(self.ctx, zmq.ROUTER)  # plain: LoopReader reads it
        self._reader = LoopReader(self.sock, self._take)
        try:
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(curve.allowed_dir))
            secure_server(self.sock, curve)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if port:
                self.sock.bind(f"tcp://{bind_host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        except BaseException:
            self.close()  # a port in use, say: see close for why nothing may be left open
            raise
        self.endpoint = f"tcp://{bind_host}:{port}"
        self.ranks = [RankInfo(r) for r in range(tp_size)]
        self._all_ready = asyncio.Event()
        self._pending: dict[int, tuple[asyncio.Future, list[wire_pb2.StepResult | None]]] = {}
        self.failure: RankFailure | None = None
        self.dropped_messages = 0  # malformed, unauthenticated or misattributed
        self.reported_failures: set[int] = set()  # ranks that sent a Failure

    def start(self) -> None:
        self._reader.start()

    @property
    def num_kv_pages(self) -> int:
        return min(r.ready.num_kv_pages for r in self.ranks)

    @property
    def exact_rows(self) -> int:
        """Decode steps of up to this many rows that every rank computes as each row alone
        (--exact-verification's graphs; 0 without them, or from ranks older than the field)."""
        return min(r.ready.exact_rows for r in self.ranks)

    @property
    def kv_dtype(self) -> str:
        """What the ranks' KV pages hold ("bfloat16", "float8_e4m3fn", ...; "" when the ranks
        predate the field); every rank of a group runs the same --kv-dtype."""
        return self.ranks[0].ready.kv_dtype

    async def attach(self, timeout_s: float) -> None:
        """Take over ranks that are already running (started by `orbit up`): send each one
        Attach until it is reachable, then wait for its Hello and Ready."""
        msg = wire_pb2.ToRank(attach=wire_pb2.Attach(session_id=secrets.token_hex(8)))
        data = msg.SerializeToString()
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.tp_size))
        while waiting and time.monotonic() < deadline:
            for r in sorted(waiting):
                try:
                    self._send(r, data)
                    waiting.discard(r)
                except zmq.ZMQError:
                    pass  # not reconnected yet; ZeroMQ retries the connection on its side
            await asyncio.sleep(0.05)
        if waiting:
            raise RankFailure(f"ranks {sorted(waiting)} did not connect within {timeout_s:.0f} s")
        await self.wait_ready(max(1.0, deadline - time.monotonic()))

    async def wait_ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._wait_ready(), timeout_s)
        except TimeoutError:
            missing = [r.rank for r in self.ranks if r.ready is None]
            raise RankFailure(f"ranks {missing} were not ready within {timeout_s:.0f} s") from None

    async def _wait_ready(self) -> None:
        while not self._all_ready.is_set():
            if self.failure:
                raise self.failure
            await asyncio.sleep(0.05)
        if self.failure:
            raise self.failure

    @property
    def steps_in_flight(self) -> int:
        """Submitted steps not yet answered by every rank (nor abandoned)."""
        return len(self._pending)

    def submit(self, plan: wire_pb2.StepPlan) -> asyncio.Future:
        """Send the plan to every rank without waiting for the sends or the answers. The future
        resolves to rank 0's result once every rank answered (await it with `result`), or
        fails with RankFailure. pyzmq sends a socket's messages in call order, and each rank
        executes plans as they arrive, so every rank runs the plans in submission order."""
        fut = asyncio.get_running_loop().create_future()
        if self.failure:
            fut.set_exception(self.failure)
            return fut
        self._pending[plan.step_id] = (fut, [None] * self.tp_size)
        data = wire_pb2.ToRank(step=plan).SerializeToString()
        for r in range(self.tp_size):
            try:
                self._send(r, data)
            except zmq.ZMQError as e:  # gone (ROUTER_MANDATORY), or a full queue: a hung rank
                self.fail(RankFailure(f"cannot send to rank {r}: {e}", r))
                break
        return fut

    async def result(
        self, step_id: int, fut: asyncio.Future, timeout_s: float
    ) -> wire_pb2.StepResult:
        """Wait at most timeout_s for a submitted step's result; a timeout fails the link."""
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self.fail(RankFailure(f"step {step_id} got no answer within {timeout_s:.0f} s"))
            raise self.failure from None
        finally:
            self._pending.pop(step_id, None)

    def abandon(self, step_id: int, fut: asyncio.Future) -> None:
        """Forget a submitted step whose result will not be awaited (the loop stopped)."""
        self._pending.pop(step_id, None)
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()  # retrieved, so asyncio does not log it as lost

    def _send(self, rank: int, data: bytes) -> None:
        """Queue a message for a rank without waiting; raises zmq.ZMQError where ZeroMQ cannot
        take it (a rank not connected, or a thousand messages queued for it)."""
        self._reader.send([_identity(rank), data])

    def silent_ranks(self, silence_s: float) -> list[int]:
        """Ranks heard from before but not for silence_s. Ranks heartbeat every second from a
        thread of their own, during steps too, so silence means stopped, hung or cut off."""
        now = time.monotonic()
        return [r.rank for r in self.ranks if r.last_seen and now - r.last_seen > silence_s]

    def fail(self, failure: RankFailure) -> None:
        if self.failure is None:
            self.failure = failure
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(self.failure)

    def _take(self, frames: list[zmq.Frame]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            self.dropped_messages += 1
            return
        try:
            self._handle(*parsed)
        except Exception:  # the reader must outlive any one message
            log.exception("a message from rank %d could not be handled", parsed[0])
            self.dropped_messages += 1

    def _parse(self, frames: list[zmq.Frame]) -> tuple[int, str, object] | None:
        """(authenticated rank, kind, body) of a well-formed message, or None to drop it."""
        if len(frames) != 2:
            return None
        try:
            rank = self._rank_of_user.get(frames[1].get("User-Id"))
        except zmq.ZMQError:
            return None
        if rank is None or rank >= self.tp_size:
            return None
        msg = wire_pb2.FromRank()
        try:
            msg.ParseFromString(frames[1].bytes)
        except Exception:  # noqa: BLE001 - a malformed message is dropped, never interpreted
            return None
        kind = msg.WhichOneof("kind")
        if kind is None:
            return None
        body = getattr(msg, kind)
        if body.rank != rank:
            return None  # a rank speaking for another: a bug or a forgery, either way not trusted
        return rank, kind, body

    def _handle(self, rank: int, kind: str, body) -> None:
        info = self.ranks[rank]
        info.last_seen = time.monotonic()
        if kind == "hello":
            info.hello = body
            if self.package_digest and body.package_digest != self.package_digest:
                self.fail(
                    PackageMismatch(
                        f"rank {rank} runs package {body.package_digest[:12]}, but this frontend "
                        f"serves package {self.package_digest[:12]}; restart the frontend for "
                        "the new package, or bring the ranks up with its package",
                        rank,
                    )
                )
        elif kind == "ready":
            info.ready = body
            if all(r.ready is not None for r in self.ranks):
                self._all_ready.set()
        elif kind == "failure":
            self.reported_failures.add(rank)
            self.fail(RankFailure(f"rank {rank} failed: {body.message}", rank))
        elif kind == "result":
            entry = self._pending.get(body.step_id)
            if entry is None:
                return
            fut, results = entry
            results[rank] = body
            if all(r is not None for r in results) and not fut.done():
                fut.set_result(results[0])

    async def shutdown(self, reason: str) -> None:
        data = wire_pb2.ToRank(shutdown=wire_pb2.Shutdown(reason=reason)).SerializeToString()
        for r in range(self.tp_size):
            try:
                self._send(r, data)
            except zmq.ZMQError:
                pass  # that rank never connected or is gone

    def close(self) -> None:
        """Every link must be closed. One dropped open hangs the process for good when the
        garbage collector takes it: pyzmq's Context.__del__ closes the sockets it still knows
        through weak references, which the collector clears first in a reference cycle, then
        waits in term() for the socket it no longer sees."""
        self._reader.stop()
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


def _identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class LoopLag:
    """Whether this event loop ran on time since the last look. After a stall of the loop
    itself, heartbeats wait unread in the socket: silence is judged only once the reader has
    had a turn to take them."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def caught_up(self) -> bool:
        now = time.monotonic()
        on_time = now - self._last < self.interval_s + 1.0
        self._last = now
        return on_time
