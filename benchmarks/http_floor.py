"""The CPU floor of the API server's HTTP stack: what one SSE chunk costs a bare Starlette
StreamingResponse behind uvicorn (httptools, uvloop), with nothing of Orbit's behind it.

Each of `--streams` raw-socket clients reads a stream of `--chunks` pre-built 200-byte chunks;
every 10 ms (a step) one chunk goes to every stream, as the engine core's step messages wake
them. Prints the server process's CPU time per chunk. Compare with the API server's µs/token in
`benchmarks.serving_sweep` (issue 16: docs/performance.md).

    python3 -m benchmarks.http_floor [--streams 32] [--chunks 128] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

from benchmarks.serving_sweep import proc_stat
from orbit.core.local_ranks import free_port

CHUNK = (
    'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    '"created":1764800000,"model":"m","choices":[{"index":0,"text":" word",'
    '"logprobs":null,"finish_reason":null}]}\n\n'
)
STEP_S = 0.01


def serve(port: int, chunks: int) -> None:
    import uvicorn
    import uvloop
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    waiting: list[asyncio.Future] = []

    async def steps() -> None:
        while True:
            await asyncio.sleep(STEP_S)
            woken = waiting[:]
            waiting.clear()
            for f in woken:
                if not f.done():
                    f.set_result(None)

    async def body():
        loop = asyncio.get_running_loop()
        for _ in range(chunks):
            f = loop.create_future()
            waiting.append(f)
            await f
            yield CHUNK
        yield "data: [DONE]\n\n"

    async def stream(request):
        return StreamingResponse(body(), media_type="text/event-stream")

    async def main() -> None:
        asyncio.get_running_loop().create_task(steps())
        app = Starlette(routes=[Route("/s", stream)])
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", http="httptools", lifespan="off"
        )
        await uvicorn.Server(config).serve()

    uvloop.run(main())


async def read_streams(port: int, streams: int) -> int:
    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        got, tail = 0, b""
        while b"[DONE]" not in tail:
            data = await reader.read(65536)
            if not data:
                break
            got += data.count(b"data: {")
            tail = tail[-16:] + data
        writer.close()
        return got

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_port:
        serve(args.serve_port, args.chunks)
        return {}
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.http_floor", "--serve-port", str(port)]
    server = subprocess.Popen([*cmd, "--chunks", str(args.chunks)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        results = []
        for _ in range(args.rounds):
            before = proc_stat(str(server.pid))[1]
            chunks = asyncio.run(read_streams(port, args.streams))
            results.append((proc_stat(str(server.pid))[1] - before) / chunks * 1e6)
    finally:
        server.terminate()
        server.wait()
    report = {"streams": args.streams, "us_per_chunk": [round(r, 1) for r in results]}
    print(f"{args.streams} streams: server CPU per chunk {report['us_per_chunk']} µs")
    return report


if __name__ == "__main__":
    main()
