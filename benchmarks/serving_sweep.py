"""Serving throughput through HTTP at several concurrencies, with the official `openai` client.

    python -m benchmarks.serving_sweep --url http://127.0.0.1:8000 --server-pid PID
        [--concurrency 1,8,64,256] [--prompt-tokens 512] [--new-tokens 256] [--out FILE]
    python -m benchmarks.serving_sweep --serve PACKAGE --serve-args "--max-queue 4096"
        --device cuda --ranks-only [--in-process-core] --out FILE

At each concurrency C, C streams send 2C streaming completions (ignore_eos, max_tokens =
--new-tokens, prompts of exactly --prompt-tokens token ids, a distinct prompt per request),
split over --client-procs processes, each with its own event loop, AsyncOpenAI client and
connection pool, so the client does not set the rate. Per level: output tokens/s (every
output token over the time from the first request sent to the last token received), requests/s,
TTFT and inter-token latency p50/p90/p99, failures; on CUDA the GPU's busy share between the
level's first and last token (nvidia-smi every 200 ms); given the server's pid (or with
--serve) the frontend processes' CPU time per streamed token (the `orbit serve` process and its
descendants, the ranks and theirs excluded), split by process, measured once the frontend has
gone idle after the warm-up (its start-up work is not per-token work).

Tokens per chunk: a chunk may carry several tokens. A chunk's count is exact where the chunk
says it: the change in `usage.completion_tokens` when the server puts usage on every chunk
(requested through vLLM's `continuous_usage_stats`), or the length of `logprobs.tokens` with
--logprobs (the server then computes logprobs too). Otherwise the stream's total from its final
usage chunk is spread evenly over its chunks. Inter-token latency: each chunk after a stream's
first gives `tokens` samples of (its arrival - the previous chunk's arrival) / tokens, so every
token after the first chunk counts once; the raw gaps between chunks are reported too.

--ranks-only runs benchmarks.step_overhead for the same batches once the HTTP levels are done
(and a server this script started is stopped); --in-process-core submits the same requests to
an engine core in this process (benchmarks.step_overhead.in_process_levels), which prints each
level's step figures as the HTTP levels give them. Both are put beside the HTTP figure with the
ratio HTTP / them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import pty
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Self
from urllib.parse import SplitResult, urlsplit

import httpx

REPO = Path(__file__).resolve().parents[1]
REQUESTS_PER_STREAM = 2
START_LEAD_S = 0.25  # every client process starts a level this long after it is handed out
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PERCENTILES = (50, 90, 99)
# Asks vLLM-style servers for usage on every chunk; others ignore unknown stream options.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


class SweepError(Exception):
    """The sweep cannot go on: the server did not start, a reference run failed."""


# ---- the client processes ------------------------------------------------------------------


@dataclass(frozen=True)
class ClientJob:
    """One client process's share of a level: `streams` concurrent streams over its requests."""

    url: str
    api_key: str
    model: str
    prompt_tokens: int
    new_tokens: int
    temperature: float
    logprobs: bool
    vocab_size: int
    timeout_s: float
    streams: int = 1
    first_salt: int = 0  # request i's prompt is prompt_ids(..., salt=first_salt + i)
    num_requests: int = 1
    texts: tuple[str, ...] = ()  # when given, request i's prompt is texts[i], not token ids
    start_at_s: float = 0.0  # time.perf_counter(): CLOCK_MONOTONIC, the same in every process


