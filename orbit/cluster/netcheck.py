"""Are the ports that ranks need reachable? Checked before any rank starts, with a listener where
the real server will listen and a bounded connect from every host.

Two ports matter: the frontend's (frontend.address:port, on this machine; every rank connects
to it) and torch.distributed's (hosts[0].address:port; every rank joins the TCPStore there).
Each listener binds the target's own address, never all interfaces. The listeners never
accept: the kernel completes each handshake into the listen backlog, so a connect that
succeeds proves the path is open, and closing the listener resets those connections without
leaving TIME_WAIT on the port the real server binds next. Every wait is bounded: connects by
CONNECT_TIMEOUT_S, the remote listener by LISTEN_LIFE_S even if this side goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import asyncssh

from orbit.cluster.config import HostConfig
from orbit.cluster.ssh import ClusterError, HostUnreachableError, run

CONNECT_TIMEOUT_S = 3.0
LISTEN_LIFE_S = 60.0
LISTEN_START_TIMEOUT_S = 15.0

_CONNECT = """\
import json, socket, sys
results = []
for address, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((address, port), timeout=float(sys.argv[2])).close()
        results.append(None)
    except OSError as e:
        results.append(str(e) or type(e).__name__)
print(json.dumps(results))
"""

# Listens on one address (never all interfaces) until stdin closes (this side is done) or
# LISTEN_LIFE_S passes, whichever is first. Errors name the errno: EADDRNOTAVAIL means the
# address is not the host's own.
_LISTEN = """\
import errno, select, socket, sys
address, port, life_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    s = socket.create_server((address, port), family=family, backlog=64)
except OSError as e:
    print("error", errno.errorcode.get(e.errno, "") + ":", e.strerror or e, flush=True)
    sys.exit(0)
print("listening", flush=True)
select.select([sys.stdin], [], [], life_s)
"""


@dataclass(frozen=True)
class Target:
    what: str  # e.g. "the frontend"
    address: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.address}:{self.port}"


@dataclass(frozen=True)
class Unreachable:
    host_index: int  # the host that could not connect (or listen, for listen_error)
    target: Target
    reason: str
    listen_error: bool = False


@contextlib.contextmanager
def local_listener(address: str, port: int) -> Iterator[None]:
    """Listen on address:port here (the frontend's endpoint) for the duration."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
        try:
            s.bind((address, port))
            s.listen(64)
        except OSError as e:
            raise ClusterError(
                f"cannot listen on {address}:{port} here for the frontend's port check "
                f"({e.strerror}); another process took the port since it was picked: run again."
            ) from None
        yield


@contextlib.asynccontextmanager
async def remote_listener(
    conn: asyncssh.SSHClientConnection, host: HostConfig, address: str, port: int
) -> AsyncIterator[str | None]:
    """Listen on address:port on the host (the address the check is about, so nothing listens
    on the host's other interfaces) for the duration; yields None, or why it could not."""
    args = f"{shlex.quote(address)} {port} {LISTEN_LIFE_S:g}"
    command = f"{shlex.quote(host.python)} -c {shlex.quote(_LISTEN)} {args}"
    try:
        process = await conn.create_process(command)
    except (OSError, asyncssh.Error) as e:
        raise HostUnreachableError(f"cannot start a listener on {host.label} ({e}).") from None
    try:
        try:
            line = await asyncio.wait_for(process.stdout.readline(), LISTEN_START_TIMEOUT_S)
        except TimeoutError:
            line = f"error: no answer within {LISTEN_START_TIMEOUT_S:g} s"
        yield None if line.startswith("listening") else (line.strip() or "the listener exited")
    finally:
        with contextlib.suppress(OSError, asyncssh.Error):
            process.stdin.write_eof()
        with contextlib.suppress(TimeoutError, OSError, asyncssh.Error):
            await asyncio.wait_for(process.wait(), 5.0)
        process.close()


async def connect_from(
    conn: asyncssh.SSHClientConnection, host: HostConfig, targets: list[Target]
) -> list[str | None]:
    """From the host, try a TCP connect to each target; per target None or why it failed."""
    pairs = json.dumps([[t.address, t.port] for t in targets])
    command = (
        f"{shlex.quote(host.python)} -c {shlex.quote(_CONNECT)} {shlex.quote(pairs)} "
        f"{CONNECT_TIMEOUT_S:g}"
    )
    timeout_s = CONNECT_TIMEOUT_S * len(targets) + 15.0
    out = await run(conn, command, timeout_s=timeout_s)
    try:
        results = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ClusterError(f"the connect check on {host.label} printed {out[-200:]!r}.") from None
    return [r if isinstance(r, str) else None for r in results][: len(targets)]


async def check_ports(
    listener: tuple[asyncssh.SSHClientConnection, HostConfig],
    clients: dict[int, tuple[asyncssh.SSHClientConnection, HostConfig]],
    frontend: Target,
    dist: Target,
) -> list[Unreachable]:
    """With `frontend` listening here and `dist` on the listener host (hosts[0]), connect to
    both from every client host (by host index); return what failed."""
    with local_listener(frontend.address, frontend.port):
        async with remote_listener(*listener, dist.address, dist.port) as listen_error:
            if listen_error:
                return [Unreachable(0, dist, listen_error, listen_error=True)]
            targets = [frontend, dist]
            results = await asyncio.gather(
                *(connect_from(conn, host, targets) for conn, host in clients.values())
            )
    return [
        Unreachable(i, target, reason)
        for i, per_host in zip(clients, results)
        for target, reason in zip(targets, per_host)
        if reason is not None
    ]
