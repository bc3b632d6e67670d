"""What `orbit serve --cluster cluster.toml` adds to `orbit serve`: take over the ranks that
`orbit up` started instead of starting local ones, and watch them by heartbeat.

The frontend binds the endpoint the ranks were started with (recorded by `orbit up`), sends
Attach, and waits for every rank's Hello and Ready. The ranks are not its children, so it
watches them by their heartbeats (sent every second by a thread of each rank). When serve stops
normally the ranks keep running for the next `orbit serve --cluster`; when a rank fails, the
survivors are told to shut down (a TP group cannot lose a member), the endpoint is released, and
the frontend waits for `orbit up` to record a new group, then attaches to it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from orbit.cluster_config import load_cluster_config
from orbit.cluster_launch import bind_frontend
from orbit.cluster_ops import require_state
from orbit.cluster_state import ClusterState, ClusterStateError, load_state
from orbit.curve import CurveError, ServerKeys
from orbit.engine import Engine, EngineError
from orbit.rank_link import RankFailure, RankLink
from runtime.package import MANIFEST_NAME

log = logging.getLogger("orbit.serve")

ATTACH_TIMEOUT_S = 30.0  # the ranks are loaded already; only ZeroMQ's reconnect is awaited
HEARTBEAT_SILENCE_S = 5.0  # five missed one-second heartbeats
NEW_BRINGUP_POLL_S = 1.0
WATCH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ClusterTarget:
    """The running ranks of one cluster.toml, as `orbit up` recorded them."""

    package: Path  # the local package: the frontend needs its tokenizer and capacities
    state: ClusterState


def cluster_target(config_path: Path) -> ClusterTarget:
    """Read cluster.toml and its state record; raise unless the recorded ranks run the package
    that cluster.toml names now."""
    config = load_cluster_config(config_path)
    state = require_state(config_path)
    digest = hashlib.sha256((config.package / MANIFEST_NAME).read_bytes()).hexdigest()
    if digest != state.package_digest:
        raise ClusterStateError(
            f"the ranks of {config_path} run package {state.package_digest[:12]} but "
            f"{config.package} is {digest[:12]}; run `orbit up {config_path}` to replace them."
        )
    return ClusterTarget(config.package, state)


def bind_cluster_link(target: ClusterTarget, package_digest: str) -> RankLink:
    """The endpoint the ranks were started with, secured with the cluster's CURVE keys; ranks
    that say (in their Hello) they run a package other than package_digest fail the link."""
    state = target.state
    try:
        keys = ServerKeys.load(Path(state.curve_dir))
    except CurveError as e:
        raise ClusterStateError(
            f"{e} The cluster's keys are gone; run `orbit up {state.config_path}` again."
        ) from None
    return bind_frontend(
        state.tp_size, state.frontend_address, state.frontend_port, keys, package_digest
    )


async def attach(link: RankLink, target: ClusterTarget) -> None:
    """Take over the running ranks; the RankFailure says what to check."""
    try:
        await link.attach(ATTACH_TIMEOUT_S)
    except RankFailure as e:
        config = target.state.config_path
        link.fail(
            RankFailure(
                f"{e}; check them with `orbit status {config}` and bring them up again with "
                f"`orbit up {config}`."
            )
        )
        raise link.failure from None


class LoopLag:
    """Whether this event loop ran on time since the last look. After a stall of the loop
    itself, heartbeats wait unread in the socket: silence is judged only once the reader has
    had a turn to take them."""

    def __init__(self, interval_s: float = WATCH_INTERVAL_S):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def caught_up(self) -> bool:
        now = time.monotonic()
        on_time = now - self._last < self.interval_s + 1.0
        self._last = now
        return on_time


async def watch_heartbeats(link: RankLink, engine: Engine, target: ClusterTarget) -> None:
    """Fail everything when a rank falls silent."""
    lag = LoopLag()
    while link.failure is None:
        silent = link.silent_ranks(HEARTBEAT_SILENCE_S) if lag.caught_up() else []
        if silent:
            host = target.state.host_of(target.state.ranks[silent[0]]).label
            link.fail(
                RankFailure(
                    f"rank {silent[0]} on {host} sent nothing for {HEARTBEAT_SILENCE_S:g} s; "
                    f"see `orbit logs {target.state.config_path} --rank {silent[0]}`."
                )
            )
            break
        await asyncio.sleep(WATCH_INTERVAL_S)
    engine.fail(EngineError(str(link.failure)))


async def wait_for_new_bringup(target: ClusterTarget) -> ClusterTarget:
    """After a failure: wait until `orbit up` records a new group of ranks, then aim at it."""
    config = Path(target.state.config_path)
    while True:
        await asyncio.sleep(NEW_BRINGUP_POLL_S)
        state = load_state(config)
        if state is not None and state.started_at != target.state.started_at:
            try:
                return cluster_target(config)
            except (ClusterStateError, OSError) as e:
                log.warning("the new bring-up of %s is not usable yet: %s", config, e)
