"""The preflight of `orbit up` and the whole of `orbit doctor`: fingerprint every host, compare
them (orbit/checks.py), pick the network interface for collectives, and check the ports ranks
need (orbit/netcheck.py).

Every problem is a Finding with the fix. HARD findings are ones that make ranks fail or hang
(different torch/NCCL/Python/Orbit between hosts, too few GPUs, a pinned interface that does not
exist, a port that cannot be reached, an unreachable host): `orbit up` refuses to start on them
unless --force. WARN findings are worth knowing but do not stop a bring-up (a package that is
not there yet, low disk, a clock off by more than a second, no suitable interface to pin).
docs/doctor.md lists every check and what to do when it fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import asyncssh

import orbit
from orbit.checks import HARD, WARN, Finding, choose_interface, compare_hosts
from orbit.cluster_config import ClusterConfig, HostConfig
from orbit.cluster_launch import FrontendBindError, pick_frontend_port
from orbit.cluster_remote import free_remote_port
from orbit.fingerprint import (
    PROBE_TIMEOUT_S,
    FingerprintError,
    HostFingerprint,
    fingerprint_host,
)
from orbit.netcheck import Target, Unreachable, check_ports
from orbit.push import RemoteLayout, files_to_push
from orbit.ssh import ClusterError
from runtime.package import Package


class PreflightError(ClusterError):
    """`orbit up` found hard problems (listed in the message) and was not given --force."""


@dataclass(frozen=True)
class Ports:
    """The ports that were checked and that `orbit up` then uses."""

    frontend_port: int
    dist_port: int


@dataclass(frozen=True)
class PreflightReport:
    hosts: tuple[HostConfig, ...]
    # None where the host could not be reached or probed (a HARD finding says why).
    fingerprints: tuple[HostFingerprint | None, ...]
    # Per host, what ranks get as NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (None: not pinned).
    interfaces: tuple[str | None, ...]
    ports: Ports | None  # None when the port check could not run
    findings: tuple[Finding, ...]
    local_orbit: str

    @property
    def hard(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == HARD]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARN]


def host_name(hosts: Sequence[HostConfig], index: int | None) -> str:
    return "cluster" if index is None else f"hosts[{index}] {hosts[index].label}"


def refusal(report: PreflightReport) -> PreflightError:
    lines = [
        f"- {host_name(report.hosts, f.host_index)}: {f.message}"
        + (f" Fix: {f.fix}" if f.fix else "")
        for f in report.hard
    ]
    return PreflightError(
        f"preflight found {len(lines)} problem(s) that would make ranks fail or hang:\n"
        + "\n".join(lines)
        + "\nFix them, or pass --force to start anyway (`orbit doctor cluster.toml` shows all)."
    )


# ---- running it ------------------------------------------------------------------------------


async def preflight(
    conns: Sequence[asyncssh.SSHClientConnection | ClusterError],
    config: ClusterConfig,
    pkg: Package,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
) -> PreflightReport:
    """Fingerprint every reachable host in parallel, compare, choose interfaces, check ports.
    `conns` holds, per host, its connection or the error that kept it from connecting."""
    files = [package_files(config, pkg, i) for i in range(len(config.hosts))]
    probes = await asyncio.gather(*(
        _fingerprint(c, h, [p for p, _ in files[i]], peers(config, i), probe_timeout_s)
        for i, (c, h) in enumerate(zip(conns, config.hosts))
    ))  # fmt: skip
    fps = tuple(p if isinstance(p, HostFingerprint) else None for p in probes)
    findings = [
        Finding(HARD, "python" if isinstance(p, FingerprintError) else "ssh", str(p), "", i)
        for i, p in enumerate(probes)
        if isinstance(p, ClusterError)
    ]
    findings += compare_hosts(config, fps, files)
    interfaces = []
    for i in range(len(config.hosts)):
        chosen, found = choose_interface(config, i, fps[i])
        interfaces.append(chosen)
        findings += found
    ports, found = await _check_ports(conns, config, fps)
    return PreflightReport(
        config.hosts, fps, tuple(interfaces), ports, tuple(findings + found), orbit.__version__
    )


async def _fingerprint(
    conn: asyncssh.SSHClientConnection | ClusterError,
    host: HostConfig,
    files: list[str],
    peer_addresses: list[str],
    timeout_s: float,
) -> HostFingerprint | ClusterError:
    if isinstance(conn, ClusterError):
        return conn
    try:
        return await fingerprint_host(conn, host, files, peer_addresses, timeout_s)
    except ClusterError as e:
        return e


def package_files(config: ClusterConfig, pkg: Package, index: int) -> list[tuple[str, int]]:
    """(path relative to the workdir, size) of what the host's ranks need from the package."""
    root = RemoteLayout("").package_dir(pkg.digest)  # "packages/<digest>"
    pushed = files_to_push(pkg.root, config.ranks_on(index))
    return [(f"{root}/{f.path}", f.size_bytes) for f in pushed]


def peers(config: ClusterConfig, index: int) -> list[str]:
    """The other hosts' addresses (one machine may appear twice, with different workdirs)."""
    own = config.hosts[index].address
    return list(dict.fromkeys(h.address for h in config.hosts if h.address != own))


async def _check_ports(
    conns: Sequence[asyncssh.SSHClientConnection | ClusterError],
    config: ClusterConfig,
    fps: Sequence[HostFingerprint | None],
) -> tuple[Ports | None, list[Finding]]:
    """Pick the two ports and check them from every host whose python answered the probe (a
    host that did not is already a HARD finding, and its python may hang)."""
    clients = {i: (c, h) for i, (c, h, fp) in enumerate(zip(conns, config.hosts, fps)) if fp}
    if 0 not in clients:
        return None, []
    try:
        frontend_port = pick_frontend_port(config.frontend)
    except FrontendBindError as e:
        return None, [Finding(HARD, "ports", str(e), "see the message.")]
    dist_port = await free_remote_port(
        clients[0][0], config.hosts[0].python, config.frontend.port_range, frontend_port
    )
    frontend = Target("the frontend", config.frontend.address, frontend_port)
    dist = Target("torch.distributed (rank 0's host)", config.hosts[0].address, dist_port)
    failures = await check_ports(clients[0], clients, frontend, dist)
    return Ports(frontend_port, dist_port), [_port_finding(config, u) for u in failures]


def _port_finding(config: ClusterConfig, u: Unreachable) -> Finding:
    lo, hi = config.frontend.port_range
    if u.listen_error:
        return Finding(
            HARD, "ports", f"cannot listen on port {u.target.port} for {u.target.what}: "
            f"{u.reason}.", "another process may have taken it; run again.", u.host_index,
        )  # fmt: skip
    fix = (
        f"open frontend.port_range [{lo}, {hi}] between the hosts and this machine in the "
        f"firewall, and check that {u.target.address} is this machine's address on a network "
        "every host reaches (frontend.address)."
        if u.target.what == "the frontend"
        else f"open frontend.port_range [{lo}, {hi}] on {u.target.address} to the other hosts."
    )
    message = f"cannot connect to {u.target.what} at {u.target.endpoint}: {u.reason}."
    return Finding(HARD, "ports", message, fix, u.host_index)
