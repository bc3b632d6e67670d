"""The engine core and its API server processes (`orbit serve --api-servers N`), on CPU with
real processes: an API server dying leaves the core and the other servers' streams running and
is replaced; the core dying ends every stream with an error event; the core's link drops
malformed messages and answers a sequence it cannot admit with an error output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from benchmarks.step_overhead import engine_config, local_ranks, running_engine
from orbit.core.api_link import STATUS_INTERVAL_S, ApiLink
from orbit.core.api_servers import default_api_servers
from orbit.core.engine import Engine, EngineConfig, Sink
from proto import core_pb2, wire_pb2
from runtime.package import open_package
from tests.server import ServerProcess, alive, children

MAX_TOKENS = 200


def test_one_api_server_by_default_where_the_ranks_use_the_cpu():
    assert default_api_servers(ranks_on_cpu=True) == 1
    assert 1 <= default_api_servers(ranks_on_cpu=False) <= 4


@pytest.fixture(scope="module")
def tp2_pkg(tiny_checkpoints, package_cache):
    return package_cache(
        tiny_checkpoints["llama"], 2, max_batch=8, kv_page_size=4, max_step_tokens=32
    )


def _api_server_pids(s: ServerProcess) -> dict[int, int]:
    """API server index -> pid."""
    found = {}
    for pid, cmd in children(s.proc.pid):
        if "orbit.http" in cmd:
            found[int(cmd.split("--index")[1].split()[0])] = pid
    return found


class _Stream:
    """A raw SSE stream of /v1/completions, read on a thread of its own."""

    def __init__(self, s: ServerProcess):
        body = {
            "model": httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"],
            "prompt": "a b c",
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        self.client = httpx.Client(timeout=60)
        self.response = self.client.send(
            self.client.build_request("POST", s.url + "/v1/completions", json=body), stream=True
        )
        self.server = int(self.response.headers["x-orbit-api-server"])
        self.lines = self.response.iter_lines()
        assert next(line for line in self.lines if line.startswith("data:"))

    def rest(self) -> list[str] | Exception:
        try:
            return [line for line in self.lines if line.startswith("data:")]
        except httpx.HTTPError as e:
            return e
        finally:
            self.client.close()


def test_an_api_server_dying_leaves_the_core_and_the_other_streams(tp2_pkg):
    with ServerProcess(tp2_pkg, "--kv-pages", "512", "--api-servers", "2") as s:
        streams: list[_Stream] = []
        for _ in range(30):  # connections land on either server; get one on each
            streams.append(_Stream(s))
            if {st.server for st in streams} == {0, 1}:
                break
        assert {st.server for st in streams} == {0, 1}
        ranks = s.rank_pids()
        victim = _api_server_pids(s)[0]
        os.kill(victim, signal.SIGKILL)
        for st in streams:
            rest = st.rest()
            if st.server == 1:  # untouched: ends normally, every token there
                assert not isinstance(rest, Exception) and rest[-1] == "data: [DONE]"
                usage = json.loads(rest[-2].removeprefix("data: "))["usage"]
                assert usage["completion_tokens"] == MAX_TOKENS
        deadline = time.monotonic() + 60
        while _api_server_pids(s).get(0) in (None, victim):
            assert time.monotonic() < deadline, "API server 0 was not replaced"
            time.sleep(0.2)
        assert s.rank_pids() == ranks  # the core and its rank group went on
        # The dead server's sequences were aborted: every page is back.
        while s.metrics().get("orbit_running_sequences", 1):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert s.metrics()["orbit_kv_pages_in_use"] == 0


def test_the_core_dying_ends_every_stream_with_an_error_event(tp2_pkg):
    s = ServerProcess(tp2_pkg, "--kv-pages", "512", "--api-servers", "2").__enter__()
    try:
        api_servers = list(_api_server_pids(s).values())
        ranks = s.rank_pids()
        stream = _Stream(s)
        os.kill(s.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = stream.rest()
        took = time.monotonic() - t0
        assert not isinstance(rest, Exception)
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        assert took < 10
        deadline = time.monotonic() + 20
        while any(alive(p) for p in api_servers + ranks):
            assert time.monotonic() < deadline, "API servers or ranks outlived the core"
            time.sleep(0.2)
    finally:
        s.stop()


def _on_python_path(monkeypatch, folder) -> None:
    """Python processes started from here (the server and its children) import from folder
    first."""
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)


def test_an_api_server_that_cannot_start_ends_the_server_naming_why(tp2_pkg, tmp_path, monkeypatch):
    """An API server that fails before it reaches the core (here a broken module on its path;
    on a GPU machine once, a missing httptools) fails the same way each time: orbit serve
    exits 1 naming it and its error, where it used to restart it for ever and never answer."""
    broken = tmp_path / "httptools"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('httptools is broken on purpose by this test')\n"
    )
    _on_python_path(monkeypatch, tmp_path)
    proc = ServerProcess(tp2_pkg, "--kv-pages", "512", "--api-servers", "2").start()
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "orbit serve went on without its API servers"
            seen.update(pid for pid, _ in children(proc.pid))
            time.sleep(0.05)
        out = proc.stdout.read().decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out
    assert "before it reached the engine core" in out, out
    assert "httptools is broken on purpose by this test" in out, out
    assert "starting a new one" not in out, out
    assert seen and not any(alive(pid) for pid in seen)  # ranks and API servers stopped


def test_a_replacement_that_fails_as_it_starts_is_retried_after_longer_pauses(
    tp2_pkg, tmp_path, monkeypatch
):
    """A server that served and died is replaced after 1 s; a replacement that then fails
    before it reaches the core (here refused by a sitecustomize while a flag file exists)
    does not end orbit serve, and each retry waits twice as long, until one starts."""
    flag, attempts = tmp_path / "broken", tmp_path / "attempts"
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        f"if os.path.exists({str(flag)!r}) and "
        "b'orbit.http\\0' in open('/proc/self/cmdline', 'rb').read():\n"
        f"    open({str(attempts)!r}, 'a').write('refused\\n')\n"
        "    os._exit(3)\n"
    )
    _on_python_path(monkeypatch, tmp_path)
    s = ServerProcess(tp2_pkg, "--kv-pages", "512", "--api-servers", "1").__enter__()
    try:
        flag.touch()
        os.kill(_api_server_pids(s)[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not attempts.exists() or len(attempts.read_text().split()) < 2:
            assert time.monotonic() < deadline and s.proc.poll() is None, "no retries seen"
            time.sleep(0.05)
        flag.unlink()  # the third replacement, 4 s later, starts
        while True:
            assert time.monotonic() < deadline and s.proc.poll() is None, "never replaced"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(s.url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
    finally:
        code = s.stop()
    out = s.proc.stdout.read().decode(errors="replace")
    assert code == 0, out
    pauses = re.findall(r"exited with code (-?\d+); starting a new one in (\d+) s", out)
    assert pauses == [("-9", "1"), ("3", "2"), ("3", "4")], out


@contextlib.asynccontextmanager
async def _core_link_and_a_server(tmp_path):
    """A real ApiLink over an engine without ranks (never ready), and a DEALER connected to it
    standing in for an API server."""
    engine = Engine(EngineConfig(64, 4, 4, 32, (0,)), None)
    endpoint = f"ipc://{tmp_path}/core.sock"
    link = ApiLink(engine, endpoint, engine.metrics_text)
    link.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield link, sock
    finally:
        sock.close()
        ctx.term()
        link.close()


async def _link_scenario(tmp_path):
    async with _core_link_and_a_server(tmp_path) as (link, sock):
        await sock.send(b"\xff\xfe junk")
        await sock.send_multipart([b"two", b"frames"])
        generate = core_pb2.Generate(
            seq_key=7, prompt_ids=[1, 2], max_tokens=4, sampling=wire_pb2.SamplingParams()
        )
        await sock.send(core_pb2.FromApiServer(generate=generate).SerializeToString())
        outputs, status = [], None
        async with asyncio.timeout(5):
            while not outputs or status is None:
                msg = core_pb2.ToApiServer()
                msg.ParseFromString(await sock.recv())
                if msg.WhichOneof("kind") == "outputs":
                    outputs += msg.outputs.outputs
                elif msg.WhichOneof("kind") == "status":
                    status = msg.status
        return outputs, status, link.dropped_messages


def test_the_core_link_drops_junk_and_refuses_what_it_cannot_admit(tmp_path):
    outputs, status, dropped = asyncio.run(_link_scenario(tmp_path))
    assert dropped == 2
    assert not status.ready
    (out,) = outputs
    assert out.seq_key == 7 and out.finish == core_pb2.FINISH_ERROR
    assert out.error == core_pb2.ERROR_NOT_READY


async def _a_server_that_went_away(tmp_path) -> tuple[bool, bool]:
    """An API server registers (its hello), then its socket closes while its process lives on
    (a link cut or a server wedged past its socket): whether the core knew it, then whether it
    still counts it once its status heartbeats cannot reach it."""
    async with _core_link_and_a_server(tmp_path) as (link, sock):
        hello = core_pb2.FromApiServer(hello=core_pb2.ApiHello(pid=os.getpid()))
        await sock.send(hello.SerializeToString())
        async with asyncio.timeout(5):
            await sock.recv()  # the core's status: it knows this server now
        known = len(link.sinks) == 1
        sock.close()
        deadline = time.monotonic() + 5 * STATUS_INTERVAL_S
        while link.sinks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return known, bool(link.sinks)


def test_the_core_drops_an_api_server_it_can_no_longer_reach(tmp_path):
    known, still_counted = asyncio.run(_a_server_that_went_away(tmp_path))
    assert known
    assert not still_counted


@contextlib.asynccontextmanager
async def _client_of_a_ready_core(tmp_path):
    """A real CoreClient against a ROUTER standing in for the core, which took its hello and
    told it it is ready: yields (client, the ROUTER, the client's identity)."""
    from orbit.http.core_client import CoreClient

    endpoint = f"ipc://{tmp_path}/core.sock"
    ctx = zmq.asyncio.Context()
    core = ctx.socket(zmq.ROUTER)
    core.setsockopt(zmq.LINGER, 0)
    core.bind(endpoint)
    client = CoreClient(endpoint, 0, lambda: "", None, 64)
    await client.start()
    try:
        identity, _ = await core.recv_multipart()  # its ApiHello
        ready = core_pb2.ToApiServer(status=core_pb2.CoreStatus(ready=True))
        await core.send_multipart([identity, ready.SerializeToString()])
        async with asyncio.timeout(5):
            while not client.is_ready():
                await asyncio.sleep(0.01)
        yield client, core, identity
    finally:
        client.close()
        core.close()
        ctx.term()


async def _steps_to_a_client(tmp_path, lagging: bool) -> list[core_pb2.SeqOutput]:
    """The core sends one sequence four steps of one token each (the last finishing it);
    lagging: the last three all arrive before the stream asks for its next output."""
    from orbit.http.core_client import SamplingParams

    async with _client_of_a_ready_core(tmp_path) as (client, core, identity):
        async with asyncio.timeout(5):
            stream = client.generate("r", [1, 2], SamplingParams(max_tokens=4))
            first = asyncio.ensure_future(anext(stream))
            key = None
            while key is None:
                msg = core_pb2.FromApiServer()
                msg.ParseFromString((await core.recv_multipart())[1])
                key = msg.generate.seq_key if msg.WhichOneof("kind") == "generate" else None

            async def step(token: int, finish=core_pb2.FINISH_NONE) -> None:
                out = core_pb2.SeqOutput(seq_key=key, token_ids=[token], finish=finish)
                msg = core_pb2.ToApiServer(outputs=core_pb2.StepOutputs(outputs=[out]))
                await core.send_multipart([identity, msg.SerializeToString()])

            await step(10)
            got = [await first]
            finishes = (core_pb2.FINISH_NONE, core_pb2.FINISH_NONE, core_pb2.FINISH_LENGTH)
            for token, finish in zip((11, 12, 13), finishes):
                await step(token, finish)
                if not lagging:
                    got.append(await anext(stream))
            if lagging:
                await asyncio.sleep(0.3)  # the reader task takes all three meanwhile
                got += [out async for out in stream]
        return got


async def _requests_to_a_core_that_stopped_reading(tmp_path) -> tuple[int, BaseException | None]:
    """The core reads nothing after saying it is ready: requests go out until the link is full.
    Returns how many went out before the first that failed, and its error (None if none did)."""
    from orbit.http.core_client import SamplingParams

    async with _client_of_a_ready_core(tmp_path) as (client, _, _):
        firsts = []
        try:
            for i in range(LINK_FILL_LIMIT):
                stream = client.generate(f"r{i}", [1, 2], SamplingParams(max_tokens=4))
                first = asyncio.ensure_future(anext(stream))
                firsts.append(first)
                await asyncio.sleep(0)  # it sends its Generate, then waits for outputs
                if first.done():
                    return i, first.exception()
            return LINK_FILL_LIMIT, None
        finally:
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)  # their aborts, before close


