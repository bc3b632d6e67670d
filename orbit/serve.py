"""`orbit serve`: start a package's ranks on this machine, wait until all are ready, and serve
the HTTP API in front of them until SIGINT or SIGTERM.

Shutdown (drain): the listener stays open and new requests get 503 with Retry-After while
running ones finish, up to the drain deadline; streams still running then end with an error
event and `[DONE]`, non-streamed requests with 503. Then the listener closes, every rank is
told to stop, and TERM/KILL end any that did not. A second signal skips the drain.

A rank that exits or falls silent fails every in-flight request with 503 and turns /health
unhealthy; the frontend stays up and serves again once a new group of ranks is ready (local
ranks are restarted by the frontend, cluster ranks by the next `orbit up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from orbit.api import create_app, uvicorn_options
from orbit.cluster_serve import (
    HEARTBEAT_SILENCE_S,
    LoopLag,
    attach,
    bind_cluster_link,
    cluster_target,
    wait_for_new_bringup,
    watch_heartbeats,
)
from orbit.curve import ServerKeys, create_keys
from orbit.engine import Engine, EngineConfig, EngineError
from orbit.local_ranks import LocalRankOptions, LocalRanks
from orbit.rank_link import PackageMismatch, RankFailure, RankLink
from runtime.package import open_package

log = logging.getLogger("orbit.serve")


@dataclass(frozen=True)
class ServeOptions:
    package: Path
    host: str = "127.0.0.1"
    port: int = 8000
    ranks: LocalRankOptions = LocalRankOptions()
    model_name: str = ""  # "": the package's source name
    api_key: str | None = None
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    log_dir: Path | None = None
    trusted_keys: tuple[Path, ...] = ()  # non-empty: the package must be signed by one
    max_queue: int = 1024  # waiting requests beyond this get 429
    # cluster.toml of ranks that `orbit up` started: attach to them instead of starting local
    # ones (orbit/cluster_serve.py); `package` is then the one cluster.toml names.
    cluster: Path | None = None


# A local group that served at least this long restarts after the shortest pause; one that
# fails sooner doubles it (up to the longest), so a crash loop does not spin.
RESTART_PAUSE_S = (1.0, 30.0)
HEALTHY_RESET_S = 10.0
# After a failure the group cannot go on: survivors get this long to exit before TERM, then KILL.
FAILED_GROUP_GRACE_S = 1.0
# How long a failure reported by one rank waits for another rank's exit that may explain it.
CAUSE_WAIT_S = 1.0
# After the drain deadline, how long the cut streams get to send their error events.
DRAIN_FLUSH_S = 0.5


class _Server(uvicorn.Server):
    """uvicorn's server with a drain: on the first signal the engine refuses new work (503)
    while the listener stays open, running requests get until the deadline, and only then does
    uvicorn shut down. A second signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, engine: Engine, drain_timeout_s: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_stopping()
        if self._drain is None and not self.should_exit:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())
            return
        super().handle_exit(sig, frame)

    async def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while not self.engine.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.engine.idle:
            log.warning(
                "drain deadline of %g s passed; ending the requests left", self.drain_timeout_s
            )
            self.engine.fail(EngineError("the server is shutting down"))
            await asyncio.sleep(DRAIN_FLUSH_S)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a captured signal once it has shut down, which would kill this
        # process before it stops the ranks; handle SIGINT and SIGTERM here instead.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def serve(opts: ServeOptions, on_ready=None) -> int:
    """Run until a signal; returns the process exit code (1 when the ranks never got ready)."""
    from transformers import AutoTokenizer

    target = cluster_target(opts.cluster) if opts.cluster else None
    package = target.package if target else opts.package
    pkg = open_package(package, trusted_keys=_trusted(opts.trusted_keys))
    tokenizer = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    caps = pkg.capacities
    name = opts.model_name or pkg.manifest.source_name
    engine = Engine(
        EngineConfig(
            model_name=name,
            max_seq_len=caps.max_seq_len,
            max_batch=caps.max_batch,
            page_size=caps.kv_page_size,
            max_step_tokens=caps.max_step_tokens,
            eos_token_ids=tuple(pkg.manifest.tokenizer.eos_token_ids),
            max_queue=opts.max_queue,
        ),
        None,
        tokenizer,
    )
    server = _Server(
        uvicorn.Config(
            create_app(engine, name, api_key=opts.api_key),
            host=opts.host,
            port=opts.port,
            log_level="warning",
            lifespan="off",
            # The drain happened before uvicorn is told to exit (_Server); what is left are
            # idle keep-alive connections and the cut streams' last events.
            timeout_graceful_shutdown=5,
            **uvicorn_options(),
        ),
        engine,
        opts.drain_timeout_s,
    )
    generations = _ClusterRanks(target, pkg.digest) if target else _LocalRanks(opts, pkg)
    supervisor = asyncio.create_task(_supervise(engine, generations, opts, server, on_ready))
    try:
        await server.serve()
    finally:
        engine.begin_stopping()
        engine.fail(EngineError("the server is shutting down"))
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        generations.close()
    return 0 if generations.served and not generations.refused else 1


