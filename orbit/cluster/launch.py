"""Starting a cluster's ranks, watching them until every one is Ready, stopping them on failure.

Used by `orbit up` (orbit/cluster/up.py) after the push. While it waits, two signals are
watched: the frontend endpoint (Hello when a rank connects, Ready once loaded and in the TP
group, Failure with a reason) and, every PROBE_INTERVAL_S, the rank processes themselves over
SSH. A process that is gone fails the wait at once, even one that died before it could connect
(a bad python, a missing library), with the last lines of its log.
"""

from __future__ import annotations

import asyncio
import errno
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import zmq

from orbit.cluster.config import DEFAULT_STALL_TIMEOUT_S, FrontendConfig, HostConfig
from orbit.cluster.readiness import BringUpLink, phase_name, phase_times_text, where_text
from orbit.cluster.remote import (
    LOG_TAIL_LINES,
    RankLaunch,
    RankPid,
    Raw,
    launch_ranks,
    log_tail,
    probe_ranks,
    push_rank_keys,
    rank_marker,
    remove_remote_dir,
    run_all,
    stop_ranks,
)
from orbit.cluster.ssh import ClusterError
from orbit.cluster.state import ClusterState, HostRecord, RankRecord
from runtime.curve import ServerKeys

PROBE_INTERVAL_S = 0.5  # how often rank processes are checked over SSH while waiting
WAIT_TICK_S = 0.1
# (rank, host label, state, detail): "starting" (process up), then each phase the rank reports
# ("connect", "join group", ...; ranks/startup.py), then "ready" with its phase times as detail.
RankStateFn = Callable[[int, str, str, str], None]


class FrontendBindError(ClusterError):
    """The frontend endpoint cannot be bound on this machine."""


class RankStartError(ClusterError):
    """A rank exited, failed or was not ready in time during `orbit up`."""


@dataclass(frozen=True)
class Started:
    """A rank being started, with what is needed to watch and stop it. record.pid is 0 until
    the host reports it; stopping reads the pid file instead, which also covers a launch that
    was interrupted before reporting."""

    record: RankRecord
    host: HostRecord
    conn: asyncssh.SSHClientConnection

    def pid_ref(self) -> RankPid:
        marker = rank_marker(self.host.package_dir, self.record.rank)
        return RankPid(self.record.rank, marker, pid_file=self.record.pid_file)


# ---- what each rank runs ---------------------------------------------------------------------


def rank_launch(
    host_config: HostConfig, host: HostRecord, state: ClusterState, rank: int, gpu: int,
    kv_pages: int, kv_cache_mb: int, interface: str | None = None, join_timeout_s: float = 120.0,
    num_trusted_keys: int = 0, log_level: str = "warning", kv_dtype: str = "auto",
    draft_dir: str = "", exact_verification: bool = False,
) -> RankLaunch:  # fmt: skip
    """`interface`: what the preflight chose for collectives (hosts.nccl_interface when set);
    `num_trusted_keys`: public keys pushed beside the CURVE keys, which the rank then requires
    the package to be signed by; `log_level`, `kv_dtype`, `exact_verification`: the rank's
    (passed only when not the default); `draft_dir`: the draft package on the host (rank 0
    with orbit up --draft)."""
    flags = {
        # --package and --rank first and together: rank_marker() finds the process by them.
        "--package": host.package_dir,
        "--rank": str(rank),
        "--tp-size": str(state.tp_size),
        "--frontend": state.frontend_endpoint,
        "--dist-init": state.dist_init,
        "--device": host_config.device,
        "--kv-pages": str(kv_pages),
        "--kv-cache-mb": str(kv_cache_mb),
        "--threads": Raw('"$threads"') if host_config.device == "cpu" else "0",
        "--curve-dir": host.curve_dir,
        "--join-timeout-s": f"{join_timeout_s:g}",
    }
    if log_level != "warning":
        flags["--log-level"] = log_level
    if kv_dtype != "auto":
        flags["--kv-dtype"] = kv_dtype
    if draft_dir:
        flags["--draft-package"] = draft_dir
    argv = (host_config.python, "-m", "ranks", *(x for kv in flags.items() for x in kv))
    if exact_verification:
        argv += ("--exact-verification",)
    for i in range(num_trusted_keys):
        argv += ("--trusted-key", f"{host.curve_dir}/trusted-{i}.pub")
    base = f"{host.run_dir}/rank-{rank}"
    env = rank_env(host_config, gpu, interface)
    return RankLaunch(rank, argv, env, base + ".pid", base + ".log")