LINK_FILL_LIMIT = 200_000  # far more messages than the link's queues and buffers hold


def test_a_request_the_core_link_cannot_take_fails_at_once(tmp_path):
    """It used to vanish into the asyncio socket's future and wait for outputs forever."""
    from orbit.http.core_client import EngineOverloaded

    sent, error = asyncio.run(_requests_to_a_core_that_stopped_reading(tmp_path))
    assert sent < LINK_FILL_LIMIT
    assert isinstance(error, EngineOverloaded)
    assert "full" in str(error)


@pytest.mark.parametrize("lagging", [False, True])
def test_a_stream_that_fell_behind_takes_the_steps_waiting_as_one_output(tmp_path, lagging):
    got = asyncio.run(_steps_to_a_client(tmp_path, lagging))
    tokens = [list(out.token_ids) for out in got]
    assert tokens == ([[10], [11, 12, 13]] if lagging else [[10], [11], [12], [13]])
    assert got[-1].finish == core_pb2.FINISH_LENGTH
    assert all(out.finish == core_pb2.FINISH_NONE for out in got[:-1])


class _Recorded(Sink):
    """An owner that keeps every StepOutputs the core delivers to it, in order."""

    def __init__(self):
        super().__init__()
        self.steps: list[core_pb2.StepOutputs] = []

    def deliver(self, outputs: core_pb2.StepOutputs) -> None:
        self.steps.append(outputs)


