"""Rank processes on cluster hosts, driven over SSH: start detached, probe, stop, read logs.

Every operation on one host is one short shell script in one SSH session (a session costs a
round trip and a shell start, which add up over hosts and polls). Scripts use POSIX sh and
Linux's /proc only.

A rank is started as `setsid sh -c 'echo $$ > PIDFILE; exec PYTHON -m ranks ...'`: the pid in
the file is the rank's own pid (exec keeps it), the rank leads its own session and process group
(so a signal to the group reaches anything it spawned), and with stdin, stdout and stderr
redirected nothing ties it to the SSH session, which ends at once.

A recorded pid is trusted only while /proc/<pid>/cmdline still contains the rank's marker
(`--package DIR --rank R `): after a reboot or a long time the pid may belong to someone else,
who must never be signalled. A zombie has an empty cmdline and so counts as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import shlex
from collections.abc import AsyncIterator, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import asyncssh

from orbit.cluster.config import DEFAULT_STALL_TIMEOUT_S, HostConfig, SshConfig
from orbit.cluster.ssh import (
    SFTP_LOST,
    ClusterError,
    HostUnreachableError,
    SftpSession,
    connect,
    host_label,
    lost,
    run,
)
from runtime.curve import rank_key_files

T = TypeVar("T")
PID_WAIT_S = 5.0  # a started rank writes its pid file within milliseconds
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL
KILL_WAIT_S = 5.0
LOG_TAIL_LINES = 30
CLOSE_WAIT_S = 5.0  # closing aborts the transport; this only bounds asyncssh's clean-up


class RankLaunchError(ClusterError):
    """A host could not start its ranks (no setsid, workdir not writable, ...)."""


class Raw(str):
    """An argument passed to the remote shell unquoted, such as "$threads"."""


@dataclass(frozen=True)
class RankLaunch:
    """How to start one rank on its host."""

    rank: int
    argv: tuple[str, ...]  # python, "-m", "ranks", ...; Raw items are expanded by the shell
    env: dict[str, str] = field(hash=False)
    pid_file: str
    log_file: str


@dataclass(frozen=True)
class RankProcess:
    """One rank's process as a probe found it."""

    rank: int
    pid: int
    alive: bool
    uptime_s: int | None  # None when dead or unknown


def rank_marker(package_dir: str, rank: int) -> str:
    """A substring of the rank's command line that no other process has; the launch argv
    puts --package and --rank next to each other for it."""
    return f"--package {package_dir} --rank {rank} "


def _q(arg: str) -> str:
    return arg if isinstance(arg, Raw) else shlex.quote(arg)


# ---- running things on every host at once ----------------------------------------------------


