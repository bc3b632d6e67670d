"""The checks of the preflight (orbit/cluster/preflight.py) on fingerprints already taken: versions
that must match between hosts, GPUs, disk and package, clocks, and the interface collectives are
pinned to. Pure functions of cluster.toml and the fingerprints; each problem is a Finding with
its fix. docs/doctor.md lists them with what to do.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from orbit.cluster.config import ClusterConfig, HostConfig
from orbit.cluster.fingerprint import HostFingerprint, Interface

# HARD: ranks would fail or hang; `orbit up` refuses to start unless --force. WARN: worth
# knowing, never stops a bring-up.
HARD, WARN = "hard", "warn"
CLOCK_OFFSET_LIMIT_S = 1.0
LOW_DISK_BYTES = 1 << 30  # free space left after the push below which doctor warns
LOW_GPU_FREE_FRACTION = 0.5  # a GPU with less free memory is probably used by something else
# Interfaces collectives must not be pinned to unless nothing else reaches the peers: container
# bridges, VPNs and overlays (NCCL and gloo pick them by mistake; see docs/doctor.md).
VIRTUAL_PREFIXES = (
    "docker", "br-", "virbr", "lxcbr", "lxdbr", "cni", "flannel", "cali", "weave", "podman",
    "tailscale", "zt", "wg", "tun", "tap", "vmnet", "vboxnet",
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    severity: str  # HARD or WARN
    check: str  # the doctor table column it concerns: "torch", "gpus", "ports", ...
    message: str
    fix: str
    host_index: int | None = None  # None: the cluster as a whole


# ---- comparing hosts -------------------------------------------------------------------------


def compare_hosts(
    config: ClusterConfig,
    fps: Sequence[HostFingerprint | None],
    files: Sequence[list[tuple[str, int]]],
    local_orbit: str,
) -> list[Finding]:
    """`local_orbit`: this machine's orbit_build(), which every host must run."""
    findings = check_devices(config) + check_software(fps, local_orbit)
    for i, fp in enumerate(fps):
        if fp is not None:
            host = config.hosts[i]
            findings += check_gpus(host, fp, i) + check_storage(fp, files[i], i)
            findings += check_clock(fp, i)
    return findings


def check_devices(config: ClusterConfig) -> list[Finding]:
    devices = sorted({h.device for h in config.hosts})
    if len(devices) == 1:
        return []
    return [Finding(
        HARD, "device", f"hosts mix device = {' and '.join(devices)}; one TP group runs on one "
        "backend (NCCL on CUDA, gloo on CPU).", "set the same device on every host.",
    )]  # fmt: skip


def check_package(config: ClusterConfig, tp_size: int) -> list[Finding]:
    """The hosts must place one rank per TP shard of the package."""
    if config.world_size == tp_size:
        return []
    counts = ", ".join(f"hosts[{i}]: {h.num_ranks}" for i, h in enumerate(config.hosts))
    return [Finding(
        HARD, "gpus", f"the hosts place {config.world_size} ranks ({counts}) but the package has "
        f"{tp_size} shards (tp_size {tp_size}); every rank needs exactly one.",
        f"list {tp_size} GPUs in total across the hosts' gpus, or prepare the package with "
        f"--tp {config.world_size}.",
    )]  # fmt: skip


def check_software(fps: Sequence[HostFingerprint | None], local_orbit: str) -> list[Finding]:
    """Missing Orbit/torch, and versions that differ between hosts (or, for Orbit, from this
    machine's `local_orbit`, release and code: its frontend speaks the wire protocol with the
    ranks)."""
    findings = []
    for i, fp in enumerate(fps):
        for name in ("orbit", "torch"):
            if fp is not None and getattr(fp, name) is None:
                reason = fp.errors.get(name, "not importable")
                findings.append(Finding(
                    HARD, name, f"the host's python cannot import {name} ({reason}).",
                    f"install {name} for hosts.python, or set hosts.env PYTHONPATH.", i,
                ))  # fmt: skip
    for key, label, severity, fix in VERSION_RULES:
        want = local_orbit if key == "orbit" else None
        findings += _differ(fps, key, label, severity, fix, want)
    return findings


