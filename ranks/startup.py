"""A rank's start-up, made visible: each phase is reported to the frontend as it begins, and the
phases that wait on other hosts run under a watchdog.

Joining the TP group (the TCPStore rendezvous, then NCCL's communicator) and the collectives
check block inside C++ and cannot be interrupted or timed out from Python once a peer is missing
or unreachable. The watchdog is a timer thread: when the phase outlives its limit, it sends a
Failure naming the phase over a socket of its own (ZeroMQ sockets belong to one thread), writes
the same line to the log, and ends the process; the frontend sees both the message and the exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from proto import wire_pb2
from proto.phases import PHASE_TEXT
from runtime.curve import ClientKeys, secure_client

log = logging.getLogger("orbit.rank")

# Exit status of a rank its watchdog ended; distinct from 1 (an exception) for the log reader.
WATCHDOG_EXIT_STATUS = 3
# How long the watchdog waits for its Failure to leave before ending the process: ZeroMQ has no
# delivery receipt, and the socket is connected (CURVE handshake done) while the phase runs.
FAILURE_FLUSH_S = 1.0


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), so phase times include the imports
    that ran before any rank code; 0.0 where /proc is missing."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Field 22 (starttime, in clock ticks since boot); fields after the ")" of the name.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot_s = time.clock_gettime(time.CLOCK_BOOTTIME)
        return max(0.0, boot_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Phases:
    """Which start-up phase the rank is in; each change is sent to the frontend."""

    def __init__(self, rank: int, send: Callable[[wire_pb2.FromRank], None]) -> None:
        self.rank = rank
        self.current = wire_pb2.PHASE_UNSPECIFIED
        self._send = send
        self._t0 = time.monotonic() - process_age_s()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def enter(self, name: int) -> None:
        self.current = name
        log.info("phase %s at %.2f s", PHASE_TEXT[name], self.elapsed_s())
        phase = wire_pb2.Phase(rank=self.rank, name=name, elapsed_s=self.elapsed_s())
        self._send(wire_pb2.FromRank(phase=phase))


class Watchdog:
    """Ends the process when a watched phase runs past its limit (see the module docstring)."""

    def __init__(
        self, ctx: zmq.Context, frontend: str, curve_dir: str, rank: int, limit_s: float
    ) -> None:
        self.ctx, self.frontend, self.curve_dir = ctx, frontend, curve_dir
        self.rank, self.limit_s = rank, limit_s

    @contextlib.contextmanager
    def watch(self, phase: int) -> Iterator[None]:
        sock = self._connect()  # before the phase: the handshake is done when it is needed
        done = threading.Event()
        timer = threading.Thread(
            target=self._expire_unless, args=(done, phase, sock), name="watchdog", daemon=True
        )
        timer.start()
        try:
            yield
        finally:
            done.set()
            timer.join()
            sock.close(linger=0)

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rank-{self.rank}-watchdog".encode())
        if self.curve_dir:
            secure_client(sock, ClientKeys.load(Path(self.curve_dir), self.rank))
        sock.connect(self.frontend)
        return sock

    def _expire_unless(self, done: threading.Event, phase: int, sock: zmq.Socket) -> None:
        if done.wait(self.limit_s):
            return
        message = (
            f"{PHASE_TEXT[phase]} did not finish within {self.limit_s:g} s; a peer is missing "
            "or unreachable (check that every host reaches the torch.distributed address and "
            "the pinned network interface)"
        )
        log.error("rank %d: %s; exiting", self.rank, message)
        failure = wire_pb2.Failure(rank=self.rank, message=message, phase=phase)
        sock.send(wire_pb2.FromRank(failure=failure).SerializeToString())
        time.sleep(FAILURE_FLUSH_S)
        os._exit(WATCHDOG_EXIT_STATUS)