async def run_all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Await all; on the first failure cancel the rest and raise that failure itself (not an
    ExceptionGroup), preferring a ClusterError, which names its host."""
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        raise _first_error(eg) from None
    return [t.result() for t in tasks]


def _first_error(eg: BaseExceptionGroup) -> BaseException:
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        for sub in e.exceptions if isinstance(e, BaseExceptionGroup) else [e]:
            (walk if isinstance(sub, BaseExceptionGroup) else leaves.append)(sub)

    walk(eg)
    return next((e for e in leaves if isinstance(e, ClusterError)), leaves[0])


class HostPool:
    """SSH connections by login (address, port, user), opened in parallel, closed together.

    Two [[hosts]] entries may share a login (different workdirs): they share one connection,
    opened once even when both ask at the same time. Every connection sends keepalives as
    `ssh` says (default: [ssh]'s defaults).
    """

    def __init__(
        self, accept_new_host_keys: bool, connect_timeout_s: float, ssh: SshConfig | None = None
    ) -> None:
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout_s = connect_timeout_s
        self.ssh = ssh or SshConfig()
        self._opening: dict[tuple[str, int, str], asyncio.Task] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        opened = []
        for task in self._opening.values():
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                opened.append(task.result())
        for conn in opened:
            conn.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(c.wait_closed() for c in opened), return_exceptions=True),
                CLOSE_WAIT_S,
            )
        self._opening.clear()

    async def get(self, host: HostConfig) -> asyncssh.SSHClientConnection:
        key = (host.address, host.ssh_port, host.user)
        if key not in self._opening:
            self._opening[key] = asyncio.ensure_future(
                connect(host, self.accept_new_host_keys, self.connect_timeout_s, self.ssh)
            )
        return await asyncio.shield(self._opening[key])

    async def get_all(self, hosts: Iterable[HostConfig]) -> list[asyncssh.SSHClientConnection]:
        return await run_all(self.get(h) for h in hosts)


# ---- start -----------------------------------------------------------------------------------

_LAUNCH = (
    'echo $$ > "$1"; echo "[orbit] rank $2: pid $$ on $(hostname), $(date -u)"; shift 2; exec "$@"'
)


def _launch_line(launch: RankLaunch) -> str:
    env = [f"{k}={v}" for k, v in sorted(launch.env.items())]
    args = " ".join(_q(a) for a in ("env", *env, *launch.argv))
    pid, log = shlex.quote(launch.pid_file), shlex.quote(launch.log_file)
    return (
        f"rm -f -- {pid}; if [ -f {log} ]; then mv -f -- {log} {log}.prev; fi; "
        f"setsid sh -c {shlex.quote(_LAUNCH)} orbit-rank {pid} {launch.rank} {args} "
        f"> {log} 2>&1 < /dev/null &"
    )


async def launch_ranks(
    conn: asyncssh.SSHClientConnection,
    run_dir: str,
    launches: list[RankLaunch],
    preamble: str = "",
) -> dict[int, int]:
    """Start the ranks detached; return {rank: pid}. `preamble` sets shell variables the argv
    refers to (Raw items)."""
    wait_files = " ".join(f"[ -s {shlex.quote(r.pid_file)} ] &&" for r in launches)
    script = "\n".join(
        [
            "command -v setsid >/dev/null || { echo 'setsid is not installed' >&2; exit 3; }",
            f"mkdir -p -- {shlex.quote(run_dir)} && cd -- {shlex.quote(run_dir)} || exit 3",
            preamble,
            *(_launch_line(r) for r in launches),
            (
                f"i=0; while [ $i -lt {int(PID_WAIT_S * 10)} ]; do {wait_files} break; "
                "sleep 0.1; i=$((i+1)); done"
            ),
            *(f"echo {r.rank} $(cat -- {shlex.quote(r.pid_file)} 2>/dev/null)" for r in launches),
        ]
    )
    out = await run(conn, script)
    pids = _parse_pairs(out)
    missing = [r.rank for r in launches if r.rank not in pids]
    if missing:
        raise RankLaunchError(
            f"ranks {missing} did not write their pid files under {run_dir} within "
            f"{PID_WAIT_S:g} s; check that the host can run processes and the folder is writable."
        )
    return pids


def _parse_pairs(out: str) -> dict[int, int]:
    pairs = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            pairs[int(parts[0])] = int(parts[1])
    return pairs


async def free_remote_port(
    conn: asyncssh.SSHClientConnection, python: str, port_range: tuple[int, int], exclude: int
) -> int:
    """A port of the range that nothing on the host listens on, tried in random order.

    Checked with the host's Python because sh cannot bind sockets. Another process may take
    it before rank 0's TCPStore binds it; rank 0 then fails with "address in use" in its log.
    """
    script = (
        "import random, socket, sys\n"
        "lo, hi, skip = map(int, sys.argv[1:])\n"
        "ports = [p for p in range(lo, hi + 1) if p != skip]\n"
        "random.shuffle(ports)\n"
        "for p in ports:\n"
        "    with socket.socket() as s:\n"
        "        try:\n"
        "            s.bind(('', p))\n"
        "        except OSError:\n"
        "            continue\n"
        "        print(p)\n"
        "        break\n"
    )
    lo, hi = port_range
    out = await run(conn, f"{shlex.quote(python)} -c {shlex.quote(script)} {lo} {hi} {exclude}")
    if not out.strip().isdigit():
        raise RankLaunchError(
            f"no free port in frontend.port_range [{lo}, {hi}] on the host of rank 0 for "
            "torch.distributed; widen the range in cluster.toml."
        )
    return int(out)


async def push_rank_keys(
    conn: asyncssh.SSHClientConnection,
    local_dir: Path,
    remote_dir: str,
    ranks,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> None:
    """Copy the CURVE files of the host's ranks into a private folder on the host (0700, files
    0600): their own secret keys and the frontend's public key; the frontend's secret and
    other hosts' rank keys stay where they are."""
    await run(
        conn, f"mkdir -p -- {shlex.quote(remote_dir)} && chmod 700 -- {shlex.quote(remote_dir)}"
    )
    private = asyncssh.SFTPAttrs(permissions=0o600)
    write = asyncssh.FXF_WRITE | asyncssh.FXF_CREAT | asyncssh.FXF_TRUNC
    try:
        # Not aborted on Ctrl-C: after a failed start the connection must still stop ranks.
        async with SftpSession(conn, stall_timeout_s, abort_on_cancel=False) as sftp:
            trusted = sorted(p.name for p in local_dir.glob("trusted-*.pub"))
            for name in (*rank_key_files(ranks), *trusted):
                path = posixpath.join(remote_dir, name)
                async with sftp.open(path, write, private) as f:
                    await sftp(f.write((local_dir / name).read_bytes(), 0))
                await sftp(sftp.client.chmod(path, 0o600))  # in case the file was there already
    except SFTP_LOST as e:
        raise lost(conn, "while writing the CURVE keys", e) from None
    except asyncssh.SFTPError as e:
        raise RankLaunchError(
            f"cannot write the CURVE keys to {remote_dir} on {host_label(conn)} ({e.reason}); "
            "check that the workdir is writable."
        ) from None
    except (OSError, asyncssh.Error) as e:
        raise lost(conn, "while writing the CURVE keys", e) from None