async def _supervise(engine: Engine, gens, opts: ServeOptions, server, on_ready) -> None:
    """Start a generation of ranks, serve until it fails, then bring up the next one; the
    HTTP server stays up throughout (503 while no generation is ready). Ranks that never get
    ready the first time, or that serve another package, end the server."""
    while True:
        link = await gens.start()
        try:
            try:
                await gens.ready(link)
                await engine.start(opts.ready_timeout_s, link=link)
            except RankFailure as e:
                log.error("%s", e)
                if not gens.served or isinstance(e, PackageMismatch):
                    gens.refused = isinstance(e, PackageMismatch)
                    server.should_exit = True
                    return
                continue
            if not gens.served and on_ready:
                on_ready(engine)
            gens.served = True
            ready_at = time.monotonic()
            watcher = asyncio.create_task(gens.watch(link, engine))
            try:
                await engine.run()  # returns when the engine fails
            finally:
                watcher.cancel()
            if engine.stopping:
                return
            cause = await gens.cause(link, engine)
            next_step = gens.after_failure(time.monotonic() - ready_at)
            log.error("serving stopped: %s; %s", cause, next_step)
        finally:
            await gens.stop(link)
        try:
            await gens.wait_for_next()
        except PackageMismatch as e:
            log.error("%s", e)
            gens.refused = True
            server.should_exit = True
            return


class _LocalRanks:
    """Generations of ranks that this process starts itself; after a failure the survivors
    are stopped and a new group is started, after a pause that grows only while groups keep
    failing soon after they start. The rank link's CURVE keys are made fresh for this run in a
    private folder, removed at exit."""

    def __init__(self, opts: ServeOptions, pkg):
        self.opts, self.pkg = opts, pkg
        self.served = self.refused = False
        self.ranks: LocalRanks | None = None
        self.pause_s = 0.0
        self.keys_dir = create_keys(Path(tempfile.mkdtemp(prefix="orbit-keys-")), pkg.tp_size)
        self.keys = ServerKeys.load(self.keys_dir)

    async def start(self) -> RankLink:
        link = RankLink(self.pkg.tp_size, self.keys, package_digest=self.pkg.digest)
        link.start()
        log_dir = self.opts.log_dir or Path(tempfile.mkdtemp(prefix="orbit-ranks-"))
        self.ranks = LocalRanks(
            self.pkg.root, self.pkg.tp_size, link.endpoint, log_dir, self.opts.ranks, self.keys_dir
        )
        self.ranks.start()
        return link

    async def ready(self, link: RankLink) -> None:
        pass  # the ranks connect by themselves; engine.start waits for them

    async def watch(self, link: RankLink, engine: Engine) -> None:
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

    async def stop(self, link: RankLink) -> None:
        if link.failure is not None:  # the group is broken: nobody waits on a hung rank
            if isinstance(link.failure, _Silent):
                self.ranks.kill([link.failure.rank])
            await link.shutdown("a rank failed; the TP group cannot continue")
            await asyncio.to_thread(self.ranks.stop, FAILED_GROUP_GRACE_S, FAILED_GROUP_GRACE_S)
        else:
            await link.shutdown("frontend stopping")
            await asyncio.to_thread(self.ranks.stop)
        link.close()

    async def wait_for_next(self) -> None:
        await asyncio.sleep(self.pause_s)

    def close(self) -> None:
        shutil.rmtree(self.keys_dir, ignore_errors=True)


class _ClusterRanks:
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
        if link.failure:  # a TP group cannot lose a member: the survivors must go too
            await link.shutdown("a rank failed; the TP group cannot continue")
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


def _trusted(paths: tuple[Path, ...]) -> list | None:
    if not paths:
        return None
    from runtime.signing import load_public_key

    return [load_public_key(p) for p in paths]


class _Silent(RankFailure):
    """A rank sent no heartbeat for too long: it is stopped or hung, and cannot exit by itself."""


def _exit_text(ranks: LocalRanks, rank: int, code: int) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"rank {rank} {how}; last lines of {ranks.log_path(rank)}:\n{ranks.log_tail(rank)}"


async def _watch_ranks(ranks: LocalRanks, link: RankLink, engine: Engine) -> None:
    """A rank process that exits, or falls silent (stopped, hung), ends the TP group: fail
    fast, with the log tail of an exited one."""
    lag = LoopLag(0.2)
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
        exited = ranks.exited()
        if exited:
            rank, code = exited[0]
            link.fail(RankFailure(_exit_text(ranks, rank, code), rank))
            engine.fail(EngineError(f"rank {rank} exited"))
            return
        await asyncio.sleep(0.2)
