"""`orbit doctor` and the preflight of `orbit up` against two real OpenSSH hosts (tests/sshd.py),
with CPU ranks of a tiny TP=2 llama: fingerprints, mismatches and their fixes, the refusal
without --force, the collectives check over gloo, and ranks that hang while joining the group.

Hosts are made to differ by giving one a different `python`: a wrapper around the real
interpreter, so every fingerprint still comes from actually running the host's python.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from orbit import __version__ as orbit_version
from orbit.cluster.checks import HARD, WARN, check_software, choose_interface
from orbit.cluster.state import load_state, state_path
from orbit.cluster.up import RankStartError, UpOptions, up
from orbit.cluster.fingerprint import HostFingerprint, Interface, Route, orbit_build
from orbit.cluster.fingerprint_probe import CODE_PACKAGES, code_digest
from orbit.cluster.netcheck import remote_listener
from orbit.cluster.ssh import connect
from tests.cli import STATE_ARGS, orbit, state_dir  # noqa: F401
from tests.sshd import TestHost, free_port, ssh_hosts  # noqa: F401
from tests.two_host_cluster import hosts, package  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def write_cluster(
    folder: Path, package: Path, hosts: list[TestHost], frontend: str = "", **per_host: dict
) -> Path:
    """cluster.toml for `hosts` with fresh workdirs and no pinned interface (the preflight
    chooses it); per_host["host1"] overrides host1's keys (its "env" replaces the PYTHONPATH
    that points at this source tree)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = random.randrange(20000, 60000, 100)
    text = (
        f"package = {json.dumps(str(package))}\n\n[frontend]\n"
        f"address = {json.dumps(frontend or hosts[0].gateway)}\n"
        f"port_range = [{start}, {start + 49}]\n"
    )
    for h in hosts:
        overrides = dict(per_host.get(h.name, {}))
        env = overrides.pop("env", {"PYTHONPATH": str(REPO)})
        fields = {
            "address": h.address, "ssh_port": h.port, "user": h.user,
            "identity_file": str(h.identity_file), "known_hosts": str(h.known_hosts),
            "gpus": 1, "device": "cpu", "workdir": str(h.new_workdir(folder.name)),
            "python": sys.executable, **overrides,
        }  # fmt: skip
        text += "\n[[hosts]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
        text += "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + " }\n"
    path = folder / "cluster.toml"
    path.write_text(text)
    return path


def fake_torch_python(folder: Path, version: str) -> Path:
    """A `python` whose torch reports `version`: the real interpreter with a sitecustomize that
    patches torch.__version__ at start-up."""
    patch = folder / "fake-torch"
    patch.mkdir(parents=True)
    (patch / "sitecustomize.py").write_text(f"import torch\ntorch.__version__ = {version!r}\n")
    wrapper = folder / "python-fake-torch"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH="{patch}${{PYTHONPATH:+:$PYTHONPATH}}" exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def unreachable_dist_python(folder: Path, dist_init: str) -> Path:
    """A `python` that starts ranks with --dist-init pointing at an address where nothing
    answers, as a firewall dropping the torch.distributed port would; anything else runs as is."""
    wrapper = folder / "python-lost-dist"
    wrapper.write_text(
        f"#!{sys.executable}\nimport os, sys\nargv = sys.argv[1:]\n"
        "if '--dist-init' in argv:\n"
        f"    argv[argv.index('--dist-init') + 1] = {dist_init!r}\n"
        "os.execv(sys.executable, [sys.executable, *argv])\n"
    )
    wrapper.chmod(0o755)
    return wrapper


def nowhere(host: TestHost) -> str:
    """A torch.distributed address that never answers: an unused address of the test subnet,
    or a closed loopback port when the hosts are loopback addresses."""
    if host.netns:
        return f"tcp://{host.gateway.rsplit('.', 1)[0]}.99:29400"
    return f"tcp://127.0.0.1:{free_port('127.0.0.1')}"


