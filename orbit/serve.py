"""`orbit serve`: the engine core process. It opens the package, binds the HTTP socket, starts
the API server processes on it (orbit/http/server.py) and the ranks (or attaches to those
`orbit up` started), and runs the scheduler and step loop until SIGINT or SIGTERM.

Processes: this one (the engine core: orbit/core/) owns the rank link, the scheduler and the
step loop, and nothing else runs on its event loop but the links' readers and the supervisors;
`--api-servers` processes (orbit/http/) do HTTP, request checks, tokenization, detokenization
and SSE, talking to the core over an IPC socket in a private run folder; one rank process per
GPU (ranks/).

Shutdown (drain): new requests get 503 with Retry-After while running ones finish, up to the
drain deadline; the listener stays open throughout. Streams still running then end with an
error event and `[DONE]`, non-streamed requests with 503. Then the API servers and the ranks are
stopped. A second signal skips the drain.

A rank that exits or falls silent fails every in-flight request with 503 and turns /health
unhealthy; the core stays up and serves again once a new group of ranks is ready (local ranks
are restarted by the core, cluster ranks by the next `orbit up`). An API server that dies is
replaced; its sequences are aborted and the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from orbit.core.api_link import ApiLink
from orbit.core.api_servers import ApiServers, default_api_servers
from orbit.core.engine import Engine, EngineConfig, EngineError
from orbit.core.generations import LocalGenerations
from orbit.core.listen import bind_http
from orbit.core.local_ranks import LocalRankOptions
from orbit.core.rank_link import PackageMismatch, RankFailure
from orbit.http.server import ApiServerConfig
from orbit.model_names import served_model_ids
from orbit.serve_checks import max_model_len_message
from runtime.package import open_package
from runtime.speculation import SpeculationConfig

log = logging.getLogger("orbit.serve")


class ServeError(ValueError):
    """A setting of `orbit serve` that does not fit the package."""


# After the drain deadline, how long the cut streams get to send their error events.
DRAIN_FLUSH_S = 0.5


@dataclass(frozen=True)
class ServeOptions:
    package: Path
    host: str = "127.0.0.1"
    port: int = 8000
    ranks: LocalRankOptions = field(default_factory=LocalRankOptions)
    model_name: str = ""  # comma-separated ids, the listed one first; "": from the source name
    api_key: str | None = None
    api_servers: int = 0  # 0: default_api_servers() for this machine and device
    ready_timeout_s: float = 600.0
    drain_timeout_s: float = 30.0
    log_dir: Path | None = None
    trusted_keys: tuple[Path, ...] = ()  # non-empty: the package must be signed by one
    max_queue: int = 1024  # waiting requests beyond this get 429
    stream_interval: int = 1  # tokens a stream's writes carry (EngineConfig.stream_interval)
    prefix_cache: bool = True
    speculation: SpeculationConfig | None = None  # speculative decoding; None: off
    # cluster.toml of ranks that `orbit up` started: attach to them instead of starting local
    # ones (orbit/cluster/attach.py); `package` is then the one cluster.toml names.
    cluster: Path | None = None
    log_level: str = "warning"  # of the API servers (the core's and ranks' are set by the CLI)
    chat_template: str | None = None  # Jinja text that replaces the package's chat template
    max_model_len: int = 0  # 0: the package's max_seq_len; else at most that


async def serve(opts: ServeOptions, on_ready=None) -> int:
    """Run until a signal; returns the process exit code (1 when the ranks never got ready or
    serve another package). Raises ListenError when the HTTP address cannot be bound, and
    ServeError when --max-model-len exceeds the package's."""
    target = None
    if opts.cluster:
        from orbit.cluster.attach import cluster_target

        target = cluster_target(opts.cluster)
    package = target.package if target else opts.package
    pkg = open_package(package, trusted_keys=_trusted(opts.trusted_keys))
    caps = pkg.capacities
    max_seq_len = _max_seq_len(opts.max_model_len, caps.max_seq_len, package)
    engine = Engine(
        EngineConfig(
            max_seq_len=max_seq_len,
            max_batch=caps.max_batch,
            page_size=caps.kv_page_size,
            max_step_tokens=caps.max_step_tokens,
            token_buckets=caps.prefill_chunk_sizes,
            eos_token_ids=tuple(pkg.manifest.tokenizer.eos_token_ids),
            max_queue=opts.max_queue,
            stream_interval=opts.stream_interval,
            prefix_cache=opts.prefix_cache,
            speculation=opts.speculation,
            cache_salt=bytes.fromhex(pkg.digest),
        ),
        None,
    )
    listener = bind_http(opts.host, opts.port)
    run_dir = Path(tempfile.mkdtemp(prefix="orbit-serve-"))  # owner-only
    api_link = ApiLink(engine, f"ipc://{run_dir}/core.sock", engine.metrics_text)
    api_link.start()
    name, *aliases = served_model_ids(opts.model_name, pkg.manifest.source_name)
    config = ApiServerConfig(
        str(pkg.root),
        name,
        api_link.endpoint,
        opts.api_key,
        log_level=opts.log_level,
        model_aliases=tuple(aliases),
        chat_template=opts.chat_template,
        max_seq_len=max_seq_len,
    )
    config.save(run_dir / "api-server.json")
    ranks_on_cpu = target is None and opts.ranks.device == "cpu"
    count = opts.api_servers or default_api_servers(ranks_on_cpu)
    api_servers = ApiServers(count, run_dir / "api-server.json", listener, api_link)
    api_servers.start()
    log.info(
        "serving %s as %s (context %d tokens); starting its ranks",
        pkg.root, ", ".join((name, *aliases)), max_seq_len,
    )  # fmt: skip
    if target:
        from orbit.cluster.attach import ClusterGenerations

        generations = ClusterGenerations(target, pkg.digest)
    else:
        generations = LocalGenerations(pkg, opts.ranks, opts.log_dir)
    # What startup made (modules, the package, the engine) lives as long as the process: a full
    # collection would walk all of it again (57 ms in an API server's heap of that size).
    gc.freeze()
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(_supervise(engine, generations, opts, stop, on_ready)),
        asyncio.create_task(_watch_api_servers(api_servers, stop)),
    ]
    try:
        with _signals(engine, opts.drain_timeout_s, stop):
            await stop.wait()
    finally:
        engine.begin_stopping()
        engine.fail(EngineError("the server is shutting down"))
        await asyncio.sleep(0)  # the failure's outputs leave before the API servers are told
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.to_thread(api_servers.stop)
        api_link.close()
        listener.close()
        generations.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    if api_servers.failure:
        return 1
    return 0 if generations.served and not generations.refused else 1


