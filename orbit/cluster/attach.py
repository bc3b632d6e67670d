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
from dataclasses import dataclass
from pathlib import Path

from orbit.cluster.config import load_cluster_config
from orbit.cluster.launch import bind_frontend
from orbit.cluster.ops import require_state
from orbit.cluster.state import ClusterState, ClusterStateError, load_state
from orbit.core.engine import Engine, EngineError
from orbit.core.rank_link import (
    HEARTBEAT_SILENCE_S,
    LoopLag,
    PackageMismatch,
    RankFailure,
    RankLink,
)
from runtime.curve import CurveError, ServerKeys
from runtime.package import MANIFEST_NAME

log = logging.getLogger("orbit.serve")

ATTACH_TIMEOUT_S = 30.0  # the ranks are loaded already; only ZeroMQ's reconnect is awaited
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


async def watch_heartbeats(link: RankLink, engine: Engine, target: ClusterTarget) -> None:
    """Fail everything when a rank falls silent."""
    lag = LoopLag(WATCH_INTERVAL_S)
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


class ClusterGenerations:
    """The ranks `orbit up` started. After a failure the endpoint is released so that the
    next `orbit up` can bring up a new group, which this frontend then attaches to if it runs
    the package this frontend serves (its tokenizer, name and capacities were read from it)."""

    def __init__(self, target, package_digest: str):
        self.target, self.package_digest = target, package_digest
        self.served = self.refused = False

    async def start(self) -> RankLink:
        link = bind_cluster_link(self.target, self.package_digest)
        link.start()
        return link

    async def ready(self, link: RankLink) -> None:
        await attach(link, self.target)

    async def watch(self, link: RankLink, engine: Engine) -> None:
        await watch_heartbeats(link, engine, self.target)

    async def cause(self, link: RankLink, engine: Engine) -> str:
        return str(link.failure or engine.error)

    def after_failure(self, served_s: float) -> str:
        config = self.target.state.config_path
        return f"waiting for `orbit up {config}` to bring up a new group of ranks"

    async def stop(self, link: RankLink) -> None:
        try:
            if link.failure:  # a TP group cannot lose a member: the survivors must go too
                await link.shutdown("a rank failed; the TP group cannot continue")
        finally:
            link.close()  # a normal stop leaves the ranks running for the next serve --cluster

    async def wait_for_next(self) -> None:
        target = await wait_for_new_bringup(self.target)
        if target.state.package_digest != self.package_digest:
            raise PackageMismatch(
                f"`orbit up` brought up package {target.state.package_digest[:12]}, but this "
                f"frontend serves package {self.package_digest[:12]}; restart `orbit serve "
                f"--cluster {target.state.config_path}` to serve the new package"
            )
        self.target = target

    def close(self) -> None:
        pass
