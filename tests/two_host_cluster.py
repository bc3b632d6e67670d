"""Fixtures and helpers of the tests that bring a two-host cluster of CPU ranks up over real
OpenSSH hosts (tests/test_cluster_up.py, tests/test_doctor.py, tests/test_cluster_faults.py):
import the fixtures with `ssh_hosts` beside them."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server import alive
from tests.sshd import TestHost

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hosts(ssh_hosts) -> list[TestHost]:
    return ssh_hosts


@pytest.fixture(scope="module")
def package(tiny_checkpoints, package_cache) -> Path:
    """A tiny TP=2 llama package, small enough capacities that CPU ranks start fast."""
    return package_cache(
        tiny_checkpoints["llama"], 2, max_batch=8, kv_page_size=4, max_step_tokens=32
    )


@dataclass(frozen=True)
class Cluster:
    path: Path  # cluster.toml
    workdirs: tuple[Path, ...]


def interface_of(host: TestHost) -> str:
    """The interface holding the host's address: gloo must use it, not loopback."""
    if not host.netns:
        return "lo"
    out = host.run(f"ip -o -4 addr show to {host.address}")
    return out.split()[1]


def host_table(host: TestHost, workdir: Path, **overrides) -> str:
    fields = {
        "address": host.address,
        "ssh_port": host.port,
        "user": host.user,
        "identity_file": str(host.identity_file),
        "known_hosts": str(host.known_hosts),
        "gpus": 1,
        "device": "cpu",
        "workdir": str(workdir),
        "python": sys.executable,
        "nccl_interface": interface_of(host),
        **overrides,
    }
    lines = ["[[hosts]]", *(f"{k} = {json.dumps(v)}" for k, v in fields.items())]
    lines.append(f"env = {{ PYTHONPATH = {json.dumps(str(REPO))} }}")
    return "\n".join(lines) + "\n"


def write_cluster(
    folder: Path, package: Path, hosts: list[TestHost], name: str, tables: str = "",
    **per_host: dict,
) -> Cluster:  # fmt: skip
    """cluster.toml for `hosts` with fresh workdirs; per_host["host1"] overrides host1's keys,
    `tables` is TOML placed before [frontend] (an [ssh] table, say)."""
    folder.mkdir(parents=True, exist_ok=True)
    start = random.randrange(20000, 60000, 100)
    text = (
        f"package = {json.dumps(str(package))}\n\n{tables}\n[frontend]\n"
        f"address = {json.dumps(hosts[0].gateway)}\nport_range = [{start}, {start + 49}]\n\n"
    )
    workdirs = tuple(h.new_workdir(name) for h in hosts)
    for h, w in zip(hosts, workdirs):
        text += "\n" + host_table(h, w, **per_host.get(h.name, {}))
    path = folder / "cluster.toml"
    path.write_text(text)
    return Cluster(path, workdirs)


def rank_processes(workdirs: tuple[Path, ...]) -> list[int]:
    """Pids of live processes whose command line mentions a workdir (the namespaces share this
    machine's pid namespace, so /proc sees every host's processes)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(str(w) in cmdline for w in workdirs) and alive(int(proc.name)):
            found.append(int(proc.name))
    return found