@dataclass
class RequestRecord:
    """One streamed request as the client saw it; times are time.perf_counter()."""

    sent_s: float
    times_s: list[float] = field(default_factory=list)  # arrival of each chunk with a choice
    chunk_tokens: list[int | None] = field(default_factory=list)  # None: the chunk did not say
    usage_tokens: int | None = None  # completion_tokens of the last usage seen
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.times_s)

    def add_chunk(self, chunk, now_s: float) -> None:
        said = None
        if chunk.usage is not None:
            said = chunk.usage.completion_tokens - (self.usage_tokens or 0)
            self.usage_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            return
        logprobs = chunk.choices[0].logprobs
        if said is None and logprobs is not None and logprobs.tokens is not None:
            said = len(logprobs.tokens)
        self.times_s.append(now_s)
        self.chunk_tokens.append(said)

    def resolved_chunk_tokens(self) -> list[int]:
        """Tokens per chunk: as the chunk said, else the rest of the stream's total spread evenly."""
        known = [k for k in self.chunk_tokens if k is not None]
        unknown = len(self.chunk_tokens) - len(known)
        total = self.usage_tokens if self.usage_tokens is not None else len(known) + unknown
        rest = max(0, total - sum(known))
        shares = iter(rest * (i + 1) // unknown - rest * i // unknown for i in range(unknown))
        return [k if k is not None else next(shares) for k in self.chunk_tokens]


def level_salts(levels: list[int], index: int) -> range:
    """The salts of level `index`'s requests, REQUESTS_PER_STREAM a stream, after every earlier
    level's: a level that repeated an earlier level's prompts would have them served from the
    prefix cache (the in-process reference did until 2026-12-07: at 64 then 256 streams it
    computed 329k of the 393k tokens that HTTP computed)."""
    first = REQUESTS_PER_STREAM * sum(levels[:index])
    return range(first, first + REQUESTS_PER_STREAM * levels[index])


def prompt_ids(num_tokens: int, salt: int, vocab_size: int) -> list[int]:
    """Deterministic ids in [1000, vocab_size), distinct per salt (no shared prefix to cache)."""
    return [1000 + (7919 * i + 104729 * salt) % (vocab_size - 1000) for i in range(num_tokens)]


async def one_request(client, job: ClientJob, prompt: list[int] | str) -> RequestRecord:
    extra = {"logprobs": 0} if job.logprobs else {}
    record = RequestRecord(sent_s=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=job.model,
            prompt=prompt,
            max_tokens=job.new_tokens,
            temperature=job.temperature,
            stream=True,
            stream_options=STREAM_OPTIONS,
            extra_body={"ignore_eos": True},
            **extra,
        )
        async for chunk in stream:
            record.add_chunk(chunk, time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the level
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


async def run_job(job: ClientJob) -> tuple[list[RequestRecord], float]:
    """The job's records, and the share of its time (from start_at_s, when every client
    process starts, to its last answer) this process spent on a CPU."""
    from openai import AsyncOpenAI

    pool_size = job.streams + 8
    limits = httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(job.timeout_s, connect=60.0))
    client = AsyncOpenAI(
        base_url=job.url + "/v1", api_key=job.api_key, max_retries=0, http_client=http
    )
    gate = asyncio.Semaphore(job.streams)

    async def bounded(salt: int) -> RequestRecord:
        async with gate:
            if job.texts:
                return await one_request(client, job, job.texts[salt - job.first_salt])
            return await one_request(
                client, job, prompt_ids(job.prompt_tokens, salt, job.vocab_size)
            )

    await asyncio.sleep(max(0.0, job.start_at_s - time.perf_counter()))
    cpu_s, wall_s = time.process_time(), time.perf_counter()
    try:
        salts = range(job.first_salt, job.first_salt + job.num_requests)
        records = list(await asyncio.gather(*(bounded(s) for s in salts)))
        return records, (time.process_time() - cpu_s) / (time.perf_counter() - wall_s)
    finally:
        await client.close()


def client_worker(conn) -> None:
    """A client process: runs each job it is sent and sends back its records and the share of
    the job's time this process spent on a CPU; None ends it."""
    while (job := conn.recv()) is not None:
        records, busy = asyncio.run(run_job(job))
        # Plain dicts: a class of a module run as __main__ would not unpickle in the parent.
        conn.send(([vars(r) for r in records], busy))


class ClientPool:
    """The client processes, started once (spawned: the parent has threads) for every level."""

    def __init__(self, num_procs: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        self.busy: list[float] = []
        for _ in range(num_procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_worker, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, jobs: list[ClientJob]) -> list[RequestRecord]:
        """The jobs' records; self.busy then holds each process's CPU share of its job."""
        for conn, job in zip(self.conns, jobs):
            conn.send(job)
        replies = [conn.recv() for conn in self.conns[: len(jobs)]]
        self.busy = [busy for _, busy in replies]
        return [RequestRecord(**r) for records, _ in replies for r in records]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        for conn, proc in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def level_jobs(base: ClientJob, concurrency: int, num_procs: int, first_salt: int) -> list:
    """The level's streams and requests split as evenly as they go over the client processes."""
    procs = min(num_procs, concurrency)
    start_at_s = time.perf_counter() + START_LEAD_S
    jobs, salt = [], first_salt
    for i in range(procs):
        streams = concurrency // procs + (i < concurrency % procs)
        requests = REQUESTS_PER_STREAM * streams
        share = {"streams": streams, "first_salt": salt, "num_requests": requests}
        jobs.append(replace(base, **share, start_at_s=start_at_s))
        salt += requests
    return jobs


# ---- per-level figures ---------------------------------------------------------------------


def percentiles_ms(values_s: list[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles, in ms."""
    ordered = sorted(values_s)
    out = {}
    for q in PERCENTILES:
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        out[f"p{q}"] = round(1e3 * ordered[rank - 1], 3) if ordered else None
    return out


def itl_samples_s(times_s: list[float], tokens: list[int]) -> list[float]:
    """One sample per token of each chunk after the first: the chunk's gap over its tokens."""
    samples = []
    for prev_s, now_s, num_tokens in zip(times_s, times_s[1:], tokens[1:]):
        num_tokens = max(num_tokens, 1)
        samples += [(now_s - prev_s) / num_tokens] * num_tokens
    return samples


def summarize_level(concurrency: int, records: list[RequestRecord]) -> tuple[dict, tuple | None]:
    """The level's figures, and its (first token, last token) window in perf_counter seconds."""
    ok = [r for r in records if r.ok]
    level = {
        "concurrency": concurrency,
        "requests": len(records),
        "failures": len(records) - len(ok),
        "first_errors": [r.error or "no tokens" for r in records if not r.ok][:5],
    }
    if not ok:
        return level, None
    counts = [r.resolved_chunk_tokens() for r in ok]
    num_chunks = sum(len(c) for c in counts)
    wall_s = max(r.times_s[-1] for r in ok) - min(r.sent_s for r in records)
    level["output_tokens"] = output_tokens = sum(sum(c) for c in counts)
    level["wall_s"] = round(wall_s, 4)
    level["output_tokens_per_s"] = round(output_tokens / wall_s, 2)
    level["requests_per_s"] = round(len(ok) / wall_s, 3)
    ttfts_s = [r.times_s[0] - r.sent_s for r in ok]
    level["ttft_ms"] = percentiles_ms(ttfts_s)
    level["ttft_mean_ms"] = round(sum(ttfts_s) / len(ttfts_s) * 1e3, 2)  # beside the server's
    level["itl_ms"] = percentiles_ms(
        [x for r, c in zip(ok, counts) for x in itl_samples_s(r.times_s, c)]
    )
    level["chunk_gap_ms"] = percentiles_ms(
        [b - a for r in ok for a, b in zip(r.times_s, r.times_s[1:])]
    )
    level["tokens_per_chunk"] = round(output_tokens / num_chunks, 3)
    exact = sum(k is not None for r in ok for k in r.chunk_tokens)
    level["chunk_tokens_exact_frac"] = round(exact / num_chunks, 4)
    return level, (min(r.times_s[0] for r in ok), max(r.times_s[-1] for r in ok))


# ---- GPU busy share ------------------------------------------------------------------------


class GpuSampler:
    """nvidia-smi's utilization.gpu every 200 ms, in a subprocess for the whole sweep. Each line
    carries nvidia-smi's own timestamp; its output goes to a pty, so it is line-buffered."""

    def __init__(self, gpu_ids: str | None):
        cmd = ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu"]
        cmd += ["--format=csv,noheader,nounits", "-lms", "200"]
        cmd += ["-i", gpu_ids] if gpu_ids else []
        reader_fd, writer_fd = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdout=writer_fd, stderr=subprocess.DEVNULL)
        os.close(writer_fd)
        self.samples: list[tuple[float, float]] = []  # (time.time(), busy percent), every GPU
        self.thread = threading.Thread(target=self._read, args=(reader_fd,), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        with open(fd, errors="replace") as lines, contextlib.suppress(OSError):  # EIO: it ended
            for line in lines:
                stamp, _, busy = line.rpartition(",")
                with contextlib.suppress(ValueError):  # "[N/A]", or a line cut short
                    when = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    self.samples.append((when, float(busy)))

    def busy_frac(self, start_s: float, end_s: float) -> float | None:
        """Mean busy share of the samples between two time.perf_counter() instants, once one
        sample after them has arrived (or 2 s have passed)."""
        offset_s = time.time() - time.perf_counter()
        start_s, end_s = start_s + offset_s, end_s + offset_s
        deadline_s = time.monotonic() + 2.0
        while time.monotonic() < deadline_s and not any(t > end_s for t, _ in self.samples[-4:]):
            time.sleep(0.05)
        inside = [b for t, b in self.samples if start_s <= t <= end_s]
        return round(sum(inside) / len(inside) / 100, 4) if inside else None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


# ---- frontend CPU time ---------------------------------------------------------------------


def proc_stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process; None if it is gone. The CPU time is the process's
    CPU clock (clock_gettime of its clock id: every thread's time on a CPU, exited ones
    included, in nanoseconds) where the kernel gives it, else user + system time from
    /proc/PID/stat in 10 ms ticks, which resolved a level of the CPU figure (0.25 CPU-seconds)
    only to ±4%."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()  # from field 3 (state) on
    try:
        cpu_s = time.clock_gettime(_cpu_clock(int(pid)))
    except OSError:  # gone meanwhile, or a kernel without per-process CPU clocks
        cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S
    return int(fields[1]), cpu_s


def _cpu_clock(pid: int) -> int:
    """Linux's clock id for a process's CPU time (clock_getcpuclockid, which Python lacks):
    the pid complemented and shifted, tagged CPUCLOCK_SCHED."""
    return (~pid << 3) | 2


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _runs_module(args: list[str], module: str) -> bool:
    pairs = itertools.pairwise(args)
    return any(a == "-m" and b == module for a, b in pairs) or f"-m{module}" in args


def process_tree(root_pid: int, skip_ranks: bool) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds) for root_pid and its descendants; with skip_ranks,
    without rank processes (`-m ranks`) and what they started."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := proc_stat(p))}
    children = defaultdict(list)
    for pid, (ppid, _) in stats.items():
        children[ppid].append(pid)
    tree, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        args = _cmdline(pid)
        if pid not in stats or (skip_ranks and _runs_module(args, "ranks")):
            continue
        tree[pid] = (" ".join(args), stats[pid][1])
        todo += children[pid]
    return tree


def _role(pid: int, root_pid: int, cmd: str) -> str:
    if pid == root_pid:
        return "core"
    return "api_server" if _runs_module(cmd.split(), "orbit.http") else "other"


# Before the first level, the frontend must idle below this share of one core for a second:
# after /health is 200 an API server may still be starting its schema-check child, which
# imports xgrammar and torch (about a CPU-second each), a start-up cost and not a per-token one.
QUIET_CPU_FRAC = 0.05
QUIET_MAX_WAIT_S = 120.0


def wait_quiet(root_pid: int) -> float:
    """Wait (at most QUIET_MAX_WAIT_S) until the frontend processes idle; returns the seconds
    waited."""
    started = time.monotonic()
    while time.monotonic() - started < QUIET_MAX_WAIT_S:
        before = process_tree(root_pid, skip_ranks=True)
        time.sleep(1.0)
        after = process_tree(root_pid, skip_ranks=True)
        used_s = sum(cpu_s - before.get(pid, ("", 0.0))[1] for pid, (_, cpu_s) in after.items())
        if used_s < QUIET_CPU_FRAC:
            break
    return round(time.monotonic() - started, 1)


def frontend_cpu(before: dict, after: dict, root_pid: int, num_tokens: int) -> dict:
    """CPU time per streamed token between two process_tree() readings, in all and per process.
    A process that ended in between is missed; one that started counts from zero."""
    per_token_us = 1e6 / max(num_tokens, 1)
    processes, by_role = [], defaultdict(float)
    for pid, (cmd, cpu_s) in sorted(after.items()):
        used_s = cpu_s - before.get(pid, ("", 0.0))[1]
        role = _role(pid, root_pid, cmd)
        by_role[role] += used_s
        processes.append({"pid": pid, "role": role, "cmd": cmd[:160], "cpu_s": round(used_s, 3)})
        processes[-1]["us_per_token"] = round(used_s * per_token_us, 3)
    total_s = sum(by_role.values())
    return {
        "cpu_s": round(total_s, 3),
        "us_per_token": round(total_s * per_token_us, 3),
        "us_per_token_by_role": {r: round(s * per_token_us, 3) for r, s in sorted(by_role.items())},
        "processes": processes,
    }


# ---- a server this script starts -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise SweepError(f"orbit serve exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SweepError(f"orbit serve was not healthy within {timeout_s} s (log: {log_path})")


def stop_server(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """SIGTERM (the server stops its ranks); past timeout_s SIGKILL to its process group and to
    every descendant seen before (ranks run in their own sessions)."""
    if proc.poll() is not None:
        return
    descendants = process_tree(proc.pid, skip_ranks=False)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def served(args) -> Iterator[tuple[str, int]]:
    """`orbit serve --serve PACKAGE` as a child in its own session: (url, pid) once healthy."""
    port = free_port()
    extra = shlex.split(args.serve_args)
    extra += [] if "--device" in extra else ["--device", args.device]
    cmd = [sys.executable, "-m", "orbit", "serve", str(args.serve), "--port", str(port), *extra]
    log_path = getattr(args, "serve_log", None) or (
        Path(tempfile.mkdtemp(prefix="orbit-serve-")) / "serve.log"
    )
    print(f"starting {shlex.join(cmd)} (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, args.ready_timeout, log_path)
        yield url, proc.pid
    finally:
        stop_server(proc)


# ---- reference figures beside HTTP ---------------------------------------------------------


def ranks_only_figures(args, levels: list[int]) -> dict[int, float]:
    """benchmarks.step_overhead's tokens/s per batch (decode only, overlapped), from its file."""
    out_dir = Path(tempfile.mkdtemp(prefix="serving-sweep-ranks-"))
    cmd = [sys.executable, "-m", "benchmarks.step_overhead", "--package", str(args.package)]
    cmd += ["--device", args.device, "--tp", str(args.tp), "--out", str(out_dir)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    cmd += ["--batch", ",".join(map(str, levels))]
    print(f"ranks only: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise SweepError(f"benchmarks.step_overhead exited with {done.returncode}")
    report = json.loads((out_dir / "step_overhead.jsonl").read_text().splitlines()[-1])
    return {b: report[f"batch{b}_overlap"]["tokens_per_s"] for b in levels}


def in_process_figures(args, levels: list[int]) -> dict[int, float]:
    """--in-process-core: the same requests submitted to an engine core in this process
    (benchmarks.step_overhead.in_process_levels), {concurrency: output tokens/s} measured as
    the HTTP levels are: the same prompt ids, REQUESTS_PER_STREAM requests per stream, prefill
    included."""
    from benchmarks import step_overhead

    levels_figures = asyncio.run(
        step_overhead.in_process_levels(
            package=args.package,
            device=args.device,
            tp=args.tp,
            prompt_tokens=args.prompt_tokens,
            new_tokens=args.new_tokens,
            concurrencies=levels,
            vocab_size=args.vocab_size,
        )
    )
    return {int(c): float(f["tokens_per_s"]) for c, f in levels_figures.items()}


def add_reference(report: dict, key: str, measure) -> None:
    """Put each level's reference tokens/s beside it as level[key], with HTTP tokens/s over it.
    A reference that fails or is not there is noted in report[key]; the HTTP figures stay."""
    try:
        figures = measure()
    except Exception as exc:  # noqa: BLE001 - the HTTP figures are worth keeping regardless
        report[key] = f"failed: {type(exc).__name__}: {exc}"
        return
    report[key] = "measured" if figures else "not available"
    for level in report["levels"]:
        if ref := (figures or {}).get(level["concurrency"]):
            http = level.get("output_tokens_per_s", 0.0)
            level[key] = {"tokens_per_s": ref, "http_ratio": round(http / ref, 4)}


# ---- the sweep -----------------------------------------------------------------------------


def served_model(url: str, api_key: str) -> str:
    headers = {"Authorization": f"Bearer {api_key}"}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def warm_up(pool: ClientPool, base: ClientJob, num_procs: int) -> None:
    """One short request from each client process: imports, connections, the server's first
    step of this prompt length. Not measured."""
    jobs = [replace(base, new_tokens=4, first_salt=10**6 + i) for i in range(num_procs)]
    if failed := [r.error for r in pool.run(jobs) if not r.ok]:
        raise SweepError(f"warm-up request failed: {failed[0]}")


# The server's counters a level is read between: rank 0 idle while the core planned its next
# step; the steps, the tokens they computed and rank 0's GPU time in them, and the same three
# for the steps that computed part of a prompt; the API servers' sums of TTFT and its parts.
TTFT_PARTS = {
    "ttft": "orbit_time_to_first_token_seconds",
    "queue": "orbit_request_queue_seconds",
    "prefill": "orbit_request_prefill_seconds",
}
COUNTERS = (
    "orbit_rank_wait_seconds_total",
    "orbit_steps_total",
    "orbit_step_tokens_total",
    "orbit_gpu_seconds_total",
    "orbit_prompt_steps_total",
    "orbit_prompt_step_tokens_total",
    "orbit_prompt_gpu_seconds_total",
    "orbit_decode_steps_total",
    "orbit_prompt_step_bucket_tokens_total",
    "orbit_prefix_cache_hit_tokens_total",
    *(f"{name}_{part}" for name in TTFT_PARTS.values() for part in ("sum", "count")),
)


def core_counters(url: str, api_key: str) -> dict[str, float]:
    """COUNTERS from /metrics (those a server exports)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    return parse_counters(httpx.get(url + "/metrics", headers=headers, timeout=30).text)


def parse_counters(metrics_text: str) -> dict[str, float]:
    """COUNTERS from the text of /metrics, or of Engine.metrics_text in process."""
    found = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            found[name] = float(value)
    return found


def step_figures(before: dict, after: dict, wall_s: float) -> dict:
    """A level's share of the wall time rank 0 waited for a plan, and its steps: how many, the
    tokens each computed and rank 0's GPU time each, on average (what sets the tokens/s when
    the GPU is busy: the same requests in fewer, fuller steps go faster). Then the same split
    between the steps that computed part of a prompt and the steps of decode rows alone (one
    token a row without speculation), which tells fewer-rowed steps from more mixed ones; the
    steps left over only released sequences' state."""
    d = {k: after[k] - before[k] for k in COUNTERS if k in before and k in after}
    out = {}
    if "orbit_rank_wait_seconds_total" in d and wall_s:
        out["rank_wait_frac"] = round(d["orbit_rank_wait_seconds_total"] / wall_s, 4)
    if "orbit_prefix_cache_hit_tokens_total" in d:
        # 0 where every request's prompt is new, as the levels' are meant to be
        out["cached_prompt_tokens"] = int(d["orbit_prefix_cache_hit_tokens_total"])
    steps = d.get("orbit_steps_total")
    if not steps:
        return out
    out["steps"] = int(steps)
    if "orbit_step_tokens_total" in d:
        out["tokens_per_step"] = round(d["orbit_step_tokens_total"] / steps, 1)
    if d.get("orbit_gpu_seconds_total"):
        out["gpu_ms_per_step"] = round(d["orbit_gpu_seconds_total"] / steps * 1e3, 3)
    if "orbit_prompt_steps_total" not in d:
        return out  # a server from before these counters
    prompt_steps = int(d["orbit_prompt_steps_total"])
    decode_steps = int(d["orbit_decode_steps_total"])
    out["prompt_steps"] = prompt_steps
    out["decode_steps"] = decode_steps
    gpu_s, gpu_prompt_s = d["orbit_gpu_seconds_total"], d["orbit_prompt_gpu_seconds_total"]
    if prompt_steps:
        out["tokens_per_prompt_step"] = round(d["orbit_prompt_step_tokens_total"] / prompt_steps, 1)
        if gpu_s:
            out["gpu_ms_per_prompt_step"] = round(gpu_prompt_s / prompt_steps * 1e3, 3)
        if bucket_tokens := d.get("orbit_prompt_step_bucket_tokens_total"):
            # the share of the graphs' rows that were padding (what a GPU computes for nothing)
            padding = 1 - d["orbit_prompt_step_tokens_total"] / bucket_tokens
            out["prompt_step_padding_frac"] = round(padding, 4)
    if decode_steps:
        tokens = d["orbit_step_tokens_total"] - d["orbit_prompt_step_tokens_total"]
        out["tokens_per_decode_step"] = round(tokens / decode_steps, 1)
        if gpu_s:
            out["gpu_ms_per_decode_step"] = round((gpu_s - gpu_prompt_s) / decode_steps * 1e3, 3)
    return out


def server_ttft_ms(before: dict, after: dict) -> dict:
    """The level's mean time to first token as the API servers saw it, from a request's arrival
    there, and the core's queue and prefill parts of it (ms). Against the client's TTFT, what
    is left was spent outside the server: in the client, or on the way."""
    out = {}
    for key, name in TTFT_PARTS.items():
        sum_s, count = (
            after.get(f"{name}_{p}", 0.0) - before.get(f"{name}_{p}", 0.0) for p in ("sum", "count")
        )
        if count:
            out[key] = round(sum_s / count * 1e3, 2)
    return out


def measure_level(
    pool: ClientPool, jobs: list, gpu: GpuSampler | None, server_pid, url: str, api_key: str
) -> dict:
    cpu_before = process_tree(server_pid, skip_ranks=True) if server_pid else None
    counters_before = core_counters(url, api_key)
    records = pool.run(jobs)
    counters_after = core_counters(url, api_key)
    level, window = summarize_level(sum(job.streams for job in jobs), records)
    level.update(step_figures(counters_before, counters_after, level.get("wall_s")))
    level["server_ttft_mean_ms"] = server_ttft_ms(counters_before, counters_after)
    # the busiest client process's CPU share of its job: near 1, the client sets the pace
    level["client_busy_frac"] = round(max(pool.busy), 3)
    if server_pid:
        cpu_after = process_tree(server_pid, skip_ranks=True)
        tokens = level.get("output_tokens", 0)
        level["frontend_cpu"] = frontend_cpu(cpu_before, cpu_after, server_pid, tokens)
    if gpu is not None:
        level["gpu_busy_frac"] = gpu.busy_frac(*window) if window else None
    return level


def http_levels(args, levels: list[int], url: str, server_pid: int | None) -> tuple:
    """(model, one dict per level, the TTFT probe or None) through HTTP."""
    model = args.model or served_model(url, args.api_key)
    base = ClientJob(
        url=url,
        api_key=args.api_key,
        model=model,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        temperature=args.temperature,
        logprobs=args.logprobs,
        vocab_size=args.vocab_size,
        timeout_s=args.request_timeout,
    )
    num_procs = min(args.client_procs, max(levels))
    with contextlib.ExitStack() as stack:
        gpu = stack.enter_context(GpuSampler(args.gpu_ids)) if use_gpu_sampler(args) else None
        pool = stack.enter_context(ClientPool(num_procs))
        warm_up(pool, base, num_procs)
        if server_pid:
            print(f"frontend idle after {wait_quiet(server_pid)} s", file=sys.stderr, flush=True)
        results = []
        for concurrency in levels:
            first_salt = level_salts(levels, len(results)).start
            jobs = level_jobs(base, concurrency, num_procs, first_salt)
            results.append(measure_level(pool, jobs, gpu, server_pid, url, args.api_key))
            progress = {k: v for k, v in results[-1].items() if k != "frontend_cpu"}
            print(json.dumps(progress), file=sys.stderr, flush=True)
        probe = None
        if args.ttft_prompt_tokens:
            probe = ttft_probe(pool, base, args.ttft_prompt_tokens)
            print(json.dumps(probe), file=sys.stderr, flush=True)
    return model, results, probe


TTFT_PROBES = 5
TTFT_WARMUP = 2  # unmeasured requests of the probe's length first: its prefill bucket's first use


def ttft_probe(pool: ClientPool, base: ClientJob, prompt_tokens: int) -> dict:
    """TTFT of a prompt_tokens prompt sent alone, TTFT_PROBES times one after another (each a
    prompt of its own): the prefill's latency through HTTP. `ttft_ms` is what a plain HTTP
    client sees (first_data_s: a bare HTTP/1.1 request, body encoded and socket connected
    before the clock starts); `openai_client_ttft_ms` is what the official client sees
    sending token ids, which adds its own work in the client process (for 2,048 ids, 33-44 ms
    of request building on the H200 host, 2026-12-03; 18 ms on the 2-core VM, where the same
    prompt as text takes 0.6 ms); `openai_client_text_ttft_ms` the official client sending
    text of exactly prompt_tokens tokens, as applications do: the server's tokenization is then
    inside the figure."""
    raw = asyncio.run(raw_ttfts_s(base, prompt_tokens, TTFT_WARMUP + TTFT_PROBES))
    job = replace(
        base, prompt_tokens=prompt_tokens, new_tokens=2, streams=1, num_requests=TTFT_PROBES,
        first_salt=10**7, start_at_s=time.perf_counter(),
    )  # fmt: skip
    records = pool.run([job])
    salts = range(3 * 10**7, 3 * 10**7 + TTFT_WARMUP + TTFT_PROBES)
    texts = tuple(exact_text(base, prompt_tokens, salt) for salt in salts)
    text_job = replace(job, num_requests=len(texts), texts=texts, start_at_s=time.perf_counter())
    text_records = pool.run([text_job])[TTFT_WARMUP:]
    return {
        "probe": f"ttft_{prompt_tokens}_tokens",
        "requests": len(records) + len(raw) + len(texts),
        "failures": sum(not r.ok for r in records + text_records),
        "ttft_ms": percentiles_ms(raw[TTFT_WARMUP:]),
        "openai_client_ttft_ms": percentiles_ms([r.times_s[0] - r.sent_s for r in records if r.ok]),
        "openai_client_text_ttft_ms": percentiles_ms(
            [r.times_s[0] - r.sent_s for r in text_records if r.ok]
        ),
    }


WORDS = """
the of and to in is was for on that with as by at from his her it an be this which or
are had not but were all one their they have has been more she when there would who will
its time into only year new other some two could after first than these may people then
over most about also any city made work part such water even back long way day state
both world under house school small great place light river stone field north south
music paper story
""".split()  # noqa: SIM905 - a word list reads better as prose


def exact_text(job: ClientJob, num_tokens: int, salt: int) -> str:
    """English-looking text of words drawn by `salt` (so no two share a prefix to cache) that
    the server's own /tokenize counts as exactly num_tokens tokens, special tokens included as
    /v1/completions adds them."""
    rng = random.Random(salt)
    words: list[str] = []

    def count() -> int:
        r = httpx.post(
            f"{job.url}/tokenize",
            json={"model": job.model, "prompt": " ".join(words)},
            headers={"Authorization": f"Bearer {job.api_key}"},
            timeout=job.timeout_s,
        )
        r.raise_for_status()
        return r.json()["count"]

    def resize(n: int) -> None:
        del words[n:]
        words.extend(rng.choice(WORDS) for _ in range(n - len(words)))

    resize(num_tokens)
    for attempt in range(204):
        have = count()
        if have == num_tokens:
            return " ".join(words)
        if attempt < 4:  # scale the word count by the measured tokens per word
            resize(max(1, round(len(words) * num_tokens / have)))
        else:  # then a word at a time
            resize(len(words) + (1 if have < num_tokens else -1))
    raise SweepError(f"no text of exactly {num_tokens} tokens found (salt {salt})")


async def first_data_s(url: str, api_key: str, body: dict, timeout_s: float) -> float:
    """Seconds from sending a streamed /v1/completions to its first `data:` line, through a bare
    HTTP/1.1 request on a socket connected before the clock starts (the body encoded before it
    too): the server's latency, not an HTTP client library's (httpx added 1-2 ms on the 2-core
    VM, 2026-12-05: 14.5 against 12.4 ms for a 2,048-token cached prefix). The stream is read
    to its end, so a next request runs alone. A failed request raises, and so does one that has
    not ended within timeout_s."""
    async with asyncio.timeout(timeout_s):
        return await _first_data_s(urlsplit(url), api_key, json.dumps(body).encode())


async def _first_data_s(url: SplitResult, api_key: str, content: bytes) -> float:
    head = (
        f"POST {url.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = time.perf_counter()
        writer.write(head + content)
        received, first = b"", None
        while chunk := await reader.read(65536):
            received += chunk
            if first is None and b"\ndata:" in received:
                first = time.perf_counter() - sent
    finally:
        writer.close()
    status = received.split(b" ", 2)[1:2]
    if status != [b"200"]:
        raise SweepError(f"the server answered {received[:300]!r}")
    if first is None:
        raise SweepError("a stream ended without a data line")
    return first


async def raw_ttfts_s(job: ClientJob, prompt_tokens: int, count: int) -> list[float]:
    """Seconds from sending each streamed request to its first `data:` line; a failed request
    raises (the probe is alone on the server: nothing should fail)."""
    times = []
    for i in range(count):
        body = {
            "model": job.model, "prompt": prompt_ids(prompt_tokens, 2 * 10**7 + i, job.vocab_size),
            "max_tokens": 2, "temperature": job.temperature, "stream": True, "ignore_eos": True,
        }  # fmt: skip
        times.append(await first_data_s(job.url, job.api_key, body, job.timeout_s))
    return times


def use_gpu_sampler(args) -> bool:
    present = shutil.which("nvidia-smi") is not None
    if args.gpu_busy == "on" and not present:
        raise SweepError("--gpu-busy on, but there is no nvidia-smi")
    return args.gpu_busy == "on" or (args.gpu_busy == "auto" and present)


def run_sweep(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    with contextlib.ExitStack() as stack:
        url, server_pid = args.url, args.server_pid
        if args.serve:
            url, server_pid = stack.enter_context(served(args))
        report["url"], report["server_pid"] = url, server_pid
        report["model"], report["levels"], probe = http_levels(args, levels, url, server_pid)
        if probe is not None:
            report["ttft_probe"] = probe
    # The server is stopped by now: the references have the accelerator to themselves.
    if args.ranks_only:
        add_reference(report, "ranks_only", lambda: ranks_only_figures(args, levels))
    if args.in_process_core:
        add_reference(report, "in_process_core", lambda: in_process_figures(args, levels))
    return report


# ---- output --------------------------------------------------------------------------------


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _reference(level: dict, key: str) -> str:
    ref = level.get(key)
    return "-" if not ref else f"{ref['tokens_per_s']:,.0f} ({ref['http_ratio']:.2f})"


def _steps(level: dict) -> str:
    if not level.get("steps"):
        return "-"
    gpu = level.get("gpu_ms_per_step")
    each = _fmt(level.get("tokens_per_step")) + (f", {gpu:.2f}" if gpu else "")
    return f"{level['steps']:,} ({each})"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['model']} at {report['url']}")
    for name in ("streams", "reqs", "failed", "tok/s", "req/s", "TTFT ms p50/90/99"):
        table.add_column(name, justify="right")
    for name in ("ITL ms p50/90/99", "tok/chunk", "GPU busy", "waits plan", "CPU µs/tok"):
        table.add_column(name, justify="right")
    table.add_column("steps (tok, GPU ms each)", justify="right")
    table.add_column("ranks only tok/s (HTTP/it)", justify="right")
    table.add_column("in-process tok/s (HTTP/it)", justify="right")
    for level in report["levels"]:
        ttft, itl = level.get("ttft_ms", {}), level.get("itl_ms", {})
        busy = level.get("gpu_busy_frac")
        table.add_row(
            str(level["concurrency"]), str(level["requests"]), str(level["failures"]),
            _fmt(level.get("output_tokens_per_s")), _fmt(level.get("requests_per_s"), 2),
            "/".join(_fmt(ttft.get(f"p{q}")) for q in PERCENTILES),
            "/".join(_fmt(itl.get(f"p{q}"), 2) for q in PERCENTILES),
            _fmt(level.get("tokens_per_chunk"), 2), "-" if busy is None else f"{busy:.0%}",
            _share(level.get("rank_wait_frac")),
            _fmt(level.get("frontend_cpu", {}).get("us_per_token")), _steps(level),
            _reference(level, "ranks_only"), _reference(level, "in_process_core"),
        )  # fmt: skip
    console = Console(width=max(Console().width, 200))  # a pipe gets 80 columns otherwise
    console.print(table)
    if probe := report.get("ttft_probe"):
        for key, who in (
            ("ttft_ms", "plain HTTP"),
            ("openai_client_ttft_ms", "openai client, token ids"),
            ("openai_client_text_ttft_ms", "openai client, text"),
        ):
            ttft = probe[key]
            console.print(
                f"{probe['probe']} ({who}): TTFT ms p50/90/99 "
                + "/".join(_fmt(ttft.get(f"p{q}")) for q in PERCENTILES)
            )
    for level in report["levels"]:
        for proc in level.get("frontend_cpu", {}).get("processes", []):
            cmd = proc["cmd"][proc["cmd"].find(" -m ") + 1 :]  # from -m on: no interpreter path
            console.print(
                f"{level['concurrency']:>5} streams  {proc['role']:<10} pid {proc['pid']:<7} "
                f"{proc['us_per_token']:>9.1f} µs/token  {cmd[:100]}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    server = p.add_argument_group("the server")
    server.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    server.add_argument("--server-pid", type=int, help="its `orbit serve` pid: CPU per token")
    server.add_argument("--serve", type=Path, metavar="PACKAGE", help="start orbit serve on it")
    server.add_argument("--serve-args", default="", help="more `orbit serve` arguments")
    server.add_argument("--ready-timeout", type=float, default=900.0, help="seconds, --serve")
    server.add_argument(
        "--serve-log", type=Path, help="--serve: its log here (default: a temp dir)"
    )
    server.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    server.add_argument("--model", help="model name (default: the server's first)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    load = p.add_argument_group("the load")
    load.add_argument("--concurrency", default="1,8,64,256", help="comma-separated streams")
    load.add_argument("--prompt-tokens", type=int, default=512)
    load.add_argument("--new-tokens", type=int, default=256)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are below it")
    load.add_argument("--client-procs", type=int, default=max(1, min(8, os.cpu_count() // 2)))
    load.add_argument("--request-timeout", type=float, default=1800.0, help="seconds")
    load.add_argument("--logprobs", action="store_true", help="exact tokens per chunk")
    load.add_argument(
        "--ttft-prompt-tokens", type=int, default=0, help="after the levels: TTFT of one prompt"
    )
    extra = p.add_argument_group("measured beside it")
    extra.add_argument("--gpu-busy", choices=["auto", "on", "off"], default="auto")
    extra.add_argument("--gpu-ids", help="nvidia-smi -i (default: every GPU, averaged)")
    extra.add_argument("--ranks-only", action="store_true", help="benchmarks.step_overhead")
    extra.add_argument("--in-process-core", action="store_true", help="the engine-core hook")
    extra.add_argument("--package", type=Path, help="for the references (default: --serve)")
    extra.add_argument("--tp", type=int, default=1, help="the package's TP, for step_overhead")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    args.package = args.package or args.serve
    if args.vocab_size <= 1000:
        p.error("--vocab-size must be over 1000: prompt ids start there")
    if (args.ranks_only or args.in_process_core) and args.package is None:
        p.error("--ranks-only and --in-process-core need --package or --serve")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        report = run_sweep(args)
    except SweepError as exc:
        raise SystemExit(f"serving_sweep: {exc}") from None
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
