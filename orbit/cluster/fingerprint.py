"""A host's fingerprint: what software, GPUs, disk, clock and network its ranks would run with.

orbit/cluster/fingerprint_probe.py runs on the host with the host's `python` and the ranks' `env` (the
same interpreter and import path the ranks get), so the fingerprint describes what the ranks
will see. Its JSON is parsed defensively into frozen dataclasses and is only ever displayed and
compared: strings are cut short, wrong types become None.

The clock offset is the host's time.time() (printed last by the probe, which exits at once)
minus this machine's at the moment the answer arrives; it reads early by the one-way delay of
the answer, a few milliseconds, which is far below the one-second threshold that matters.
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh

from orbit.cluster.config import HostConfig
from orbit.cluster.ssh import ClusterError, RemoteCommandError, run

PROBE_SOURCE = Path(__file__).with_name("fingerprint_probe.py")
PROBE_TIMEOUT_S = 60.0  # importing torch from a cold network file system can take long
KILL_AFTER_S = 2.0  # SIGKILL this long after the SIGTERM that `timeout` sends
MAX_TEXT_CHARS = 200
# Not passed to the probe: the ranks' CUDA_VISIBLE_DEVICES is set per rank, and the fingerprint
# counts every GPU of the host (cluster.toml's gpus are physical indices).
_PER_RANK_ENV = ("CUDA_VISIBLE_DEVICES",)


class FingerprintError(ClusterError):
    """The probe could not run on the host, or printed something that is not a fingerprint."""


@dataclass(frozen=True)
class Interface:
    name: str
    loopback: bool
    up: bool
    kind: str | None  # "bridge", "tun" or None (from /sys/class/net)
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """How the host reaches one peer address: the source address the kernel picks for it."""

    peer: str  # as written in cluster.toml
    address: str | None  # what it resolved to on the host
    source: str | None
    error: str | None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_mib: int
    free_mib: int


@dataclass(frozen=True)
class HostFingerprint:
    hostname: str
    python: str
    orbit: str | None  # None: the host's python cannot import orbit (see errors)
    # SHA-256 of Orbit's source files as the host imports them (fingerprint_probe.code_digest)
    orbit_code: str | None
    torch: str | None
    cuda_runtime: str | None  # torch.version.cuda; None for CPU builds
    nccl: str | None  # torch.cuda.nccl.version() when CUDA is usable
    gpu_count: int  # torch.cuda.device_count(): what ranks can use
    gpus: tuple[Gpu, ...]  # what nvidia-smi lists (model, memory), when present
    driver: str | None
    workdir: str  # absolute on the host
    disk_free_bytes: int
    package_missing: tuple[str, ...]  # files of the host's package, relative to the workdir
    interfaces: tuple[Interface, ...]
    routes: tuple[Route, ...]
    clock_offset_s: float  # host clock minus this machine's
    errors: dict[str, str] = field(default_factory=dict, hash=False)  # probe name -> reason

    def interface(self, name: str) -> Interface | None:
        return next((i for i in self.interfaces if i.name == name), None)

    def interface_with(self, address: str) -> Interface | None:
        """The interface holding `address` (a route's source)."""
        return next((i for i in self.interfaces if address in i.addresses), None)

    @property
    def orbit_build(self) -> str | None:
        return orbit_build(self.orbit, self.orbit_code) if self.orbit else None

    @property
    def gpu_model(self) -> str | None:
        names = sorted({g.name for g in self.gpus})
        return ", ".join(names) if names else None


def orbit_build(version: str, code: str | None) -> str:
    """How hosts' Orbits are compared and shown: the release and the code it runs."""
    return f"{version} (code {code[:12]})" if code else version


async def fingerprint_host(
    conn: asyncssh.SSHClientConnection,
    host: HostConfig,
    package_files: list[str],
    peers: list[str],
    timeout_s: float = PROBE_TIMEOUT_S,
) -> HostFingerprint:
    """Run the probe on the host; package_files are checked under its workdir, and the route
    to each peer address is looked up. Raises FingerprintError."""
    args = {"workdir": host.workdir, "package_files": package_files, "peers": peers}
    command = probe_command(host, PROBE_SOURCE.read_text(), json.dumps(args), timeout_s)
    try:
        out = await run(conn, command, timeout_s=timeout_s + KILL_AFTER_S + 1.0)
    except RemoteCommandError as e:
        status = f"exit status {e.exit_status}"
        if e.exit_status in (None, 124, 137):  # timed out here, or `timeout` ended it there
            status = f"no answer within {timeout_s:g} s"
        raise FingerprintError(
            f"{host.python} on {host.label} could not run the fingerprint probe ({status}): "
            f"{e.stderr_tail or 'no output'}; check hosts.python and hosts.env in cluster.toml."
        ) from None
    return parse_fingerprint(out, time.time(), host.label)


def probe_command(host: HostConfig, source: str, args_json: str, timeout_s: float) -> str:
    """The probe under the host's env, bounded on the host too: closing the SSH channel does not
    end a command that hangs (a python that never returns), so `timeout` kills its process
    group; hosts without `timeout` run it unbounded."""
    env = [f"{k}={v}" for k, v in sorted(host.env.items()) if k not in _PER_RANK_ENV]
    argv = " ".join(shlex.quote(a) for a in ["env", *env, host.python, "-c", source, args_json])
    bounded = f"timeout -k {KILL_AFTER_S:g} {timeout_s:g} {argv}"
    return f"if command -v timeout >/dev/null 2>&1; then exec {bounded}; else exec {argv}; fi"


def parse_fingerprint(out: str, received_at: float, label: str) -> HostFingerprint:
    """The probe's last JSON line as a HostFingerprint; raises FingerprintError."""
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    try:
        data = json.loads(lines[-1])
        if not isinstance(data, dict):
            raise TypeError("not an object")
    except (IndexError, ValueError, TypeError):
        raise FingerprintError(
            f"the fingerprint probe on {label} printed no JSON; something in the host's python "
            f"start-up writes to stdout: {out[-MAX_TEXT_CHARS:]!r}"
        ) from None
    return _from_json(data, received_at)


def _from_json(d: dict[str, Any], received_at: float) -> HostFingerprint:
    remote_time = d.get("time")
    offset = remote_time - received_at if isinstance(remote_time, int | float) else 0.0
    errors = d.get("errors") if isinstance(d.get("errors"), dict) else {}
    return HostFingerprint(
        hostname=_text(d.get("hostname")) or "?",
        python=_text(d.get("python")) or "?",
        orbit=_text(d.get("orbit")),
        orbit_code=_text(d.get("orbit_code")),
        torch=_text(d.get("torch")),
        cuda_runtime=_text(d.get("cuda_runtime")),
        nccl=_text(d.get("nccl")),
        gpu_count=_int(d.get("gpu_count")),
        gpus=tuple(_gpu(g) for g in _list(d.get("gpus")) if isinstance(g, dict)),
        driver=_text(d.get("driver")),
        workdir=_text(d.get("workdir")) or "?",
        disk_free_bytes=_int(d.get("disk_free_bytes")),
        package_missing=tuple(t for t in map(_text, _list(d.get("package_missing"))) if t),
        interfaces=tuple(_interface(i) for i in _list(d.get("interfaces")) if isinstance(i, dict)),
        routes=tuple(_route(r) for r in _list(d.get("routes")) if isinstance(r, dict)),
        clock_offset_s=offset,
        errors={str(k)[:40]: _text(v) or "" for k, v in errors.items()},
    )


def _gpu(g: dict[str, Any]) -> Gpu:
    return Gpu(
        _int(g.get("index")), _text(g.get("name")) or "?", _int(g.get("total_mib")),
        _int(g.get("free_mib")),
    )  # fmt: skip


def _interface(i: dict[str, Any]) -> Interface:
    addresses = tuple(a for a in map(_text, _list(i.get("addresses"))) if a)
    return Interface(
        _text(i.get("name")) or "?", i.get("loopback") is True, i.get("up") is not False,
        _text(i.get("kind")), addresses,
    )  # fmt: skip


def _route(r: dict[str, Any]) -> Route:
    return Route(
        _text(r.get("peer")) or "?", _text(r.get("address")), _text(r.get("source")),
        _text(r.get("error")),
    )  # fmt: skip


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT_CHARS] if isinstance(value, str) and value else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _list(value: Any) -> list[Any]:
    return value[:256] if isinstance(value, list) else []
