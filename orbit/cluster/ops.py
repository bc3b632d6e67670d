"""`orbit status`, `orbit logs` and `orbit down`: act on the ranks a state record lists.

Everything here works from the state record (orbit/cluster/state.py), not from cluster.toml:
it names the logins, pids and files that `orbit up` actually used. A host that cannot be reached
is reported, not skipped silently: `status` shows it, `down` keeps the record and fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from orbit.cluster.remote import (
    HostPool,
    RankPid,
    RankProcess,
    follow_log,
    gather_lines,
    log_tail,
    probe_ranks,
    rank_marker,
    remove_remote_dir,
    stop_ranks,
)
from orbit.cluster.ssh import DEFAULT_CONNECT_TIMEOUT_S, ClusterError
from orbit.cluster.state import (
    ClusterState,
    ClusterStateError,
    HostRecord,
    RankRecord,
    cluster_lock,
    load_state,
    remove_state,
)

DEFAULT_LOG_LINES = 50


class ClusterStopError(ClusterError):
    """Some ranks could not be confirmed stopped; the state record is kept."""


@dataclass(frozen=True)
class RankStatus:
    rank: RankRecord
    host: HostRecord
    alive: bool
    uptime_s: int | None
    error: str | None = None  # why the host could not be asked; alive is then False

    @property
    def reachable(self) -> bool:
        return self.error is None


def rank_pid(state: ClusterState, r: RankRecord) -> RankPid:
    return RankPid(r.rank, rank_marker(state.host_of(r).package_dir, r.rank), pid=r.pid)


def require_state(config_path: Path | str) -> ClusterState:
    state = load_state(config_path)
    if state is None:
        raise ClusterStateError(
            f"no cluster is recorded for {config_path}; bring it up with `orbit up {config_path}`."
        )
    return state


# ---- status ----------------------------------------------------------------------------------


async def probe_cluster(pool: HostPool, state: ClusterState) -> list[RankStatus]:
    """Every rank's status, host by host in parallel; an unreachable host marks its ranks."""
    per_host = await asyncio.gather(*(_probe_host(pool, state, h) for h in state.hosts))
    return sorted((s for statuses in per_host for s in statuses), key=lambda s: s.rank.rank)


async def _probe_host(pool: HostPool, state: ClusterState, host: HostRecord) -> list[RankStatus]:
    ranks = state.ranks_on(host.index)
    try:
        conn = await pool.get(host.host_config())
        found = await probe_ranks(conn, [rank_pid(state, r) for r in ranks])
    except ClusterError as e:
        return [RankStatus(r, host, False, None, str(e)) for r in ranks]
    return [_status(r, host, found.get(r.rank)) for r in ranks]


def _status(r: RankRecord, host: HostRecord, proc: RankProcess | None) -> RankStatus:
    if proc is None:
        return RankStatus(r, host, False, None)
    return RankStatus(r, host, proc.alive, proc.uptime_s)


async def state_status(
    state: ClusterState, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
) -> list[RankStatus]:
    """`orbit status`: each recorded rank, alive or not, with its uptime."""
    async with HostPool(False, connect_timeout_s) as pool:
        return await probe_cluster(pool, state)


async def all_alive(pool: HostPool, state: ClusterState) -> bool:
    return all(s.alive for s in await probe_cluster(pool, state))


# ---- down ------------------------------------------------------------------------------------


async def stop_cluster(pool: HostPool, state: ClusterState, grace_s: float) -> None:
    """SIGTERM every rank, SIGKILL after grace_s; raise ClusterStopError naming what is left."""
    problems = await asyncio.gather(*(_stop_host(pool, state, h, grace_s) for h in state.hosts))
    problems = [p for p in problems if p]
    if problems:
        raise ClusterStopError(
            "; ".join(problems) + ". The state record is kept: run `orbit down` again once the "
            "host is reachable, or stop those pids by hand."
        )


async def _stop_host(
    pool: HostPool, state: ClusterState, host: HostRecord, grace_s: float
) -> str | None:
    ranks = state.ranks_on(host.index)
    try:
        conn = await pool.get(host.host_config())
        left = await stop_ranks(conn, [rank_pid(state, r) for r in ranks], grace_s)
    except ClusterError as e:
        return f"ranks {[r.rank for r in ranks]} on {host.label} may still run ({e})"
    if left:
        pids = [r.pid for r in ranks if r.rank in left]
        return f"ranks {left} on {host.label} (pids {pids}) survived SIGKILL"
    await remove_remote_dir(conn, host.curve_dir)
    return None


async def cluster_down(
    config_path: Path | str,
    grace_s: float,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> ClusterState | None:
    """Stop every recorded rank and forget the cluster; None when nothing was recorded."""
    with cluster_lock(config_path):
        state = load_state(config_path)
        if state is None:
            return None
        async with HostPool(False, connect_timeout_s) as pool:
            await stop_cluster(pool, state, grace_s)
        remove_state(config_path)
    return state


# ---- logs ------------------------------------------------------------------------------------


def select_ranks(state: ClusterState, rank: int | None) -> list[RankRecord]:
    if rank is None:
        return list(state.ranks)
    if not 0 <= rank < state.tp_size:
        raise ClusterStateError(
            f"rank {rank} does not exist; this cluster has ranks 0 to {state.tp_size - 1}."
        )
    return [state.ranks[rank]]


async def cluster_logs(
    config_path: Path | str,
    rank: int | None,
    lines: int = DEFAULT_LOG_LINES,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> list[tuple[RankRecord, HostRecord, str]]:
    """The last `lines` of each selected rank's log, read over SSH."""
    state = require_state(config_path)
    chosen = select_ranks(state, rank)
    async with HostPool(False, connect_timeout_s) as pool:

        async def read(r: RankRecord) -> tuple[RankRecord, HostRecord, str]:
            conn = await pool.get(state.host_of(r).host_config())
            return r, state.host_of(r), await log_tail(conn, r.log_file, lines)

        return list(await asyncio.gather(*(read(r) for r in chosen)))


async def follow_cluster_logs(
    config_path: Path | str,
    rank: int | None,
    lines: int = DEFAULT_LOG_LINES,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> AsyncIterator[tuple[int, str]]:
    """(rank, line) as the ranks write them, until the caller stops iterating (Ctrl-C)."""
    state = require_state(config_path)
    chosen = select_ranks(state, rank)
    async with HostPool(False, connect_timeout_s) as pool:
        conns = {r.rank: await pool.get(state.host_of(r).host_config()) for r in chosen}
        streams = {r.rank: follow_log(conns[r.rank], r.log_file, lines) for r in chosen}
        async for item in gather_lines(streams):
            yield item