def pushed_nothing(cluster: Path) -> bool:
    folders = [Path(line.split('"')[1]) for line in cluster.read_text().splitlines()
               if line.startswith("workdir")]  # fmt: skip
    return all(not (w / "packages").exists() and not (w / "run").exists() for w in folders)


def rank_pids(cluster: Path) -> list[int]:
    """Live processes started for this cluster's workdirs (the namespaces share our pids)."""
    marker = str(cluster.parent.name)
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "-m ranks" in cmdline and f"/workdirs/{marker}/" in cmdline:
            found.append(int(proc.name))
    return found


# ---- orbit doctor ----------------------------------------------------------------------------


def test_doctor_lists_both_hosts_and_passes(hosts, package, tmp_path):
    cluster = write_cluster(tmp_path / "healthy", package, hosts)
    start = time.monotonic()
    done = orbit("doctor", str(cluster))
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for h in hosts:
        row = next(line for line in out.splitlines() if f"{h.address}:{h.port} (" in line)
        assert _torch_version() in row and " cpu " in row and "missing" in row
    # The package is not there yet: a warning with its fix, not a failure.
    assert out.count("the package is not on the host") == 2
    assert "`orbit up` pushes it" in out
    assert "routes between hosts" in out
    if hosts[0].netns:  # each host's route to the other leaves through its veth: chosen
        assert out.count("ovi") >= 2 and "(chosen)" in out
    assert "0 hard problem(s)" in out
    assert pushed_nothing(cluster)
    print(f"orbit doctor took {elapsed:.1f} s")


def test_different_torch_is_flagged_and_up_refuses_it(hosts, package, tmp_path):
    fake = fake_torch_python(tmp_path, "2.0.0+fake")
    cluster = write_cluster(tmp_path / "torch", package, hosts, host1={"python": str(fake)})
    done = orbit("doctor", str(cluster))
    assert done.returncode == 1, done.stdout + done.stderr
    real = _torch_version()
    assert f"torch 2.0.0+fake here, {real} on the other hosts" in done.stdout
    assert f"install torch {real} here" in done.stdout
    assert "1 hard problem(s)" in done.stdout

    refused = orbit("up", str(cluster), "--timeout", "60")
    assert refused.returncode == 1, refused.stderr
    assert "preflight found 1 problem(s)" in refused.stderr
    assert f"hosts[1] {hosts[1].address}:{hosts[1].port}: torch 2.0.0+fake here" in refused.stderr
    assert "--force" in refused.stderr
    assert pushed_nothing(cluster) and not state_path(cluster).exists()


def test_too_few_gpus_is_flagged_and_up_refuses_it(hosts, package, tmp_path):
    # One CPU-only host asked for two CUDA ranks (the package is TP=2).
    cluster = write_cluster(
        tmp_path / "gpus", package, hosts[:1], host0={"device": "cuda", "gpus": 2}
    )
    done = orbit("doctor", str(cluster))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cluster.toml asks for GPUs [0, 1], torch sees 0" in done.stdout
    assert 'use a GPU host, or set device = "cpu"' in done.stdout

    refused = orbit("up", str(cluster), "--timeout", "60")
    assert refused.returncode == 1, refused.stderr
    assert "asks for GPUs [0, 1], torch sees 0" in refused.stderr
    assert "--force" in refused.stderr
    assert pushed_nothing(cluster)


def test_a_frontend_the_hosts_cannot_reach_is_flagged_with_the_fix(hosts, package, tmp_path):
    if not hosts[0].netns:
        pytest.skip("needs network namespaces: on loopback hosts 127.0.0.1 is reachable")
    # Listening on this machine's loopback: each host's 127.0.0.1 is its own.
    cluster = write_cluster(tmp_path / "frontend", package, hosts, frontend="127.0.0.1")
    done = orbit("doctor", str(cluster))
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert out.count("cannot connect to the frontend at tcp://127.0.0.1:") == 2
    assert "Connection refused" in out and "open frontend.port_range" in out


