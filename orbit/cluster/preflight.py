"""The preflight of `orbit up` and the whole of `orbit doctor`: fingerprint every host, compare
them (orbit/cluster/checks.py), pick the network interface for collectives, and check the ports ranks
need (orbit/cluster/netcheck.py).

Every problem is a Finding with the fix. HARD findings are ones that make ranks fail or hang
(different torch/NCCL/Python between hosts, an Orbit release or code other than this machine's,
too few GPUs, more or fewer ranks than the package has shards, a pinned interface that does not
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
from orbit.cluster.checks import HARD, WARN, Finding, check_package, choose_interface, compare_hosts
from orbit.cluster.config import ClusterConfig, HostConfig
from orbit.cluster.fingerprint import (
    PROBE_TIMEOUT_S,
    FingerprintError,
    HostFingerprint,
    fingerprint_host,
    orbit_build,
)
from orbit.cluster.fingerprint_probe import code_digest
from orbit.cluster.launch import pick_frontend_port
from orbit.cluster.netcheck import Target, Unreachable, check_ports
from orbit.cluster.push import RemoteLayout, files_to_push
from orbit.cluster.remote import free_remote_port
from orbit.cluster.ssh import ClusterError
from runtime.package import Package, PackageError


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
    local_orbit: str  # this machine's orbit_build(): release and code digest

    @property
    def hard(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == HARD]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARN]


def host_name(hosts: Sequence[HostConfig], index: int | None) -> str:
    return "cluster" if index is None else f"hosts[{index}] {hosts[index].label}"


def trusted_keys(config: ClusterConfig) -> list | None:
    """With require_signature, the public keys the package must be signed by (None: any
    package); a key file that cannot be read is a PackageError naming it."""
    if not config.require_signature:
        return None
    from runtime.signing import SignatureError, load_public_key

    try:
        return [load_public_key(k) for k in config.trusted_keys]
    except SignatureError as e:
        raise PackageError(str(e)) from None


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
    `conns` holds, per host, its connection or the error that kept it from connecting. A
    package that does not fit cluster.toml is a finding too; the rest is checked anyway."""
    files = [package_files(config, pkg, i) for i in range(len(config.hosts))]
    local_orbit = orbit_build(orbit.__version__, code_digest())
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
    findings += check_package(config, pkg.tp_size) + compare_hosts(config, fps, files, local_orbit)
    interfaces = []
    for i in range(len(config.hosts)):
        chosen, found = choose_interface(config, i, fps[i])
        interfaces.append(chosen)
        findings += found
    ports, found = await _check_ports(conns, config, fps)
    return PreflightReport(
        config.hosts, fps, tuple(interfaces), ports, tuple(findings + found), local_orbit
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
    """(path relative to the workdir, size) of what the host's ranks need from the package;
    ranks beyond the package's shards (check_package reports them) need nothing."""
    root = RemoteLayout("").package_dir(pkg.digest)  # "packages/<digest>"
    ranks = [r for r in config.ranks_on(index) if r < pkg.tp_size]
    pushed = files_to_push(pkg.root, ranks)
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
    try:  # a port that cannot be had, or a host lost meanwhile, is a finding like the others
        frontend_port = pick_frontend_port(config.frontend)
        dist_port = await free_remote_port(
            clients[0][0], config.hosts[0].python, config.frontend.port_range, frontend_port
        )
        frontend = Target("the frontend", config.frontend.address, frontend_port)
        dist = Target("torch.distributed (rank 0's host)", config.hosts[0].address, dist_port)
        failures = await check_ports(clients[0], clients, frontend, dist)
    except ClusterError as e:
        return None, [Finding(HARD, "ports", str(e), "see the message.")]
    return Ports(frontend_port, dist_port), [_port_finding(config, u) for u in failures]


def _port_finding(config: ClusterConfig, u: Unreachable) -> Finding:
    lo, hi = config.frontend.port_range
    if u.listen_error:
        fix = "another process may have taken it; run again."
        if "EADDRNOTAVAIL" in u.reason:
            fix = (
                f"hosts[0].address must be that host's own address on the cluster network "
                f"(rank 0's torch.distributed store listens on it), not {u.target.address}."
            )
        return Finding(
            HARD, "ports", f"cannot listen on {u.target.address} port {u.target.port} for "
            f"{u.target.what}: {u.reason}.", fix, u.host_index,
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