def test_a_step_packs_its_one_token_outputs_and_keeps_the_rest_whole(tp2_pkg):
    """The core's outputs of a step to one owner: a sequence's first output (it carries the
    first token's timing), its last (the finish) and every output of a sequence that asked for
    logprobs are SeqOutputs; every other one-token output travels packed (next_keys,
    next_tokens). Read back in order, each sequence's tokens are what the in-process path,
    which delivers one SeqOutput per sequence per step, gives it."""
    pkg = open_package(tp2_pkg)
    prompts = [[(300 + 17 * i + 101 * j) % 4000 for j in range(5 + 3 * i)] for i in range(3)]
    wants = [-1, -1, 2]  # the third asks for the two best tokens' logprobs
    max_tokens = 12

    async def run():
        config = engine_config(pkg, overlap=True)
        async with (
            local_ranks(pkg, "cpu", kv_pages=64) as link,
            running_engine(config, link) as engine,
        ):
            sink = _Recorded()
            for key, (prompt, k) in enumerate(zip(prompts, wants)):
                sampling = wire_pb2.SamplingParams(temperature=0, num_logprobs=k)
                engine.submit(sink, key, prompt, max_tokens, sampling, ignore_eos=True)
            while sum(o.finish != 0 for s in sink.steps for o in s.outputs) < len(prompts):
                await asyncio.sleep(0.01)
            alone = []
            for prompt, k in zip(prompts, wants):
                params = wire_pb2.SamplingParams(temperature=0, num_logprobs=k)
                outs = engine.generate(prompt, max_tokens, params, True)
                alone.append([t async for out in outs for t in out.token_ids])
        return sink.steps, alone

    steps, alone = asyncio.run(run())
    tokens: dict[int, list[int]] = {key: [] for key in range(len(prompts))}
    packed = {key: 0 for key in tokens}
    for step in steps:
        keys = [o.seq_key for o in step.outputs] + list(step.next_keys)
        assert len(keys) == len(set(keys)), "a sequence twice in one step's outputs"
        assert len(step.next_keys) == len(step.next_tokens)
        for out in step.outputs:
            first, last = not tokens[out.seq_key], out.finish != core_pb2.FINISH_NONE
            assert first or last or wants[out.seq_key] >= 0, f"{out} was not packed"
            assert len(out.logprobs) == (len(out.token_ids) if wants[out.seq_key] >= 0 else 0)
            tokens[out.seq_key] += out.token_ids
        for key, token in zip(step.next_keys, step.next_tokens):
            assert wants[key] < 0, "a sequence that asked for logprobs was packed"
            tokens[key].append(token)
            packed[key] += 1
    assert [tokens[key] for key in sorted(tokens)] == alone
    assert packed == {0: max_tokens - 2, 1: max_tokens - 2, 2: 0}
