"""`orbit up / status / logs / down` and `orbit serve --cluster` against two real OpenSSH hosts
(tests/sshd.py: one network namespace each), with CPU ranks of a tiny TP=2 llama. Completions
through the openai client must equal transformers' greedy generate()."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from orbit.cluster.ops import cluster_down
from orbit.cluster.attach import HEARTBEAT_SILENCE_S
from orbit.cluster.state import load_state, state_path
from orbit.cluster.up import RankStartError, UpEvents, UpOptions, up
from orbit.cluster.ssh import HostUnreachableError
from runtime.package import read_manifest
from tests.cli import STATE_ARGS, default_sigint, orbit, state_dir  # noqa: F401
from tests.server import ServerProcess, alive
from tests.sshd import TestHost, free_port, ssh_hosts  # noqa: F401
from tests.two_host_cluster import (  # noqa: F401
    hosts,
    package,
    rank_processes,
    write_cluster,
)

REPO = Path(__file__).resolve().parents[1]
UP_TIMEOUT_S = 120.0
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def shared_blob(workdir: Path, a: Path, b: Path) -> Path:
    """A blob that packages a and b both hold (a tokenizer file: same tokenizer)."""
    shas = [{e.sha256 for e in read_manifest(p).tokenizer.files} for p in (a, b)]
    common = sorted(shas[0] & shas[1])
    assert common, "the two packages share no file"
    return workdir / "store" / "sha256" / common[0]


def _reference_greedy(checkpoint: Path, prompt_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False
        )
    return out[0, len(prompt_ids) :].tolist()


# ---- failures before or during bring-up ------------------------------------------------------


def test_unknown_host_key_is_refused_before_anything_starts(
    hosts,
    package,
    tmp_path,
):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cluster = write_cluster(
        tmp_path, package, hosts, "unknown-key", host1={"known_hosts": str(empty)}
    )
    done = orbit("up", str(cluster.path), "--timeout", "20")
    host1 = hosts[1]
    assert done.returncode == 1, done.stderr
    assert f"host key for {host1.address}:{host1.port} is not in {empty}" in done.stderr
    assert "--accept-new-host-keys" in done.stderr
    assert empty.read_text() == ""
    for workdir in cluster.workdirs:  # nothing was pushed or started on either host
        assert list(workdir.iterdir()) == []
    assert not state_path(cluster.path).exists()


@pytest.mark.parametrize("how", ["no host at the address", "closed port"])
def test_unreachable_host_fails_within_the_timeout(
    how,
    hosts,
    package,
    tmp_path,
):
    host1 = hosts[1]
    if how == "closed port":  # only sshd's port 22 listens in the namespace
        address, port = host1.address, (23 if host1.netns else free_port(host1.address))
    elif host1.netns:  # an address of the test subnet that no namespace holds
        address, port = host1.gateway.rsplit(".", 1)[0] + ".99", 22
    else:
        pytest.skip("needs network namespaces for an address with nothing behind it")
    overrides = {"address": address, "ssh_port": port}
    cluster = write_cluster(tmp_path, package, hosts, "unreachable", host1=overrides)
    timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(HostUnreachableError, match=f"cannot open SSH to {address}:{port} "):
        asyncio.run(up(cluster.path, UpOptions(timeout_s=timeout_s)))
    assert time.monotonic() - start < timeout_s + 2.0
    assert rank_processes(cluster.workdirs) == []
    assert list(cluster.workdirs[0].iterdir()) == []  # host0 was reachable but got nothing


def test_rank_crashing_at_start_fails_up_with_its_log_and_stops_the_other(
    hosts,
    package,
    tmp_path,
):
    crasher = tmp_path / "python-crash"
    crasher.write_text("#!/bin/sh\necho 'simulated crash: no usable device' >&2\nexit 1\n")
    crasher.chmod(0o755)
    cluster = write_cluster(tmp_path, package, hosts, "crash", host1={"python": str(crasher)})
    start = time.monotonic()
    # --force: the preflight would refuse the broken python before any rank starts
    # (tests/test_doctor.py covers that); this test is about a rank that crashes.
    done = orbit("up", str(cluster.path), "--timeout", str(UP_TIMEOUT_S), "--force")
    elapsed = time.monotonic() - start
    host1 = hosts[1]
    assert done.returncode == 1, done.stderr
    assert f"rank 1 on {host1.address}:{host1.port} exited during start-up" in done.stderr
    assert "simulated crash: no usable device" in done.stderr  # the log tail
    assert "every rank this `orbit up` started was stopped" in done.stderr
    assert elapsed < UP_TIMEOUT_S / 2  # found by watching the process, not by the deadline
    assert rank_processes(cluster.workdirs) == []
    assert (cluster.workdirs[0] / "run").is_dir()  # rank 0 did start, and was stopped
    assert not state_path(cluster.path).exists()


def test_rank_never_ready_fails_at_the_timeout_and_stops_both(hosts, package, tmp_path):
    # A "python" that hangs without connecting (it keeps the rank's command line, as a rank
    # stuck before its first message would); rank 0 starts and waits for it in the TP group.
    hanger = tmp_path / "python-hang"
    hanger.write_text("#!/bin/sh\necho 'hanging before connecting'\nsleep 600\n")
    hanger.chmod(0o755)
    cluster = write_cluster(tmp_path, package, hosts, "hang", host1={"python": str(hanger)})
    timeout_s = 8.0
    start = time.monotonic()
    with pytest.raises(RankStartError) as e:
        asyncio.run(up(cluster.path, UpOptions(timeout_s=timeout_s, stop_grace_s=2.0, force=True)))
    elapsed = time.monotonic() - start
    host1 = hosts[1]
    message = "\n".join([str(e.value), *e.value.__notes__])
    assert f"rank 1 on {host1.address}:{host1.port} was not ready within 8 s" in message
    assert "never connected" in message and "hanging before connecting" in message
    assert "every rank this `orbit up` started was stopped" in message
    assert timeout_s <= elapsed < timeout_s + 20  # push, then the deadline, then the stop
    assert rank_processes(cluster.workdirs) == []
    assert not state_path(cluster.path).exists()


# ---- the happy path --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def running(hosts, package, tmp_path_factory):
    """A cluster brought up with `orbit up`; stopped with `orbit down` at the end if a test
    left it running."""
    cluster = write_cluster(tmp_path_factory.mktemp("e2e"), package, hosts, "e2e")
    start = time.monotonic()
    done = orbit("up", str(cluster.path), "--timeout", str(UP_TIMEOUT_S), "--kv-pages", "256")
    assert done.returncode == 0, done.stderr
    print(f"orbit up took {time.monotonic() - start:.1f} s")
    yield cluster
    if load_state(cluster.path) is not None:
        orbit("down", str(cluster.path))
    assert rank_processes(cluster.workdirs) == []


def test_up_records_live_ranks_and_a_second_up_is_a_no_op(running, hosts):
    state = load_state(running.path)
    assert state is not None and state.tp_size == 2
    assert [r.host_index for r in state.ranks] == [0, 1]
    pids = [r.pid for r in state.ranks]
    assert all(alive(pid) for pid in pids)
    assert sorted(rank_processes(running.workdirs)) == sorted(pids)
    assert state.frontend_address == hosts[0].gateway
    for host in state.hosts:  # each host holds its own ranks' CURVE files, privately
        keys = Path(host.curve_dir)
        secret = f"client-{host.index}.key_secret"  # one rank per host: rank = host index
        assert sorted(p.name for p in keys.iterdir()) == [secret, "server.key"]
        assert keys.stat().st_mode & 0o777 == 0o700
        assert (keys / secret).stat().st_mode & 0o777 == 0o600
    again = orbit("up", str(running.path), "--timeout", str(UP_TIMEOUT_S), "--kv-pages", "256")
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stderr
    assert [r.pid for r in load_state(running.path).ranks] == pids


def test_serve_cluster_matches_transformers_and_leaves_the_ranks(
    running, package, tiny_checkpoints
):
    from transformers import AutoTokenizer

    pids = [r.pid for r in load_state(running.path).ranks]
    tok = AutoTokenizer.from_pretrained(str(package / "tokenizer"))
    with ServerProcess(
        package, "--cluster", str(running.path), ready_timeout_s=90, orbit_args=(*STATE_ARGS,)
    ) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt in PROMPTS:
            ids = tok(prompt).input_ids
            ref = _reference_greedy(tiny_checkpoints["llama"], ids, 16)
            got = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=16)
            assert got.usage.completion_tokens == len(ref)
            assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)
        assert server.stop(signal.SIGTERM) == 0
    assert all(alive(pid) for pid in pids)  # the ranks belong to the cluster, not to serve


def test_up_with_a_draft_serves_draft_speculation(
    running, hosts, package, tiny_checkpoints, package_cache, tmp_path_factory
):
    """`orbit up --draft`: the draft package goes to rank 0's host and rank 0 alone drafts
    with it; `orbit serve --cluster --speculate draft` then gives transformers' greedy text,
    with the draft's proposals kept (the draft is the served model itself, at TP 1). Ranks
    started without a draft refuse --speculate draft at start, naming the fix."""
    from transformers import AutoTokenizer

    refused = orbit("serve", "--cluster", str(running.path), "--speculate", "draft",
                    "--port", str(free_port("127.0.0.1")), timeout_s=120)  # fmt: skip
    assert refused.returncode != 0
    assert "rank 0 has no draft package" in " ".join((refused.stdout + refused.stderr).split())
    draft = package_cache(tiny_checkpoints["llama"], 1, max_batch=8, kv_page_size=4,
                          max_step_tokens=32)  # fmt: skip
    cluster = write_cluster(tmp_path_factory.mktemp("draft"), package, hosts, "draft")
    try:
        up_args = ("--timeout", str(UP_TIMEOUT_S), "--kv-pages", "256", "--draft", str(draft))
        done = orbit("up", str(cluster.path), *up_args)
        assert done.returncode == 0, done.stderr
        ranks = sorted(load_state(cluster.path).ranks, key=lambda r: r.rank)
        cmdlines = [Path(f"/proc/{r.pid}/cmdline").read_bytes().split(b"\0") for r in ranks]
        assert b"--draft-package" in cmdlines[0] and b"--draft-package" not in cmdlines[1]
        drafted = cmdlines[0][cmdlines[0].index(b"--draft-package") + 1].decode()
        assert drafted.startswith(str(cluster.workdirs[0]))  # pushed to rank 0's host
        tok = AutoTokenizer.from_pretrained(str(package / "tokenizer"))
        args = ("--cluster", str(cluster.path), "--speculate", "draft")
        with ServerProcess(package, *args, ready_timeout_s=90, orbit_args=(*STATE_ARGS,)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            for prompt in PROMPTS:
                ids = tok(prompt).input_ids
                ref = _reference_greedy(tiny_checkpoints["llama"], ids, 16)
                got = client.completions.create(
                    model=model, prompt=ids, temperature=0, max_tokens=16
                )
                assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)
            metrics = server.metrics()
        assert metrics["orbit_spec_accepted_tokens_total"] > 0
    finally:
        asyncio.run(cluster_down(cluster.path, grace_s=10.0))
    assert rank_processes(cluster.workdirs) == []


def test_status_shows_both_ranks_alive(running, hosts):
    state = load_state(running.path)
    done = orbit("status", str(running.path))
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line for line in done.stdout.splitlines() if state.package_digest[:12] in line]
    rows = rows[1:] if "frontend" in rows[0] else rows  # the title names the package too
    assert len(rows) == 2
    for host, rank, row in zip(hosts, state.ranks, rows):
        assert f"{host.address}:{host.port}" in row
        assert str(rank.pid) in row and "yes" in row


def test_logs_print_one_ranks_log_and_follow_stops_cleanly(running):
    state = load_state(running.path)
    done = orbit("logs", str(running.path), "--rank", "1")
    assert done.returncode == 0, done.stderr
    assert f"[orbit] rank 1: pid {state.ranks[1].pid}" in done.stdout
    assert "rank 0:" not in done.stdout

    follow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orbit",
            *STATE_ARGS,
            "logs",
            str(running.path),
            "--follow",
            "--lines",
            "5",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    guard = threading.Timer(30, follow.send_signal, [signal.SIGINT])  # bounds the reads
    guard.start()
    seen = set()
    try:
        for line in follow.stdout:  # each rank's first line, prefixed with its rank
            seen |= {r for r in (0, 1) if line.startswith(f"[rank {r}] [orbit] rank {r}: pid")}
            if len(seen) == 2:
                break
    finally:
        guard.cancel()
        follow.send_signal(signal.SIGINT)  # Ctrl-C: the normal way out
        assert follow.wait(timeout=30) == 0, follow.stderr.read()
    assert seen == {0, 1}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _tails_of(state.ranks[0].log_file):
        time.sleep(0.1)
    assert _tails_of(state.ranks[0].log_file) == []  # no `tail -F` left on the host


def _tails_of(path: str) -> list[int]:
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _cmdline(p).startswith("tail ") and path in _cmdline(p)
    ]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class _PushWatch(UpEvents):
    """Notes, as each host's push ends, whether the old ranks are all still alive, and when
    the last push ended and the last new rank became ready."""

    def __init__(self, old_pids: list[int]) -> None:
        self.old_pids = old_pids
        self.old_alive_after_push: list[bool] = []
        self.pushed_at = self.ready_at = 0.0

    def pushed(self, host_index: int, result) -> None:
        self.old_alive_after_push.append(all(alive(pid) for pid in self.old_pids))
        self.pushed_at = time.monotonic()

    def rank_state(self, rank: int, host_label: str, state: str, detail: str = "") -> None:
        if state == "ready":
            self.ready_at = time.monotonic()


def test_replacement_pushes_before_it_stops_the_old_ranks_and_repairs_a_corrupted_blob(
    running, package, tiny_checkpoints, package_cache
):
    # Same model, other capacities: a new package digest, with the same tokenizer files.
    new_package = package_cache(
        tiny_checkpoints["llama"], 2, max_batch=4, kv_page_size=4, max_step_tokens=32
    )
    old = load_state(running.path)
    blob = shared_blob(running.workdirs[1], package, new_package)
    good = hashlib.sha256(blob.read_bytes()).hexdigest()
    with open(blob, "r+b") as f:  # flip one byte in place, size unchanged
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    text = running.path.read_text()
    running.path.write_text(text.replace(json.dumps(str(package)), json.dumps(str(new_package))))
    watch = _PushWatch([r.pid for r in old.ranks])
    try:
        opts = UpOptions(timeout_s=UP_TIMEOUT_S, kv_pages=256)
        result = asyncio.run(up(running.path, opts, watch))
    finally:
        running.path.write_text(text)
    assert watch.old_alive_after_push == [True, True]  # served on until both pushes were done
    print(f"replacement: no ranks ready for at most {watch.ready_at - watch.pushed_at:.1f} s")
    assert result.replaced and not result.already_running
    assert result.state.package_digest != old.package_digest
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == good
    assert not any(alive(r.pid) for r in old.ranks)
    assert all(alive(r.pid) for r in result.state.ranks)


def test_down_stops_every_rank_and_forgets_the_cluster(running):
    state = load_state(running.path)
    pids = [r.pid for r in state.ranks]
    assert all(alive(pid) for pid in pids)
    done = orbit("down", str(running.path))
    assert done.returncode == 0, done.stderr
    assert "stopped 2 ranks on 2 hosts" in done.stderr
    assert not any(alive(pid) for pid in pids)
    assert rank_processes(running.workdirs) == []
    assert load_state(running.path) is None
    assert not Path(state.curve_dir).exists()
    assert not any(Path(h.curve_dir).exists() for h in state.hosts)
    again = orbit("down", str(running.path))
    assert again.returncode == 0 and "nothing to stop" in again.stderr
    status = orbit("status", str(running.path))
    assert status.returncode == 1 and "no cluster is recorded" in status.stderr


def test_a_rank_dying_under_serve_fails_fast_and_serve_recovers_after_up(
    hosts, package, tmp_path_factory
):
    cluster = write_cluster(tmp_path_factory.mktemp("death"), package, hosts, "death")
    try:
        state = asyncio.run(up(cluster.path, UpOptions(timeout_s=UP_TIMEOUT_S, kv_pages=64))).state
        with ServerProcess(
            package, "--cluster", str(cluster.path), ready_timeout_s=90, orbit_args=(*STATE_ARGS,)
        ) as server:
            os.kill(state.ranks[1].pid, signal.SIGKILL)
            deadline = time.monotonic() + HEARTBEAT_SILENCE_S + 15
            while time.monotonic() < deadline and _health(server) == 200:
                time.sleep(0.2)
            assert _health(server) == 503
            while time.monotonic() < deadline and alive(state.ranks[0].pid):
                time.sleep(0.2)
            assert not alive(state.ranks[0].pid)  # told to shut down: its group is broken
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=10,
                json={"model": "llama", "prompt": "hi", "max_tokens": 2},
            )
            assert r.status_code == 503
            status = orbit("status", str(cluster.path))
            assert status.returncode == 1
            assert status.stdout.count(" no ") == 2, status.stdout
            # The frontend stays up; a new `orbit up` brings a new group it attaches to.
            again = orbit(
                "up", str(cluster.path), "--timeout", str(UP_TIMEOUT_S), "--kv-pages", "64"
            )
            assert again.returncode == 0, again.stderr
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _health(server) != 200:
                time.sleep(0.2)
            assert _health(server) == 200
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=60,
                json={"model": "llama", "prompt": "hi", "max_tokens": 2},
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert server.stop(signal.SIGTERM) == 0
    finally:
        asyncio.run(cluster_down(cluster.path, grace_s=10.0))
    assert rank_processes(cluster.workdirs) == []


def _health(server: ServerProcess) -> int:
    return httpx.get(server.url + "/health", timeout=5).status_code


def test_required_signature_refuses_unsigned_and_ranks_check_signed(
    hosts, package, tiny_checkpoints, tmp_path_factory
):
    folder = tmp_path_factory.mktemp("signed")
    assert orbit("keygen", str(folder / "signer")).returncode == 0
    signed = folder / "signed-pkg"
    made = orbit(
        "prepare",
        str(tiny_checkpoints["llama"]),
        "--tp",
        "2",
        "--out",
        str(signed),
        "--max-batch",
        "8",
        "--page-size",
        "4",
        "--max-step-tokens",
        "32",
        "--sign",
        str(folder / "signer"),
    )
    assert made.returncode == 0, made.stderr
    head = 'require_signature = true\ntrusted_keys = ["signer.pub"]\n'

    refused = write_cluster(folder / "a", package, hosts, "unsigned")
    refused.path.write_text(
        head.replace("signer.pub", str(folder / "signer.pub")) + refused.path.read_text()
    )
    done = orbit("up", str(refused.path), "--timeout", str(UP_TIMEOUT_S))
    assert done.returncode == 1
    assert "is not signed (manifest.sig is missing)" in " ".join(done.stderr.split())
    assert rank_processes(refused.workdirs) == []

    ok = write_cluster(folder / "b", signed, hosts, "signed")
    ok.path.write_text(head.replace("signer.pub", str(folder / "signer.pub")) + ok.path.read_text())
    try:
        done = orbit("up", str(ok.path), "--timeout", str(UP_TIMEOUT_S), "--kv-pages", "64")
        assert done.returncode == 0, done.stderr
        for r in load_state(ok.path).ranks:  # each rank was told to check the signature
            cmdline = Path(f"/proc/{r.pid}/cmdline").read_bytes().split(b"\0")
            assert b"--trusted-key" in cmdline
    finally:
        asyncio.run(cluster_down(ok.path, grace_s=10.0))
    assert rank_processes(ok.workdirs) == []
