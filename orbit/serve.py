"""`orbit serve`: start a package's ranks on this machine, wait until all are ready, and serve
the HTTP API in front of them until SIGINT or SIGTERM.

Shutdown: new requests get 503, running ones finish (up to the drain deadline, after which
uvicorn closes them), then every rank is told to stop, and TERM/KILL end any that did not.
A rank that exits fails every in-flight request with 503 and turns /health unhealthy.
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
from orbit.cluster_serve import attach, bind_cluster_link, cluster_target, watch_heartbeats
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
    """Run until a signal or a rank failure; returns the process exit code."""
    from transformers import AutoTokenizer

    target = cluster_target(opts.cluster) if opts.cluster else None
    package = target.package if target else opts.package
    pkg = open_package(package, trusted_keys=_trusted(opts.trusted_keys))
    tokenizer = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    caps = pkg.capacities
    name = opts.model_name or pkg.manifest.source_name
    link = bind_cluster_link(target) if target else RankLink(pkg.tp_size)
    link.start()
    ranks = None if target else _local_ranks(opts, pkg, link)
    engine = Engine(EngineConfig(
        model_name=name, max_seq_len=caps.max_seq_len, max_batch=caps.max_batch,
        page_size=caps.kv_page_size, max_step_tokens=caps.max_step_tokens,
        eos_token_ids=tuple(pkg.manifest.tokenizer.eos_token_ids), max_queue=opts.max_queue,
    ), link, tokenizer)
    server = _Server(uvicorn.Config(
        create_app(engine, name, api_key=opts.api_key), host=opts.host, port=opts.port,
        log_level="warning", lifespan="off", timeout_graceful_shutdown=int(opts.drain_timeout_s),
    ), engine)
    if ranks:
        ranks.start()
        watcher = asyncio.create_task(_watch_ranks(ranks, link, engine))
    else:
        watcher = asyncio.create_task(watch_heartbeats(link, engine, target))
    runner = asyncio.create_task(_start_engine(engine, opts, server, on_ready, target))
    try:
        await server.serve()
    finally:
        engine.begin_stopping()
        engine.fail(EngineError("the server is shutting down"))
        for task in (runner, watcher):
            task.cancel()
        if ranks:  # cluster ranks outlive this frontend: `orbit down` stops them
            await link.shutdown("frontend stopping")
            await asyncio.to_thread(ranks.stop)
        link.close()
    return 1 if link.failure else 0


def _trusted(paths: tuple[Path, ...]) -> list | None:
    if not paths:
        return None
    from runtime.signing import load_public_key

    return [load_public_key(p) for p in paths]


def _local_ranks(opts: ServeOptions, pkg, link: RankLink) -> LocalRanks:
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="orbit-ranks-"))
    return LocalRanks(pkg.root, pkg.tp_size, link.endpoint, log_dir, opts.ranks)


async def _start_engine(
    engine: Engine, opts: ServeOptions, server: uvicorn.Server, on_ready, target=None
):
    try:
        if target:
            await attach(engine.link, target)
        await engine.start(opts.ready_timeout_s)
    except RankFailure as e:
        log.error("%s", e)
        server.should_exit = True
        return
    if on_ready:
        on_ready(engine)
    await engine.run()


async def _watch_ranks(ranks: LocalRanks, link: RankLink, engine: Engine) -> None:
    """A rank process that exits ends the TP group: fail fast with its log tail."""
    while True:
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
