"""Behaviour under overload, hostile input, load and a dying rank, on CPU with real processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time

import httpx
import openai
import pytest

from benchmarks import serving
from tests.server import ServerProcess, alive


@pytest.fixture(scope="module")
def tiny_pkg(tiny_checkpoints, package_cache):
    return package_cache(
        tiny_checkpoints["llama"], 1, max_batch=64, kv_page_size=8, max_step_tokens=256
    )


@pytest.fixture(scope="module")
def server(tiny_pkg):
    with ServerProcess(tiny_pkg, "--kv-pages", "2048") as s:
        yield s


def _model(server) -> str:
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_full_queue_answers_429_with_retry_after(tiny_checkpoints, package_cache):
    pkg = package_cache(
        tiny_checkpoints["llama"], 1, max_batch=2, kv_page_size=8, max_step_tokens=64
    )
    with ServerProcess(pkg, "--kv-pages", "512", "--max-queue", "2") as s:
        model = _model(s)

        async def flood():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {
                    "model": model,
                    "prompt": "flood " * 20,
                    "max_tokens": 200,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                return await asyncio.gather(
                    *(client.post(s.url + "/v1/completions", json=body) for _ in range(12))
                )

        responses = asyncio.run(flood())
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and 429 in codes and set(codes) <= {200, 429}
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["type"] == "rate_limit_error"
        ok = httpx.post(
            s.url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": "hi", "max_tokens": 3},
        )
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoints, package_cache):
    """A 32-token context, so that whatever the schema allows is quick to generate on CPU."""
    pkg = package_cache(
        tiny_checkpoints["llama"],
        1,
        max_seq_len=32,
        max_batch=64,
        kv_page_size=8,
        max_step_tokens=256,
    )
    with ServerProcess(pkg, "--kv-pages", "2048") as s:
        yield s


@pytest.mark.skipif(shutil.which("st") is None, reason="schemathesis is not installed")
def test_fuzzed_api_never_answers_5xx(fuzz_server, tmp_path):
    ranks = fuzz_server.rank_pids()
    r = subprocess.run(
        [
            "st",
            "run",
            fuzz_server.url + "/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "50",
            "--request-timeout",
            "60",
            "--seed",
            "1",
            "--generation-database",
            "none",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    assert fuzz_server.rank_pids() == ranks  # no rank group was restarted
    # The schema's limits let the fuzzer reach the model, not just the validation.
    metrics = fuzz_server.metrics()
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert metrics[f'orbit_requests_total{{route="{route}",status="200"}}'] >= 25, metrics


def test_load_1000_requests_at_64_concurrent(server, tmp_path):
    report = serving.main(
        [
            "--url",
            server.url,
            "--requests",
            "1000",
            "--concurrency",
            "64",
            "--check-greedy",
            "--prompt-words",
            "4",
            "12",
            "30",
            "--output-tokens",
            "8",
            "16",
            "24",
            "--out",
            str(tmp_path / "load.json"),
        ]
    )
    assert report["failures"] == 0, report["first_errors"]
    assert report["greedy_mismatches"] == 0
    assert report["mean_output_tokens"] == pytest.approx(16, abs=0.01)
    metrics = server.metrics()
    assert metrics["orbit_running_sequences"] == 0 and metrics["orbit_kv_pages_in_use"] == 0


def _stream_then(s: ServerProcess, action) -> float:
    """Start a long stream, do action(), and return how long the stream took to fail."""
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model=_model(s),
        prompt="a b c",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    action()
    t0 = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    return time.monotonic() - t0


def _recovers(s: ServerProcess, within_s: float = 90) -> None:
    """503 while the ranks are down, then served again once new ranks are ready."""
    r = httpx.post(
        s.url + "/v1/completions",
        timeout=10,
        json={"model": _model(s), "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert r.headers["retry-after"].isdigit()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and _health(s) != 200:
        time.sleep(0.2)
    r = httpx.post(
        s.url + "/v1/completions",
        timeout=60,
        json={"model": _model(s), "prompt": "hi", "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def _health(s: ServerProcess) -> int:
    return httpx.get(s.url + "/health", timeout=5).status_code


@pytest.fixture
def tp2_pkg(tiny_checkpoints, package_cache):
    return package_cache(
        tiny_checkpoints["llama"], 2, max_batch=8, kv_page_size=4, max_step_tokens=32
    )


def test_killed_rank_fails_requests_fast_and_the_frontend_recovers(tp2_pkg):
    with ServerProcess(tp2_pkg, "--kv-pages", "512") as s:
        old = s.rank_pids()
        assert _stream_then(s, lambda: os.kill(old[1], signal.SIGKILL)) < 5
        assert httpx.get(s.url + "/health", timeout=5).status_code == 503
        _recovers(s)
        assert s.proc.poll() is None  # the frontend never went down
        assert not set(old) & set(s.rank_pids())  # a new group of ranks


def test_stopped_rank_is_caught_by_missed_heartbeats(tp2_pkg):
    with ServerProcess(tp2_pkg, "--kv-pages", "512") as s:
        stopped = s.rank_pids()[0]
        try:
            took = _stream_then(s, lambda: os.kill(stopped, signal.SIGSTOP))
            assert took < 10  # 5 s of silence, then the failure
            assert httpx.get(s.url + "/health", timeout=5).status_code == 503
            _recovers(s)
        finally:
            if alive(stopped):
                os.kill(stopped, signal.SIGCONT)


def test_ranks_exit_when_the_frontend_is_killed(tp2_pkg):
    s = ServerProcess(tp2_pkg, "--kv-pages", "64").__enter__()
    ranks = s.rank_pids()
    os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in ranks):
        time.sleep(0.2)
    assert not any(alive(p) for p in ranks)


def test_sigterm_drains_running_requests(tp2_pkg):
    s = ServerProcess(tp2_pkg, "--kv-pages", "512").__enter__()
    ranks = s.rank_pids()
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model=_model(s),
        prompt="a b c",
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    s.proc.send_signal(signal.SIGTERM)
    rest = list(stream)
    finish = [c.choices[0].finish_reason for c in rest if c.choices]
    assert finish[-1] == "length"  # finished, not cut off
    assert rest[-1].usage.completion_tokens == 60  # (chunks can hold several tokens' text)
    assert s.proc.wait(timeout=60) == 0
    assert not any(alive(p) for p in ranks)