# (fingerprint value, name, severity when hosts differ, fix). Python's minor version decides
# what wheels and bytecode work; a different patch release only earns a warning.
VERSION_RULES = (
    ("orbit", "Orbit", HARD, "install this machine's Orbit here: same commit, no local edits"),
    ("python_minor", "Python", HARD, "point hosts.python at a Python {want}"),
    ("python", "Python", WARN, "use the same Python release ({want}) everywhere"),
    ("torch", "torch", HARD, "install torch {want} here (the same build)"),
    ("nccl", "NCCL", HARD, "install the torch build that ships NCCL {want} here"),
    ("cuda_runtime", "CUDA runtime", WARN, "install the torch build for CUDA {want}"),
    ("driver", "NVIDIA driver", WARN, "install NVIDIA driver {want} here"),
)


def _value(fp: HostFingerprint, key: str) -> str | None:
    if key == "python_minor":
        return ".".join(fp.python.split(".")[:2])
    if key == "orbit":
        return fp.orbit_build
    return getattr(fp, key)


def _differ(
    fps: Sequence[HostFingerprint | None], key: str, label: str, severity: str, fix: str,
    want: str | None,
) -> list[Finding]:  # fmt: skip
    """A finding for each host whose value differs from `want` (None: the most common value,
    ties going to the earlier host). Hosts without the value are skipped."""
    values = {i: _value(fp, key) for i, fp in enumerate(fps) if fp is not None}
    values = {i: v for i, v in values.items() if v is not None}
    if want is None and len(set(values.values())) > 1:
        counts = collections.Counter(values.values())
        want = max(counts, key=lambda v: (counts[v], -min(i for i in values if values[i] == v)))
    where = "on this machine (the frontend)" if key == "orbit" else "on the other hosts"
    column = key.removesuffix("_minor")
    return [
        Finding(
            severity, column, f"{label} {v} here, {want} {where}.", fix.format(want=want) + ".", i
        )
        for i, v in sorted(values.items())
        if want is not None and v != want
    ]


def check_gpus(host: HostConfig, fp: HostFingerprint, i: int) -> list[Finding]:
    if host.device != "cuda":
        return []
    need = max(host.gpus) + 1
    if fp.gpu_count < need:
        asks = f"cluster.toml asks for GPUs {list(host.gpus)}, torch sees {fp.gpu_count}"
        if fp.gpus:
            fix = (
                f"nvidia-smi lists {len(fp.gpus)} GPU(s) but torch {fp.torch} cannot use "
                "them: install a CUDA build of torch, or lower hosts.gpus."
            )
        elif fp.gpu_count == 0:
            fix = 'the host has no usable NVIDIA GPU: use a GPU host, or set device = "cpu".'
        else:
            fix = f"list at most {fp.gpu_count} GPUs (indices below {fp.gpu_count})."
        return [Finding(HARD, "gpus", asks + ".", fix, i)]
    return _busy_gpus(host, fp, i)


def _busy_gpus(host: HostConfig, fp: HostFingerprint, i: int) -> list[Finding]:
    findings = []
    for g in fp.gpus:
        if g.index in host.gpus and g.free_mib < LOW_GPU_FREE_FRACTION * g.total_mib:
            findings.append(Finding(
                WARN, "gpus", f"GPU {g.index} has {g.free_mib} of {g.total_mib} MiB free.",
                "another process holds it (see nvidia-smi): stop it or list other GPUs.", i,
            ))  # fmt: skip
    return findings


def check_storage(fp: HostFingerprint, files: list[tuple[str, int]], i: int) -> list[Finding]:
    missing = set(fp.package_missing)
    to_push = sum(size for path, size in files if path in missing)
    findings = []
    if missing:
        what = "is not on the host" if len(missing) == len(files) else "is partly on the host"
        findings.append(Finding(
            WARN, "package", f"the package {what} ({_size(to_push)} to send).",
            "`orbit up` pushes it.", i,
        ))  # fmt: skip
    free = fp.disk_free_bytes
    if free < to_push:
        findings.append(Finding(
            HARD, "disk", f"{_size(free)} free in {fp.workdir}, the push needs {_size(to_push)}.",
            "free space there, or set hosts.workdir to a larger disk.", i,
        ))  # fmt: skip
    elif free - to_push < LOW_DISK_BYTES:
        findings.append(Finding(
            WARN, "disk", f"only {_size(free - to_push)} would be left free in {fp.workdir}.",
            "free space there: rank logs grow in it.", i,
        ))  # fmt: skip
    return findings