def test_a_host_whose_python_hangs_is_reported_within_the_timeout(hosts, package, tmp_path):
    hanger = tmp_path / "python-hang"
    hanger.write_text("#!/bin/sh\nsleep 600\n")
    hanger.chmod(0o755)
    cluster = write_cluster(tmp_path / "hang", package, hosts, host1={"python": str(hanger)})
    start = time.monotonic()
    done = orbit("doctor", str(cluster), "--timeout", "4")
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert (
        f"{hanger} on {hosts[1].address}:{hosts[1].port} could not run the fingerprint probe" in out
    )
    assert "no answer within 4 s" in out
    assert elapsed < 20
    deadline = time.monotonic() + 10  # `timeout` on the host ends the probe's process group
    while time.monotonic() < deadline and _processes_of(hanger):
        time.sleep(0.2)
    assert _processes_of(hanger) == []


def test_more_ranks_than_shards_is_a_finding_and_the_rest_is_still_checked(
    hosts, package, tmp_path
):
    # Three ranks for a TP=2 package: rank 2 has no shard.
    cluster = write_cluster(tmp_path / "three", package, hosts, host0={"gpus": 2})
    done = orbit("doctor", str(cluster))
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert (
        "the hosts place 3 ranks (hosts[0]: 2, hosts[1]: 1) but the package has 2 shards "
        "(tp_size 2); every rank needs exactly one." in out
    )
    assert "or prepare the package with --tp 3" in out
    for h in hosts:  # every host was still fingerprinted, and its package files checked
        assert f"{h.address}:{h.port} (" in out
    assert out.count("the package is not on the host") == 2
    assert "routes between hosts" in out and "1 hard problem(s)" in out


def test_a_package_without_the_required_signature_is_a_finding(hosts, package, tmp_path):
    assert orbit("keygen", str(tmp_path / "signer")).returncode == 0
    cluster = write_cluster(tmp_path / "signature", package, hosts)
    head = f'require_signature = true\ntrusted_keys = ["{tmp_path / "signer.pub"}"]\n'
    cluster.write_text(head + cluster.read_text())
    done = orbit("doctor", str(cluster))
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert f"{package} is not signed (manifest.sig is missing)" in out  # the table wraps
    assert "sign the package (`orbit prepare --sign KEY`)" in out
    for h in hosts:
        assert f"{h.address}:{h.port} (" in out
    assert "1 hard problem(s)" in out


def test_hosts_running_other_code_are_flagged_and_up_refuses_them(hosts, package, tmp_path):
    # host1 imports a copy of the source tree with one comment added: same __version__.
    copy = tmp_path / "src"
    for name in CODE_PACKAGES:
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "orbit" / "engine.py", "a") as f:
        f.write("# a local edit\n")
    cluster = write_cluster(
        tmp_path / "code", package, hosts, host1={"env": {"PYTHONPATH": str(copy)}}
    )
    ours = orbit_build(orbit_version, code_digest([str(REPO)]))
    theirs = orbit_build(orbit_version, code_digest([str(copy)]))
    assert ours != theirs

    start = time.monotonic()
    done = orbit("doctor", str(cluster))
    print(f"orbit doctor found the code mismatch in {time.monotonic() - start:.1f} s")
    assert done.returncode == 1, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    h1 = f"hosts[1] {hosts[1].address}:{hosts[1].port}"
    [row] = [line for line in done.stdout.splitlines() if f"Orbit {theirs} here" in line]
    assert h1 in row and f"{ours} on this machine (the frontend)." in row
    assert "install this machine's Orbit here: same commit, no local edits." in row
    assert "1 hard problem(s)" in out

    start = time.monotonic()
    refused = orbit("up", str(cluster), "--timeout", "60")
    print(f"orbit up refused the code mismatch in {time.monotonic() - start:.1f} s")
    assert refused.returncode == 1, refused.stderr
    err = " ".join(refused.stderr.split())
    assert f"{h1}: Orbit {theirs} here, {ours} on this machine" in err
    assert pushed_nothing(cluster) and not state_path(cluster).exists()


