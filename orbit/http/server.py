"""An API server process of `orbit serve` (`python -m orbit.http`): the OpenAI-compatible HTTP
API on the listening socket the engine core opened and handed down, with its own tokenizer and
detokenizers, talking to the core over its IPC socket (orbit/http/core_client.py).

The core starts `--api-servers` of these, each in a session of its own (a Ctrl-C at the
terminal reaches only the core), and restarts one that dies. The settings come from a file the
core wrote in its private run folder, so the API key never shows in `ps`. A server whose parent
core is gone ends its streams with an error event and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import uvloop

log = logging.getLogger("orbit.http")

PARENT_POLL_S = 1.0
# After the core is gone: time for the streams' error events to reach their clients.
FLUSH_S = 1.0


@dataclass(frozen=True)
class ApiServerConfig:
    """What every API server of one `orbit serve` shares; written by the core as JSON."""

    package: str
    model_name: str  # the listed id
    core_endpoint: str
    api_key: str | None = None
    log_level: str = "warning"
    model_aliases: tuple[str, ...] = ()  # further ids requests may use
    chat_template: str | None = None  # Jinja text that replaces the package's (--chat-template)
    max_seq_len: int = 0  # 0: the package's; else --max-model-len, at most the package's

    def save(self, path: Path) -> None:
        """Owner-only, written to a temporary name and renamed into place."""
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.__dict__, f)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ApiServerConfig:
        fields = json.loads(Path(path).read_text())
        return cls(**{**fields, "model_aliases": tuple(fields.get("model_aliases", ()))})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orbit.http", description=__doc__)
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--index", required=True, type=int)
    p.add_argument("--fd", required=True, type=int, help="the listening socket, inherited")
    args = p.parse_args(argv)
    cfg = ApiServerConfig.load(args.config)
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format=f"%(asctime)s api-{args.index} %(name)s %(levelname)s %(message)s",
    )
    # uvloop: the per-stream writes and socket reads of many concurrent streams cost less.
    uvloop.run(serve(cfg, args.index, socket.socket(fileno=args.fd)))
    return 0


async def serve(cfg: ApiServerConfig, index: int, listener: socket.socket) -> None:
    from transformers import AutoTokenizer

    from orbit.http.app import create_app, uvicorn_options
    from orbit.http.core_client import CoreClient
    from orbit.http.metrics import FrontendMetrics
    from orbit.http.schema_check import SchemaChecker
    from runtime.package import open_package

    pkg = open_package(cfg.package)
    tokenizer = AutoTokenizer.from_pretrained(str(pkg.tokenizer_dir))
    if cfg.chat_template is not None:
        tokenizer.chat_template = cfg.chat_template
    metrics = FrontendMetrics()
    max_seq_len = cfg.max_seq_len or pkg.capacities.max_seq_len
    client = CoreClient(cfg.core_endpoint, index, metrics.render, tokenizer, max_seq_len)
    await client.start()
    schemas = SchemaChecker(tokenizer)
    schemas.warm_async()  # its child process imports xgrammar: seconds the first schema saves
    app = create_app(
        client,
        cfg.model_name,
        api_key=cfg.api_key,
        metrics=metrics,
        server_index=index,
        model_aliases=cfg.model_aliases,
        schema_checker=schemas,
    )
    try:
        await app.state.warm_up()
    except Exception:  # noqa: BLE001 - cold first requests are better than no API server
        log.warning("warming up the request path failed; serving without it", exc_info=True)
    # The startup heap (transformers, the tokenizer, the app: about 256,000 objects) lives as long
    # as the process; frozen, the collector never walks it again (a full collection of it took
    # 57 ms, a stall of every stream).
    gc.freeze()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,  # orbit.access writes one line per request (orbit/http/access_log.py)
            lifespan="off",
            # The drain happens in the core before it stops this server: what is left are idle
            # keep-alive connections and the cut streams' last events.
            timeout_graceful_shutdown=5,
            **uvicorn_options(),
        )
    )
    watcher = asyncio.create_task(_exit_with_parent(server, client))
    try:
        await server.serve(sockets=[listener])
    finally:
        watcher.cancel()
        client.close()


async def _exit_with_parent(server: uvicorn.Server, client) -> None:
    parent = os.getppid()
    while os.getppid() == parent and not client.dead:
        await asyncio.sleep(PARENT_POLL_S)
    log.error("the engine core is gone; ending the streams and exiting")
    client.fail_all("the engine core stopped")
    await asyncio.sleep(FLUSH_S)
    server.should_exit = True
