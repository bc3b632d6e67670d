"""`orbit serve`: start a package's ranks on this machine, wait until all are ready, and serve
the HTTP API in front of them until SIGINT or SIGTERM.

Shutdown: new requests get 503, running ones finish (up to the drain deadline, after which
uvicorn closes them), then every rank is told to stop, and TERM/KILL end any that did not.
A rank that exits or falls silent fails every in-flight request with 503 and turns /health
unhealthy; the frontend stays up and serves again once a new group of ranks is ready (local
ranks are restarted by the frontend, cluster ranks by the next `orbit up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from orbit.api import create_app
from orbit.cluster_serve import (
    HEARTBEAT_SILENCE_S,
    attach,
    bind_cluster_link,
    cluster_target,
    wait_for_new_bringup,
    watch_heartbeats,
)
from orbit.engine import Engine, EngineConfig, EngineError
from orbit.local_ranks import LocalRankOptions, LocalRanks
from orbit.rank_link import RankFailure, RankLink
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


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine to refuse new work as soon as a signal arrives."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_stopping()
        super().handle_exit(sig, frame)

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
            timeout_graceful_shutdown=int(opts.drain_timeout_s),
        ),
        engine,
    )
    generations = _ClusterRanks(target) if target else _LocalRanks(opts, pkg)
    supervisor = asyncio.create_task(_supervise(engine, generations, opts, server, on_ready))
    try:
        await server.serve()
    finally:
        engine.begin_stopping()
        engine.fail(EngineError("the server is shutting down"))
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
    return 0 if generations.served else 1


async def _supervise(engine: Engine, gens, opts: ServeOptions, server, on_ready) -> None:
    """Start a generation of ranks, serve until it fails, then bring up the next one; the
    HTTP server stays up throughout (503 while no generation is ready). Ranks that never get
    ready the first time end the server."""
    while True:
        link = await gens.start()
        try:
            try:
                await gens.ready(link)
                await engine.start(opts.ready_timeout_s, link=link)
            except RankFailure as e:
                log.error("%s", e)
                if not gens.served:
                    server.should_exit = True
                    return
                continue
            if not gens.served and on_ready:
                on_ready(engine)
            gens.served = True
            watcher = asyncio.create_task(gens.watch(link, engine))
            try:
                await engine.run()  # returns when the engine fails
            finally:
                watcher.cancel()
            if engine.stopping:
                return
            log.error("serving stopped: %s; bringing the ranks back", link.failure)
        finally:
            await gens.stop(link)
        await gens.wait_for_next()


class _LocalRanks:
    """Generations of ranks that this process starts itself; after a failure the survivors
    are stopped and a new group is started, with a growing pause between attempts."""

    def __init__(self, opts: ServeOptions, pkg):
        self.opts, self.pkg = opts, pkg
        self.served = False
        self.ranks: LocalRanks | None = None
        self.pause_s = 1.0

    async def start(self) -> RankLink:
        link = RankLink(self.pkg.tp_size)
        link.start()
        log_dir = self.opts.log_dir or Path(tempfile.mkdtemp(prefix="orbit-ranks-"))
        self.ranks = LocalRanks(
            self.pkg.root, self.pkg.tp_size, link.endpoint, log_dir, self.opts.ranks
        )
        self.ranks.start()
        return link

    async def ready(self, link: RankLink) -> None:
        pass  # the ranks connect by themselves; engine.start waits for them

    async def watch(self, link: RankLink, engine: Engine) -> None:
        await _watch_ranks(self.ranks, link, engine)

    async def stop(self, link: RankLink) -> None:
        await link.shutdown("frontend stopping")
        await asyncio.to_thread(self.ranks.stop)
        link.close()

    async def wait_for_next(self) -> None:
        await asyncio.sleep(self.pause_s)
        self.pause_s = min(self.pause_s * 2, 30.0)


class _ClusterRanks:
    """The ranks `orbit up` started. After a failure the endpoint is released so that the
    next `orbit up` can bring up a new group, which this frontend then attaches to."""

    def __init__(self, target):
        self.target = target
        self.served = False

    async def start(self) -> RankLink:
        link = bind_cluster_link(self.target)
        link.start()
        return link

    async def ready(self, link: RankLink) -> None:
        await attach(link, self.target)

    async def watch(self, link: RankLink, engine: Engine) -> None:
        await watch_heartbeats(link, engine, self.target)

    async def stop(self, link: RankLink) -> None:
        if link.failure:  # a TP group cannot lose a member: the survivors must go too
            await link.shutdown("a rank failed; the TP group cannot continue")
        link.close()  # a normal stop leaves the ranks running for the next serve --cluster

    async def wait_for_next(self) -> None:
        self.target = await wait_for_new_bringup(self.target)


def _trusted(paths: tuple[Path, ...]) -> list | None:
    if not paths:
        return None
    from runtime.signing import load_public_key

    return [load_public_key(p) for p in paths]


async def _watch_ranks(ranks: LocalRanks, link: RankLink, engine: Engine) -> None:
    """A rank process that exits, or falls silent (stopped, hung), ends the TP group: fail
    fast, with the log tail of an exited one."""
    while True:
        silent = link.silent_ranks(HEARTBEAT_SILENCE_S)
        if silent:
            failure = RankFailure(
                f"rank {silent[0]} sent no heartbeat for {HEARTBEAT_SILENCE_S:g} s "
                f"(stopped or hung); see {ranks.log_path(silent[0])}"
            )
            link.fail(failure)
            engine.fail(EngineError(str(failure)))
            return
        exited = ranks.exited()
        if exited:
            rank, code = exited[0]
            failure = RankFailure(
                f"rank {rank} exited with code {code}; last lines of {ranks.log_path(rank)}:\n"
                + ranks.log_tail(rank)
            )
            link.fail(failure)
            engine.fail(EngineError(f"rank {rank} exited"))
            return
        await asyncio.sleep(0.2)