async def _watch_api_servers(api_servers: ApiServers, stop: asyncio.Event) -> None:
    await api_servers.watch()  # returns only when one cannot start
    stop.set()


@contextlib.contextmanager
def _signals(engine: Engine, drain_timeout_s: float, stop: asyncio.Event):
    """SIGINT and SIGTERM: the first drains, a second stops at once."""
    loop = asyncio.get_running_loop()
    drain: list[asyncio.Task] = []

    def on_signal() -> None:
        if drain:
            stop.set()
        else:
            drain.append(loop.create_task(_drain(engine, drain_timeout_s, stop)))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in drain:
            task.cancel()


async def _drain(engine: Engine, timeout_s: float, stop: asyncio.Event) -> None:
    engine.begin_stopping()  # the API servers answer 503 from their next status on
    deadline = time.monotonic() + timeout_s
    while not engine.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not engine.idle:
        log.warning("drain deadline of %g s passed; ending the requests left", timeout_s)
        engine.fail(EngineError("the server is shutting down"))
        await asyncio.sleep(DRAIN_FLUSH_S)
    stop.set()


async def _supervise(engine: Engine, gens, opts: ServeOptions, stop, on_ready) -> None:
    """Start a generation of ranks, serve until it fails, then bring up the next one; the
    API servers stay up throughout (503 while no generation is ready). Ranks that never get
    ready the first time, or that serve another package, end the server."""
    while True:
        link = await gens.start()
        try:
            try:
                await gens.ready(link)
                await engine.start(opts.ready_timeout_s, link=link)
            except RankFailure as e:
                if not gens.served or isinstance(e, PackageMismatch):
                    log.error("%s", e)
                    gens.refused = isinstance(e, PackageMismatch)
                    stop.set()
                    return
                # a group that fails as it starts waits for the next as one failing at once
                log.error("%s; %s", e, gens.after_failure(0.0))
            else:
                if await _serve_group(engine, gens, link, on_ready):
                    return
        finally:
            await gens.stop(link)
        try:
            await gens.wait_for_next()
        except PackageMismatch as e:
            log.error("%s", e)
            gens.refused = True
            stop.set()
            return


async def _serve_group(engine: Engine, gens, link, on_ready) -> bool:
    """Serve on a ready group until the engine fails or stops; True when it stops."""
    log.info("the ranks are ready: serving requests")
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
        return True
    cause = await gens.cause(link, engine)
    next_step = gens.after_failure(time.monotonic() - ready_at)
    log.error("serving stopped: %s; %s", cause, next_step)
    return False


def _max_seq_len(max_model_len: int, package_max: int, package: Path) -> int:
    """--max-model-len, checked against the package: it can lower the context, never raise it
    (the package's KV layout and kernels were prepared for its own)."""
    if max_model_len == 0:
        return package_max
    if not 2 <= max_model_len <= package_max:
        raise ServeError(max_model_len_message(max_model_len, package_max, package))
    return max_model_len


def _trusted(paths: tuple[Path, ...]) -> list | None:
    if not paths:
        return None
    from runtime.signing import load_public_key

    return [load_public_key(p) for p in paths]