async def test_the_port_check_listens_only_on_the_address_it_checks(hosts):
    host = hosts[0]
    port = random.randrange(40000, 50000)
    async with await connect(host.host_config(), False, 10.0) as conn:
        config = host.host_config(python=sys.executable)
        async with remote_listener(conn, config, host.address, port) as error:
            assert error is None
            sockets = [line.split()[3] for line in host.run("ss -ltnH").splitlines()]
            assert [s for s in sockets if s.endswith(f":{port}")] == [f"{host.address}:{port}"]
            # Another address of the same host is not listened on.
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), 3)"
            with pytest.raises(RuntimeError, match="Connection refused"):
                host.run(f"{sys.executable} -c {shlex.quote(probe)}")


def _processes_of(path: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if str(path) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def _torch_version() -> str:
    import torch

    return torch.__version__


# ---- orbit up: phases and the collectives check ----------------------------------------------


def test_up_reports_phases_and_the_gloo_collectives_check(hosts, package, tmp_path):
    cluster = write_cluster(tmp_path / "gloo", package, hosts)
    try:
        done = orbit("up", str(cluster), "--timeout", "120", "--kv-pages", "64")
        assert done.returncode == 0, done.stderr
        err = done.stderr
        match = re.search(r"collectives check: all-reduce of ([\d.]+) KiB over gloo/tcp", err)
        assert match, err
        assert float(match.group(1)) == 8 * 64 * 4 / 1024  # max_batch x hidden x float32
        latencies = re.findall(r"rank (\d) (\d+) µs", err)
        assert sorted(r for r, _ in latencies) == ["0", "1"] and all(int(us) > 0 for _, us in
                                                                    latencies)  # fmt: skip
        assert "preflight: 0 hard problem(s)" in err
        if hosts[0].netns:  # the chosen interface reached the ranks as GLOO_SOCKET_IFNAME
            assert re.search(r"interface ovi\d", err), err
        state = load_state(cluster)
        assert state is not None and len(state.ranks) == 2
    finally:
        orbit("down", str(cluster))
    assert rank_pids(cluster) == []


# ---- ranks that hang while joining the TP group ----------------------------------------------


def test_watchdog_ends_a_rank_stuck_joining_and_up_names_phase_host_and_rank(
    hosts, package, tmp_path
):
    lost = unreachable_dist_python(tmp_path, nowhere(hosts[1]))
    cluster = write_cluster(tmp_path / "watchdog", package, hosts, host1={"python": str(lost)})
    start = time.monotonic()
    done = orbit("up", str(cluster), "--timeout", "90", "--join-timeout", "6")
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    err = " ".join(done.stderr.split())  # rich wraps long lines
    h1 = f"{hosts[1].address}:{hosts[1].port}"
    assert re.search(rf"rank 1 on {re.escape(h1)}[^.]*join group", err, re.IGNORECASE), err
    assert "join group did not finish within 6 s" in err
    assert "every rank this `orbit up` started was stopped" in err
    assert elapsed < 60  # the watchdog's 6 s, not --timeout's 90
    assert rank_pids(cluster) == [] and not state_path(cluster).exists()


def test_up_timeout_names_the_phase_each_rank_is_stuck_in(hosts, package, tmp_path):
    lost = unreachable_dist_python(tmp_path, nowhere(hosts[1]))
    cluster = write_cluster(tmp_path / "deadline", package, hosts, host1={"python": str(lost)})
    timeout_s = 10.0
    start = time.monotonic()
    with pytest.raises(RankStartError) as e:
        asyncio.run(up(cluster, UpOptions(timeout_s=timeout_s, stop_grace_s=2.0)))
    elapsed = time.monotonic() - start
    message = str(e.value)
    for rank, h in enumerate(hosts):
        assert re.search(rf"rank {rank} on {h.address}:{h.port} \(in join group for [\d.]+ s\)",
                         message), message  # fmt: skip
    assert f"was not ready within {timeout_s:g} s" in message
    assert elapsed < timeout_s + 30  # preflight, push, the deadline, the stop
    assert rank_pids(cluster) == []


# ---- the checks themselves, on made-up fingerprints ------------------------------------------


BASE_FP = HostFingerprint(
    hostname="h", python="3.11.7", orbit="0.1.0", orbit_code=None, torch="2.5.1+cu124",
    cuda_runtime="12.4", nccl="2.21.5", gpu_count=8, gpus=(), driver="550.54", workdir="/w",
    disk_free_bytes=1 << 40, package_missing=(), interfaces=(), routes=(), clock_offset_s=0.0,
)  # fmt: skip


def _fp(**changes) -> HostFingerprint:
    return dataclasses.replace(BASE_FP, **changes)


def test_versions_are_compared_against_the_majority():
    fps = [_fp(), _fp(nccl="2.18.1"), _fp(), _fp(python="3.11.9")]
    found = {(f.check, f.host_index, f.severity) for f in check_software(fps, "0.1.0")}
    assert found == {("nccl", 1, HARD), ("python", 3, WARN)}


def test_interface_is_chosen_from_routes_and_never_a_bridge():
    from orbit.cluster.config import parse_cluster_config

    two_hosts = 'package = "p"\n[[hosts]]\naddress = "10.0.0.1"\n[[hosts]]\naddress = "10.0.0.2"\n'
    config = parse_cluster_config(two_hosts)
    eth = Interface("eth1", False, True, None, ("10.0.0.1",))
    docker = Interface("docker0", False, True, "bridge", ("10.0.0.1",))
    route = (Route("10.0.0.2", "10.0.0.2", "10.0.0.1", None),)
    assert choose_interface(config, 0, _fp(interfaces=(eth,), routes=route)) == ("eth1", [])
    chosen, found = choose_interface(config, 0, _fp(interfaces=(docker,), routes=route))
    assert chosen is None and found[0].severity == WARN and "docker0" in found[0].message
    pinned = parse_cluster_config(two_hosts + 'nccl_interface = "ib0"\n')  # on hosts[1]
    chosen, found = choose_interface(pinned, 1, _fp(interfaces=(eth,), routes=route))
    assert chosen == "ib0" and found[0].severity == HARD
    assert "'ib0' is not an interface of this host (it has eth1)" in found[0].message


def test_slow_or_socket_collectives_are_warned_about():
    from orbit.cluster.readiness import collectives_text, collectives_warnings
    from proto import wire_pb2

    def ready(rank: int, us: float, transport: str = "nccl/ib") -> wire_pb2.Ready:
        return wire_pb2.Ready(
            rank=rank, allreduce_us=us, allreduce_bytes=16 << 10, transport=transport,
            num_hosts=2, interface="ib0",
        )  # fmt: skip

    fast, slow = ready(0, 60), ready(1, 5000)
    assert collectives_warnings([fast]) == []
    [warning] = collectives_warnings([fast, slow])
    assert "rank 1's all-reduce of 16.0 KiB took 5000 µs, over 10x what nccl/ib allows" in warning
    assert collectives_text([fast, slow]) == (
        "collectives check: all-reduce of 16.0 KiB over nccl/ib across 2 hosts, interface ib0: "
        "rank 0 60 µs, rank 1 5000 µs"
    )
    assert "plain TCP sockets" in collectives_warnings([ready(0, 300, "nccl/socket")])[0]
    assert collectives_warnings([ready(0, 50_000, "gloo/tcp")]) == []  # CPU ranks: not judged
