"""`orbit doctor cluster.toml`: the preflight of `orbit up` on its own, shown as tables.

doctor() connects to every host it can (an unreachable host is a finding, not an error), runs
orbit/cluster/preflight.py and returns its report; the table functions turn a report into rich tables
for the CLI (which prints them) and for `orbit up` (which shows them when something is wrong).
Nothing is started and nothing is written on the hosts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import asyncssh
from rich.table import Table
from rich.text import Text

from orbit.cluster.checks import HARD, Finding
from orbit.cluster.config import ClusterConfig, HostConfig, load_cluster_config
from orbit.cluster.fingerprint import PROBE_TIMEOUT_S, HostFingerprint
from orbit.cluster.preflight import PreflightReport, host_name, preflight, trusted_keys
from orbit.cluster.remote import HostPool
from orbit.cluster.ssh import DEFAULT_CONNECT_TIMEOUT_S, ClusterError
from runtime.package import PackageError, open_package

# The fingerprint table's columns: (title, the Finding.check values that mark its cell).
COLUMNS = (
    ("host", ("ssh",)),
    ("orbit", ("orbit",)),
    ("python", ("python",)),
    ("torch", ("torch",)),
    ("cuda", ("cuda_runtime",)),
    ("nccl", ("nccl",)),
    ("driver", ("driver",)),
    ("gpus", ("gpus", "device")),
    ("package", ("package",)),
    ("disk free", ("disk",)),
    ("clock", ("clock",)),
    ("interface", ("interface",)),
)
STYLE = {HARD: "bold red", "warn": "yellow"}


@dataclass(frozen=True)
class DoctorOptions:
    accept_new_host_keys: bool = False
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    probe_timeout_s: float = PROBE_TIMEOUT_S


async def doctor(config_path: Path | str, opts: DoctorOptions = DoctorOptions()) -> PreflightReport:
    """Check every host of cluster.toml; raises ClusterConfigError or PackageError for a file
    or package that cannot be read, and reports everything else as findings: the hosts, and
    a package that does not fit cluster.toml (shards vs ranks, a signature it requires)."""
    config = load_cluster_config(config_path)
    pkg = open_package(config.package)
    async with HostPool(opts.accept_new_host_keys, opts.connect_timeout_s, config.ssh) as pool:
        conns = await asyncio.gather(*(_connect(pool, h) for h in config.hosts))
        report = await preflight(conns, config, pkg, opts.probe_timeout_s)
    signature = check_signature(config)
    return dataclasses.replace(report, findings=(*signature, *report.findings))


def check_signature(config: ClusterConfig) -> list[Finding]:
    """With require_signature, whether the package is signed by one of trusted_keys (as
    `orbit up` and every rank check it)."""
    if not config.require_signature:
        return []
    try:
        open_package(config.package, verify_tokenizer=False, trusted_keys=trusted_keys(config))
    except PackageError as e:
        return [Finding(
            HARD, "package", str(e), "sign the package (`orbit prepare --sign KEY`) with a key "
            "whose public half is in cluster.toml's trusted_keys, or add its signer's there.",
        )]  # fmt: skip
    return []


async def _connect(pool: HostPool, host: HostConfig) -> asyncssh.SSHClientConnection | ClusterError:
    try:
        return await pool.get(host)
    except ClusterError as e:
        return e


# ---- tables ----------------------------------------------------------------------------------


def fingerprint_table(report: PreflightReport) -> Table:
    """One row per host; a cell with a finding is red (hard) or yellow (warning)."""
    table = Table(title="hosts", title_justify="left")
    for title, _ in COLUMNS:
        table.add_column(title, no_wrap=True)
    for i, fp in enumerate(report.fingerprints):
        found = [f for f in report.findings if f.host_index == i]
        cells = _cells(report, i, fp)
        table.add_row(*(_mark(cell, checks, found) for cell, (_, checks) in zip(cells, COLUMNS)))
    return table


def _cells(report: PreflightReport, i: int, fp: HostFingerprint | None) -> list[str]:
    host = report.hosts[i]
    if fp is None:
        return [host.label] + ["?"] * (len(COLUMNS) - 1)
    gpus = f"{fp.gpu_count}" + (f" x {fp.gpu_model}" if fp.gpu_model else "")
    if host.device == "cuda":
        gpus += f" (wants {len(host.gpus)})"
    free = ", ".join(f"{g.free_mib} MiB" for g in fp.gpus if g.index in host.gpus)
    return [
        f"{host.label} ({fp.hostname})",
        fp.orbit_build or "missing",
        fp.python,
        fp.torch or "missing",
        fp.cuda_runtime or "-",
        fp.nccl or "-",
        fp.driver or "-",
        gpus + (f", free {free}" if free else "") if host.device == "cuda" else "cpu",
        "missing" if fp.package_missing else "present",
        f"{fp.disk_free_bytes / (1 << 30):.1f} GiB",
        f"{fp.clock_offset_s:+.2f} s",
        _interface_cell(report, i, fp),
    ]


def _interface_cell(report: PreflightReport, i: int, fp: HostFingerprint) -> str:
    chosen = report.interfaces[i]
    if chosen is None:
        return "not pinned"
    iface = fp.interface(chosen)
    address = next((a for a in iface.addresses if ":" not in a), "") if iface else ""
    how = "pinned" if report.hosts[i].nccl_interface else "chosen"
    return f"{chosen} {address} ({how})".replace("  ", " ")


def _mark(cell: str, checks: tuple[str, ...], found: list[Finding]) -> Text:
    severities = {f.severity for f in found if f.check in checks}
    style = STYLE[HARD] if HARD in severities else STYLE["warn"] if severities else ""
    return Text(cell, style=style)


def routes_table(report: PreflightReport) -> Table | None:
    """For every pair of hosts, the address and interface one uses to reach the other."""
    table = Table(title="routes between hosts", title_justify="left")
    for column in ("from", "to", "source address", "interface"):
        table.add_column(column, no_wrap=True)
    for i, fp in enumerate(report.fingerprints):
        for route in fp.routes if fp else ():
            iface = fp.interface_with(route.source) if route.source else None
            table.add_row(
                report.hosts[i].label,
                route.peer,
                route.source or f"[red]{route.error}[/]",
                iface.name if iface else "?",
            )
    return table if table.row_count else None


def findings_table(report: PreflightReport) -> Table | None:
    if not report.findings:
        return None
    table = Table(title="problems", title_justify="left", show_lines=False)
    for column in ("", "where", "problem", "fix"):
        table.add_column(column, overflow="fold")
    order = sorted(report.findings, key=lambda f: (f.severity != HARD, f.host_index or -1))
    for f in order:
        label = Text("HARD" if f.severity == HARD else "warn", style=STYLE[f.severity])
        table.add_row(label, host_name(report.hosts, f.host_index), f.message, f.fix)
    return table


def summary_line(report: PreflightReport) -> str:
    hard, warn = len(report.hard), len(report.warnings)
    if not hard and not warn:
        return f"all {len(report.hosts)} hosts look right."
    return f"{hard} hard problem(s), {warn} warning(s) on {len(report.hosts)} hosts."