def rank_env(host: HostConfig, gpu: int, interface: str | None = None) -> dict[str, str]:
    """The rank's environment: interface pins, then the host's `env` (which may override
    them), then CUDA_VISIBLE_DEVICES, which maps rank to GPU and so is never overridden."""
    env = {"PYTHONUNBUFFERED": "1"}  # log lines reach `orbit logs --follow` as written
    interface = interface or host.nccl_interface
    if interface:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = interface
    env.update(host.env)
    if host.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def _threads_preamble(num_ranks: int) -> str:
    # CPU ranks share the host's cores, like `orbit serve`'s local ranks.
    return (
        f"threads=$(( $(nproc 2>/dev/null || echo 1) / {num_ranks} )); "
        '[ "$threads" -ge 1 ] || threads=1'
    )


# ---- start, wait, stop -----------------------------------------------------------------------


async def start_host(
    conn: asyncssh.SSHClientConnection, host: HostRecord, launches: list[RankLaunch],
    keys_dir: Path, on_state: RankStateFn, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> dict[int, int]:  # fmt: skip
    """Give the host the ranks' CURVE keys, start its ranks detached; return {rank: pid}."""
    ranks = [r.rank for r in launches]
    await push_rank_keys(conn, keys_dir, host.curve_dir, ranks, stall_timeout_s)
    pids = await launch_ranks(conn, host.run_dir, launches, _threads_preamble(len(launches)))
    for rank in pids:
        on_state(rank, host.label, "starting", "")
    return pids


async def wait_ready(
    link: BringUpLink,
    started: list[Started],
    digest: str,
    timeout_s: float,
    on_state: RankStateFn,
) -> None:
    """Return when every rank has sent Ready; raise RankStartError, naming the rank and host
    with its log tail, when one exits, loads another package, or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    next_probe = 0.0
    shown: dict[int, str] = {}
    while True:  # bounded by the deadline below
        _report(link, started, shown, on_state)
        _check_digests(link, started, digest)
        if all(r.ready is not None for r in link.ranks):
            return
        now = time.monotonic()
        if now >= next_probe:
            await _check_alive(link, started)
            next_probe = now + PROBE_INTERVAL_S
        if now >= deadline:
            raise await _not_ready_error(link, started, timeout_s)
        await asyncio.sleep(WAIT_TICK_S)


def _report(
    link: BringUpLink, started: list[Started], shown: dict[int, str], on_state: RankStateFn
) -> None:
    for s in started:
        rank = s.record.rank
        ready, last = link.ranks[rank].ready, link.last_phase(rank)
        state = "ready" if ready else phase_name(last.name) if last else None
        if state and shown.get(rank) != state:
            shown[rank] = state
            detail = phase_times_text(link, rank, ready) if ready else ""
            on_state(rank, s.host.label, state, detail)


def _check_digests(link: BringUpLink, started: list[Started], digest: str) -> None:
    for s in started:
        hello = link.ranks[s.record.rank].hello
        if hello is not None and hello.package_digest != digest:
            raise RankStartError(
                f"rank {s.record.rank} on {s.host.label} loaded package "
                f"{hello.package_digest[:12]}, not {digest[:12]}; remove "
                f"{s.host.package_dir} on that host and run `orbit up` again."
            )


def _by_host(started: list[Started]) -> list[list[Started]]:
    groups: dict[int, list[Started]] = {}
    for s in started:
        groups.setdefault(s.host.index, []).append(s)
    return list(groups.values())


async def _check_alive(link: BringUpLink, started: list[Started]) -> None:
    """Raise for the first rank whose process is gone, with its log tail."""
    probes = await run_all(
        probe_ranks(group[0].conn, [s.pid_ref() for s in group]) for group in _by_host(started)
    )
    found = {rank: proc for probe in probes for rank, proc in probe.items()}
    for s in started:
        proc = found.get(s.record.rank)
        if proc is None or not proc.alive:
            said = link.failure_messages.get(s.record.rank)
            said = f" It reported: {said}." if said else ""
            where = where_text(link, s.record.rank)
            others = "".join(
                f" Rank {o.record.rank} on {o.host.label}: {where_text(link, o.record.rank)}."
                for o in started
                if o is not s and link.ranks[o.record.rank].ready is None
            )
            raise await _rank_error(s, f"exited during start-up ({where}).{said}{others}")


async def _not_ready_error(
    link: BringUpLink, started: list[Started], timeout_s: float
) -> RankStartError:
    # Ranks that never connected first: a rank that connected usually waits for them in the
    # TP group, so the log worth showing is the first silent rank's.
    waiting = sorted(
        (s for s in started if link.ranks[s.record.rank].ready is None),
        key=lambda s: (link.ranks[s.record.rank].hello is not None, s.record.rank),
    )
    names = ", ".join(
        f"rank {s.record.rank} on {s.host.label} ({where_text(link, s.record.rank)})"
        for s in waiting
    )
    first = waiting[0]
    hint = ""
    if link.ranks[first.record.rank].hello is None:
        hint = (
            f" A rank that never connects cannot reach the frontend at {link.endpoint}: check "
            "frontend.address and the firewall for frontend.port_range."
        )
    what = f"was not ready within {timeout_s:g} s (waiting: {names}).{hint}"
    return await _rank_error(first, what)


async def _rank_error(s: Started, what: str) -> RankStartError:
    tail = await log_tail(s.conn, s.record.log_file, LOG_TAIL_LINES)
    return RankStartError(
        f"rank {s.record.rank} on {s.host.label} {what} Last lines of {s.record.log_file}:\n"
        + (tail or "(the log is empty)")
    )


async def stop_started(started: list[Started], grace_s: float, error: BaseException) -> None:
    """Stop every rank of a failed bring-up and drop the hosts' keys; add a note to the error
    saying whether that worked."""

    async def stop(group: list[Started]) -> str | None:
        host, conn = group[0].host, group[0].conn
        try:
            left = await stop_ranks(conn, [s.pid_ref() for s in group], grace_s)
        except ClusterError as e:
            return f"ranks on {host.label} may still run ({e})"
        if left:
            return f"ranks {left} on {host.label} survived SIGKILL"
        await remove_remote_dir(conn, host.curve_dir)
        return None

    # Shielded: a second Ctrl-C must not cut the clean-up short.
    problems = await asyncio.shield(asyncio.gather(*(stop(g) for g in _by_host(started))))
    problems = [p for p in problems if p]
    note = "; ".join(problems) if problems else "every rank this `orbit up` started was stopped."
    if isinstance(error, Exception):
        error.add_note(note)


# ---- the frontend endpoint -------------------------------------------------------------------


def pick_frontend_port(frontend: FrontendConfig) -> int:
    """A port of frontend.port_range free on frontend.address, tried in random order."""
    lo, hi = frontend.port_range
    ports = list(range(lo, hi + 1))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                s.bind((frontend.address, port))
                return port
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    raise _not_local(frontend.address) from None
    raise FrontendBindError(
        f"every port of frontend.port_range [{lo}, {hi}] is in use on {frontend.address}; "
        "widen the range in cluster.toml."
    )


def bind_frontend(
    tp_size: int, address: str, port: int, curve: ServerKeys, package_digest: str = ""
) -> BringUpLink:
    """The frontend's ROUTER on address:port, admitting only ranks with the cluster's CURVE
    client key; raises FrontendBindError with the fix."""
    try:
        return BringUpLink(
            tp_size, curve, bind_host=address, port=port, package_digest=package_digest
        )
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise _not_local(address) from None
        raise FrontendBindError(
            f"cannot bind the frontend endpoint tcp://{address}:{port} ({e.strerror}); another "
            "`orbit serve --cluster` or `orbit up` for this cluster is probably running."
        ) from None


def _not_local(address: str) -> FrontendBindError:
    return FrontendBindError(
        f"frontend.address {address} is not an address of this machine; run orbit here only if "
        "it is the frontend host, or set frontend.address to this machine's cluster address."
    )