async def remove_remote_dir(conn: asyncssh.SSHClientConnection, path: str) -> None:
    """Best effort: used for key folders once their ranks are gone."""
    with contextlib.suppress(ClusterError):
        await run(conn, f"rm -rf -- {shlex.quote(path)}", check=False)


# ---- probe and stop --------------------------------------------------------------------------

_OURS = 'ours() { cat "/proc/$1/cmdline" 2>/dev/null | tr "\\000" " " | grep -qF -- "$2"; }'


@dataclass(frozen=True)
class RankPid:
    """A rank's pid on its host, or the pid file to read it from when the pid is unknown."""

    rank: int
    marker: str
    pid: int | None = None
    pid_file: str | None = None

    def shell_pid(self) -> str:
        if self.pid is not None:
            return str(self.pid)
        return f'"$(cat -- {shlex.quote(self.pid_file or "")} 2>/dev/null || echo 0)"'


async def probe_ranks(
    conn: asyncssh.SSHClientConnection, ranks: list[RankPid]
) -> dict[int, RankProcess]:
    """Which of the ranks still run, and for how long (seconds, from ps)."""
    lines = [_OURS]
    for r in ranks:
        lines.append(
            f"p={r.shell_pid()}; if ours $p {shlex.quote(r.marker)}; then echo {r.rank} $p "
            f"alive $(ps -o etimes= -p $p 2>/dev/null); else echo {r.rank} $p dead; fi"
        )
    out = await run(conn, "\n".join(lines))
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit():
            rank, pid, alive = int(parts[0]), int(parts[1] or 0), parts[2] == "alive"
            uptime = int(parts[3]) if alive and len(parts) > 3 and parts[3].isdigit() else None
            found[rank] = RankProcess(rank, pid, alive, uptime)
    return found


