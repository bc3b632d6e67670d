"""Generations of a package's ranks on this machine: `orbit serve PKG` starts a group, serves
until it fails, and starts the next (orbit/serve.py drives the same interface for the ranks
`orbit up` started, orbit/cluster/attach.py).

After a failure the survivors get FAILED_GROUP_GRACE_S (a silent rank is killed at once: it
cannot answer a shutdown) and a new group starts after a pause that grows only while groups keep
failing soon after they start. The rank that caused a failure is named: a rank that exited
without reporting a failure, rather than the survivor whose collective broke because of it. The
rank link's CURVE keys are made fresh for the run in a private folder, removed at exit.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from orbit.core.engine import Engine, EngineError
from orbit.core.local_ranks import LocalRankOptions, LocalRanks
from orbit.core.rank_link import HEARTBEAT_SILENCE_S, LoopLag, RankFailure, RankLink
from runtime.curve import ServerKeys, create_keys
from runtime.package import Package

# A group that served at least HEALTHY_RESET_S restarts after the shortest pause; one that
# fails sooner doubles it (up to the longest), so a crash loop does not spin.
RESTART_PAUSE_S = (1.0, 30.0)
HEALTHY_RESET_S = 10.0
# After a failure the group cannot go on: survivors get this long to exit before TERM, then KILL.
FAILED_GROUP_GRACE_S = 1.0
# How long a failure reported by one rank waits for another rank's exit that may explain it.
CAUSE_WAIT_S = 1.0
WATCH_INTERVAL_S = 0.2


class LocalGenerations:
    """Generations of ranks that this process starts itself; after a failure the survivors
    are stopped and a new group is started, after a pause that grows only while groups keep
    failing soon after they start. The rank link's CURVE keys are made fresh for this run in a
    private folder, removed at exit."""

    def __init__(self, pkg: Package, options: LocalRankOptions, log_dir: Path | None):
        self.pkg, self.options, self.log_dir = pkg, options, log_dir
        self.served = self.refused = False
        self.ranks: LocalRanks | None = None
        self._starting: asyncio.Task | None = None  # _watch_start while the ranks start
        self.pause_s = 0.0
        self.keys_dir = create_keys(Path(tempfile.mkdtemp(prefix="orbit-keys-")), pkg.tp_size)
        self.keys = ServerKeys.load(self.keys_dir)

    async def start(self) -> RankLink:
        link = RankLink(self.pkg.tp_size, self.keys, package_digest=self.pkg.digest)
        try:
            link.start()
            log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="orbit-ranks-"))
            self.ranks = LocalRanks(
                self.pkg.root, self.pkg.tp_size, link.endpoint, log_dir, self.options, self.keys_dir
            )
            self.ranks.start()
        except BaseException:
            link.close()  # an unclosed link hangs the process when collected (RankLink.close)
            raise
        return link

    async def ready(self, link: RankLink) -> None:
        """The ranks connect by themselves and engine.start waits for them. Meanwhile a rank
        that dies without reporting a failure (a signal, a crash in native code) fails the
        link at once, naming it, rather than leaving the wait to its timeout."""
        self._starting = asyncio.create_task(_watch_start(self.ranks, link))

    async def watch(self, link: RankLink, engine: Engine) -> None:
        self._stop_start_watch()
        await _watch_ranks(self.ranks, link, engine)

    async def cause(self, link: RankLink, engine: Engine) -> str:
        """What ended the group. A rank that reports a failure is often only the first to see
        a peer die (its collective broke): a rank that exited without reporting one is named
        as the cause instead."""
        failure = link.failure
        if failure is None:
            return str(engine.error)
        if isinstance(failure, _Silent):
            return str(failure)  # the silent rank is the cause: the others wait on it
        deadline = time.monotonic() + CAUSE_WAIT_S
        while time.monotonic() < deadline:
            for rank, code in self.ranks.exited():
                if rank not in link.reported_failures:
                    return f"{_exit_text(self.ranks, rank, code)} (then: {failure})"
            await asyncio.sleep(0.05)
        return str(failure)

    def after_failure(self, served_s: float) -> str:
        lo, hi = RESTART_PAUSE_S
        self.pause_s = lo if served_s >= HEALTHY_RESET_S else min(max(lo, self.pause_s * 2), hi)
        return f"starting a new group of ranks in {self.pause_s:g} s"

    def _stop_start_watch(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
            self._starting = None

    async def stop(self, link: RankLink) -> None:
        self._stop_start_watch()
        try:
            if link.failure is not None:  # the group is broken: nobody waits on a hung rank
                if isinstance(link.failure, _Silent):
                    self.ranks.kill([link.failure.rank])
                await link.shutdown("a rank failed; the TP group cannot continue")
                await asyncio.to_thread(self.ranks.stop, FAILED_GROUP_GRACE_S, FAILED_GROUP_GRACE_S)
            else:
                await link.shutdown("frontend stopping")
                await asyncio.to_thread(self.ranks.stop)
        finally:
            link.close()  # also when the stop is cancelled: see RankLink.close

    async def wait_for_next(self) -> None:
        await asyncio.sleep(self.pause_s)

    def close(self) -> None:
        shutil.rmtree(self.keys_dir, ignore_errors=True)


class _Silent(RankFailure):
    """A rank sent no heartbeat for too long: it is stopped or hung, and cannot exit by itself."""


def _exit_text(ranks: LocalRanks, rank: int, code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} {how}; last lines of {ranks.log_path(rank)}:\n{ranks.log_tail(rank)}"


def _exit_failure(ranks: LocalRanks) -> RankFailure | None:
    """The failure of the first rank process that exited, with its log tail; None while all run."""
    exited = ranks.exited()
    if not exited:
        return None
    rank, code = exited[0]
    return RankFailure(_exit_text(ranks, rank, code), rank)


async def _watch_start(ranks: LocalRanks, link: RankLink) -> None:
    """Until cancelled (the group is ready, or stopped): a rank process that exits fails the
    link with its exit and log tail, which ends the link's wait for Ready."""
    while (failure := _exit_failure(ranks)) is None:
        await asyncio.sleep(WATCH_INTERVAL_S)
    link.fail(failure)


async def _watch_ranks(ranks: LocalRanks, link: RankLink, engine: Engine) -> None:
    """A rank process that exits, or falls silent (stopped, hung), ends the TP group: fail
    fast, with the log tail of an exited one."""
    lag = LoopLag(WATCH_INTERVAL_S)
    while True:
        silent = link.silent_ranks(HEARTBEAT_SILENCE_S) if lag.caught_up() else []
        if silent:
            failure = _Silent(
                f"rank {silent[0]} sent no heartbeat for {HEARTBEAT_SILENCE_S:g} s "
                f"(stopped or hung); see {ranks.log_path(silent[0])}",
                silent[0],
            )
            link.fail(failure)
            engine.fail(EngineError(str(failure)))
            return
        failure = _exit_failure(ranks)
        if failure is not None:
            link.fail(failure)
            engine.fail(EngineError(f"rank {failure.rank} exited"))
            return
        await asyncio.sleep(WATCH_INTERVAL_S)