def check_clock(fp: HostFingerprint, i: int) -> list[Finding]:
    offset = fp.clock_offset_s
    if abs(offset) <= CLOCK_OFFSET_LIMIT_S:
        return []
    side = "ahead of" if offset > 0 else "behind"
    return [Finding(
        WARN, "clock", f"the clock is {abs(offset):.1f} s {side} this machine's.",
        "synchronise clocks (chrony or systemd-timesyncd): logs of different hosts are "
        "compared by time.", i,
    )]  # fmt: skip


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""


# ---- the interface for collectives -----------------------------------------------------------


def unsuitable(interface: Interface) -> str | None:
    """Why collectives should not be pinned to this interface, or None."""
    if interface.loopback:
        return "loopback"
    if interface.name.startswith(VIRTUAL_PREFIXES):
        return "a container, VPN or overlay interface"
    if interface.kind is not None:
        return f"a {interface.kind}"
    return None


def choose_interface(
    config: ClusterConfig, i: int, fp: HostFingerprint | None
) -> tuple[str | None, list[Finding]]:
    """The interface host i's ranks are pinned to: hosts.nccl_interface when set (it must exist
    with an address), else the one every route to the peers leaves through, when suitable."""
    host = config.hosts[i]
    if fp is None:
        return host.nccl_interface, []
    if host.nccl_interface:
        return host.nccl_interface, _check_pinned(host, fp, i)
    if not fp.routes:
        return None, []  # one host: collectives stay on it
    return _routed_interface(fp, i)


def _check_pinned(host: HostConfig, fp: HostFingerprint, i: int) -> list[Finding]:
    interface = fp.interface(host.nccl_interface)
    names = ", ".join(x.name for x in fp.interfaces)
    if interface is None:
        return [Finding(
            HARD, "interface", f"nccl_interface {host.nccl_interface!r} is not an interface of "
            f"this host (it has {names}).", "set hosts.nccl_interface to one of them.", i,
        )]  # fmt: skip
    if not interface.up or not interface.addresses:
        return [Finding(
            HARD, "interface", f"nccl_interface {host.nccl_interface!r} is down or has no "
            "address.", "bring it up, or pin another interface.", i,
        )]  # fmt: skip
    return []


def _routed_interface(fp: HostFingerprint, i: int) -> tuple[str | None, list[Finding]]:
    broken = [r for r in fp.routes if r.error or not r.source]
    if broken:
        return None, [Finding(
            HARD, "interface", f"no route to {', '.join(r.peer for r in broken)} "
            f"({broken[0].error}).", "check the host's network and the addresses in "
            "cluster.toml.", i,
        )]  # fmt: skip
    used = {fp.interface_with(r.source) for r in fp.routes}
    if None in used or len(used) != 1:
        names = ", ".join(sorted(x.name for x in used if x)) or "unknown interfaces"
        return None, [_no_pin(i, f"the peers are reached through {names}")]
    (interface,) = used
    reason = unsuitable(interface)
    if reason is None or (interface.loopback and _all_loopback(fp)):
        return interface.name, []  # loopback is right when every "host" is this machine
    return None, [_no_pin(i, f"the peers are reached through {interface.name}, {reason}")]


def _all_loopback(fp: HostFingerprint) -> bool:
    return all((r.address or "").startswith(("127.", "::1")) for r in fp.routes)


def _no_pin(i: int, why: str) -> Finding:
    return Finding(
        WARN, "interface", f"{why}; NCCL/gloo are left to pick an interface themselves.",
        "set hosts.nccl_interface to the interface of the cluster network.", i,
    )  # fmt: skip
