"""Hostile requests and connections against a real `orbit serve` on the tiny CPU package: values
at the edge of the wire's types, seeds, huge prompts, connections that never finish a request,
and how the API key reaches the server. None may fail another request or restart the ranks."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from orbit.core.local_ranks import free_port
from orbit.http.app import (
    MAX_HEAD_BYTES,
    BodyLimits,
    GuardedHttpToolsProtocol,
    create_app,
    uvicorn_options,
)
from orbit.http.openai_types import PromptLimits
from tests.server import REPO, ServerProcess
from tests.test_api_validation import FakeEngine


@pytest.fixture(scope="module")
def tiny_pkg(tiny_checkpoints, package_cache):
    return package_cache(
        tiny_checkpoints["llama"], 1, max_batch=64, kv_page_size=8, max_step_tokens=256
    )


@pytest.fixture(scope="module")
def server(tiny_pkg):
    with ServerProcess(tiny_pkg, "--kv-pages", "2048") as s:
        yield s


def _model(s: ServerProcess) -> str:
    return httpx.get(s.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(s: ServerProcess, timeout_s: float = 60, **body) -> httpx.Response:
    body = {"model": _model(s), "prompt": "The quick brown fox", "max_tokens": 12, **body}
    return httpx.post(s.url + "/v1/completions", json=body, timeout=timeout_s)


def _text(s: ServerProcess, **body) -> str:
    r = _complete(s, ignore_eos=True, **body)
    assert r.status_code == 200, (body, r.text)
    return r.json()["choices"][0]["text"]


def test_sampling_values_at_the_wires_edges_are_served_without_restarting_ranks(server):
    ranks = server.rank_pids()
    greedy = _text(server, temperature=0)
    # Each of these leaves only the most likely token: float32 rounds the first two to 0 or a
    # denormal, which used to overflow or empty the distribution on a rank.
    for only_top in (
        {"temperature": 1e-40},
        {"top_p": 1e-50, "seed": 1},
        {"temperature": 1e-6, "seed": 2},
        {"top_k": 1, "seed": 3},
        {"top_p": 5e-324, "top_k": 2**32 - 1, "seed": 4},
    ):
        assert _text(server, **only_top) == greedy, only_top
    for odd in ({"top_k": 2**32 - 1}, {"temperature": 100, "n": 16}, {"seed": -(2**63)}):
        assert _complete(server, **odd).status_code == 200, odd
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.rank_pids() == ranks


def test_values_the_wire_cannot_carry_are_400_and_the_ranks_keep_serving(server):
    ranks = server.rank_pids()
    for field, value in (("top_k", 2**32), ("temperature", 1e39), ("seed", 2**64)):
        r = _complete(server, **{field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert _complete(server, temperature=0).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert server.rank_pids() == ranks


def test_distinct_seeds_give_distinct_samples(server):
    seeds = (-1, 0, -(2**63), 2**63 - 1)
    texts = [_text(server, seed=seed, temperature=1.0, max_tokens=16) for seed in seeds]
    assert len(set(texts)) == len(seeds), texts
    assert _text(server, seed=-1, temperature=1.0, max_tokens=16) == texts[0]  # still seeded


def test_large_prompts_do_not_hold_up_small_requests(server):
    model = _model(server)
    tokenizer = AutoTokenizer.from_pretrained(str(Path(server.package) / "tokenizer"))
    max_seq_len = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    limit_bytes = PromptLimits.of(tokenizer, max_seq_len["max_model_len"]).max_text_bytes
    words = "lorem ipsum dolor sit amet "
    admissible = (words * (limit_bytes // len(words)))[:limit_bytes]  # tokenized, then refused
    oversized = words * (4 * 1024 * 1024 // len(words))  # 4 MiB: seconds to tokenize

    async def post(client, prompt: str) -> tuple[int, float]:
        started = time.monotonic()
        body = {"model": model, "prompt": prompt, "max_tokens": 2}
        r = await client.post(server.url + "/v1/completions", json=body)
        return r.status_code, time.monotonic() - started

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            large = [asyncio.create_task(post(client, p)) for p in [oversized, admissible] * 4]
            await asyncio.sleep(0.3)  # the large ones are being read, parsed and tokenized
            small = await post(client, "Hello there")
            return small, await asyncio.gather(*large)

    (small_status, small_s), large = asyncio.run(run())
    assert small_status == 200 and small_s < 5.0, small_s
    assert all(status == 400 for status, _ in large), large
    assert max(took_s for _, took_s in large[::2]) < 5.0, large  # refused by length alone


def test_a_flood_of_chat_messages_is_refused_before_it_can_stall_the_server(server):
    ranks = server.rank_pids()
    flood = {"model": _model(server), "messages": [{"role": "user", "content": "hi"}] * 200_000}

    async def post(client, body: dict) -> tuple[int, float]:
        started = time.monotonic()
        r = await client.post(server.url + "/v1/chat/completions", json=body)
        return r.status_code, time.monotonic() - started

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            floods = [asyncio.create_task(post(client, flood)) for _ in range(3)]
            await asyncio.sleep(0.3)
            small = {"model": _model(server), "messages": [{"role": "user", "content": "hi"}]}
            return await post(client, {**small, "max_tokens": 2}), await asyncio.gather(*floods)

    (small_status, small_s), floods = asyncio.run(run())
    assert small_status == 200 and small_s < 3.0, small_s
    assert [status for status, _ in floods] == [400] * 3
    assert server.rank_pids() == ranks


def _connect(port: int, payload: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if payload:
        sock.sendall(payload)
    return sock


def _closed_by_server(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection past deadline."""
    received = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def test_connections_that_never_finish_a_request_are_closed(server):
    port = server.port
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    idle = [_connect(port) for _ in range(100)]
    partial_head = [
        _connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(100)
    ]
    no_body = [_connect(port, head + b'{"prompt": ') for _ in range(100)]
    after_response = _connect(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        # The server is not tied up by them.
        assert _complete(server, timeout_s=10, temperature=0).status_code == 200
        deadline = time.monotonic() + 40  # 15 s for a head or a body to arrive, then closed
        for sock in idle + partial_head + [after_response]:
            assert _closed_by_server(sock, deadline) is not None
        for sock in no_body:
            response = _closed_by_server(sock, deadline)
            assert response is not None and response.startswith(b"HTTP/1.1 408 "), response
            assert b'"code":"request_timeout"' in response
    finally:
        for sock in idle + partial_head + no_body + [after_response]:
            sock.close()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_heads_past_the_size_bound_are_refused(server):
    """A head longer than MAX_HEAD_BYTES gets 431 and the connection closes, whether it comes in
    one write or trickles in as one endless header (which the parser would buffer whole); a
    head under the bound whose body, sent in the same write, is far longer is served."""
    port = server.port
    big = b"X-Pad: " + b"a" * (MAX_HEAD_BYTES + 100) + b"\r\n"
    whole = _connect(port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + big + b"\r\n")
    trickled = _connect(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
    try:
        for _ in range(MAX_HEAD_BYTES // 1024 + 2):
            try:
                trickled.sendall(b"a" * 1024)
            except OSError:  # closed by the server already
                break
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        for sock in (whole, trickled):
            response = _closed_by_server(sock, deadline)
            assert response is not None and response.startswith(b"HTTP/1.1 431 "), response
            assert b"at most %d bytes" % MAX_HEAD_BYTES in response
    finally:
        whole.close()
        trickled.close()
    # JSON may end in whitespace: a body of 20 KiB behind a small head, in one write.
    body = f'{{"model": "{_model(server)}", "prompt": "hi", "max_tokens": 1}}' + " " * 20_000
    r = httpx.post(
        server.url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


class _QuickHeads(GuardedHttpToolsProtocol):
    head_timeout_s = 1.0


async def _until_closed(reader: asyncio.StreamReader, within_s: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except TimeoutError:
        return None


async def _trickle(writer: asyncio.StreamWriter, every_s: float) -> None:
    try:
        while True:
            await asyncio.sleep(every_s)
            writer.write(b" ")
            await writer.drain()
    except ConnectionError:
        pass


def test_heads_and_bodies_that_stall_or_trickle_time_out(tokenizer_dir):
    engine = FakeEngine(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    app = create_app(engine, "m", body_limits=BodyLimits(idle_timeout_s=1.0, timeout_s=2.5))
    port = free_port()
    options = {**uvicorn_options(), "http": _QuickHeads}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", **options)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    async def run():
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        _, partial, silent, trickled, answered = (writer for _, writer in conns)
        partial.write(head)
        silent.write(head + b"Content-Length: 100\r\n\r\n{")
        trickled.write(head + b"Content-Length: 1000\r\n\r\n{")
        text = head.replace(b"application/json", b"text/plain")
        answered.write(text + b"Content-Length: 1000\r\n\r\n{")  # 415 at once
        trickling = [asyncio.create_task(_trickle(w, 0.3)) for w in (trickled, answered)]
        started = time.monotonic()
        closed = await asyncio.gather(*(_until_closed(reader, 6.0) for reader, _ in conns))
        took_s = time.monotonic() - started
        for task in trickling:
            task.cancel()
        server.should_exit = True
        await serving
        return closed, took_s

    (idle, partial, silent, trickled, answered), took_s = asyncio.run(run())
    assert idle == b"" and partial == b""  # closed after 1 s without a complete head
    for response in (silent, trickled):  # 1 s without progress; 2.5 s in all
        assert response is not None and response.startswith(b"HTTP/1.1 408 "), response
        assert b'"code":"request_timeout"' in response
    # Answered before its body came, it may not hold the connection by trickling the rest.
    assert answered is not None and answered.startswith(b"HTTP/1.1 415 "), answered
    assert took_s < 5.0


def test_non_json_bodies_are_415_and_the_openai_client_still_works(server):
    body = f'{{"model": "{_model(server)}", "prompt": "hi", "max_tokens": 2}}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(
            server.url + "/v1/completions",
            content=body,
            headers={"content-type": content_type},
            timeout=30,
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=_model(server), prompt="hi", max_tokens=2)
    assert done.usage.completion_tokens == 2
    chat = client.chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage.completion_tokens == 2


def _cmdlines(s: ServerProcess) -> list[bytes]:
    pids = [s.proc.pid, *s.rank_pids()]
    return [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids]


def test_api_key_from_the_environment_guards_everything_but_health(tiny_pkg, monkeypatch):
    key = "env-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("ORBIT_TEST_API_KEY", key)
    with ServerProcess(tiny_pkg, "--kv-pages", "64", "--api-key-env", "ORBIT_TEST_API_KEY") as s:
        assert not any(key.encode() in cmdline for cmdline in _cmdlines(s))
        right = {"Authorization": f"Bearer {key}"}
        for path in ("/openapi.json", "/v1/models", "/metrics"):
            assert httpx.get(s.url + path, timeout=10).status_code == 401, path
            assert httpx.get(s.url + path, headers=right, timeout=10).status_code == 200, path
        for path in ("/docs", "/redoc"):
            assert httpx.get(s.url + path, headers=right, timeout=10).status_code == 404, path
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        done = client.completions.create(model=_model_with(s, right), prompt="hi", max_tokens=2)
        assert done.usage.completion_tokens == 2


def _model_with(s: ServerProcess, headers: dict) -> str:
    return httpx.get(s.url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "orbit", "serve", *args]
    return subprocess.run(
        cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )


def test_api_key_on_the_command_line_warns_and_an_unset_variable_fails(tmp_path):
    missing_pkg = str(tmp_path / "no-package")
    warned = _serve(missing_pkg, "--api-key", "k")
    assert "--api-key is visible to other local users" in warned.stderr
    env = {k: v for k, v in os.environ.items() if k != "ORBIT_TEST_UNSET_KEY"}
    unset = _serve(missing_pkg, "--api-key-env", "ORBIT_TEST_UNSET_KEY", env=env)
    assert unset.returncode != 0 and "ORBIT_TEST_UNSET_KEY" in unset.stderr