async def stop_ranks(
    conn: asyncssh.SSHClientConnection, ranks: list[RankPid], grace_s: float = STOP_GRACE_S
) -> list[int]:
    """SIGTERM each rank's process group, wait up to grace_s, SIGKILL what is left; return the
    ranks still running after that (none, unless the host misbehaves)."""
    if not ranks:
        return []
    assign = [f"p{r.rank}={r.shell_pid()}" for r in ranks]
    check = "; ".join(
        f'if ours $p{r.rank} {shlex.quote(r.marker)}; then left="$left {r.rank}"; fi' for r in ranks
    )
    signal = "; ".join(
        f"if ours $p{r.rank} {shlex.quote(r.marker)}; then kill -s $1 -- -$p{r.rank} "
        f"2>/dev/null; kill -s $1 $p{r.rank} 2>/dev/null; fi"
        for r in ranks
    )
    script = "\n".join(
        [
            _OURS,
            *assign,
            f'check() {{ left=""; {check}; }}',
            f"signal() {{ {signal}; }}",
            (
                'wait_gone() { i=0; while [ $i -lt $1 ]; do check; [ -z "$left" ] && return; '
                "sleep 0.1; i=$((i+1)); done; }"
            ),
            f"signal TERM; wait_gone {int(grace_s * 10)}",
            f'if [ -n "$left" ]; then signal KILL; wait_gone {int(KILL_WAIT_S * 10)}; fi',
            'check; echo "left:$left"',
        ]
    )
    out = await run(conn, script, timeout_s=grace_s + KILL_WAIT_S + 30.0)
    last = next((ln for ln in reversed(out.splitlines()) if ln.startswith("left:")), "left:")
    return [int(r) for r in last[len("left:") :].split()]


# ---- logs ------------------------------------------------------------------------------------


async def log_tail(
    conn: asyncssh.SSHClientConnection, path: str, lines: int = LOG_TAIL_LINES
) -> str:
    """The last lines of a remote log; "" when it is missing or the host cannot be reached."""
    try:
        out = await run(conn, f"tail -n {int(lines)} -- {shlex.quote(path)} 2>/dev/null; true")
    except ClusterError:
        return ""
    return out.rstrip("\n")


async def follow_log(
    conn: asyncssh.SSHClientConnection, path: str, lines: int
) -> AsyncIterator[str]:
    """Yield the log's last lines, then each new one as it is written, until cancelled.

    tail runs in the background of a shell that waits for stdin to close: when this side
    closes the channel (Ctrl-C), the shell kills tail, so nothing is left on the host.
    """
    command = (
        f"tail -n {int(lines)} -F -- {shlex.quote(path)} & t=$!; "
        "cat > /dev/null; kill $t 2>/dev/null"
    )
    try:
        process = await conn.create_process(command)
    except (OSError, asyncssh.Error) as e:
        raise HostUnreachableError(f"cannot follow {path} ({e}); check the host.") from None
    try:
        async for line in process.stdout:
            yield line.rstrip("\n")
    finally:
        with contextlib.suppress(OSError, asyncssh.Error):
            process.stdin.write_eof()
        process.close()


async def gather_lines(streams: dict[int, AsyncIterator[str]]) -> AsyncIterator[tuple[int, str]]:
    """Merge several line streams into (key, line) pairs, in arrival order."""
    queue: asyncio.Queue[tuple[int, str] | BaseException | None] = asyncio.Queue()

    async def pump(key: int, stream: AsyncIterator[str]) -> None:
        try:
            async for line in stream:
                await queue.put((key, line))
        except (ClusterError, OSError, asyncssh.Error) as e:  # raised to the reader below
            await queue.put(e)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(k, s)) for k, s in streams.items()]
    ended = 0
    try:
        while ended < len(tasks):  # follow mode: ends with Ctrl-C (cancellation)
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                ended += 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
