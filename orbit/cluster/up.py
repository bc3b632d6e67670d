"""`orbit up cluster.toml`: push the package, start one rank per GPU on every host, wait until
all are ready, record the cluster. docs/cluster.md ("orbit up") describes it for users.

How bring-up works:
1. Read cluster.toml and the local package; the hosts must hold exactly tp_size ranks.
2. Connect to every host in parallel (host keys checked; see orbit/cluster/ssh.py).
2b. Preflight (orbit/cluster/preflight.py): fingerprint every host, compare them, choose the interface
   for collectives, check that the frontend and torch.distributed ports are reachable from
   every host. A HARD finding stops here unless --force.
3. If a cluster is recorded for this cluster.toml with the same package and launch settings and
   every rank alive, stop here (no-op).
4. Push each host its ranks' files in parallel (orbit/cluster/push.py verifies every blob on the host).
   Ranks of an earlier bring-up keep running meanwhile: the package lands in its own
   content-addressed folder, and blobs are never changed in place. Only once every host has
   its files are they stopped, so a replacement is down for the stop and start, not the push;
   a push that fails leaves them running and recorded.
5. Use the ports the preflight checked (the frontend port free here, the torch.distributed
   port free on rank 0's host, both from frontend.port_range), bind the frontend endpoint,
   start the ranks detached with the chosen interface pinned.
6. Wait until every rank has sent Ready, showing the phase each reports, polling the rank
   processes over SSH: a rank that exits fails bring-up at once with its phase and log tail;
   one still not ready at the deadline fails it too, naming the phase it is stuck in. Ready
   carries each rank's collectives check, which is printed and judged.
7. On success write the state record and release the endpoint for `orbit serve --cluster`. On
   any failure, or Ctrl-C, stop every rank started in step 5 (by pid file), then raise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from orbit.cluster.config import ClusterConfig, HostConfig, load_cluster_config
from orbit.cluster.fingerprint import PROBE_TIMEOUT_S
from orbit.cluster.launch import (
    FrontendBindError,
    RankStartError,
    Started,
    bind_frontend,
    pick_frontend_port,
    rank_launch,
    start_host,
    stop_started,
    wait_ready,
)
from orbit.cluster.ops import all_alive, stop_cluster
from orbit.cluster.preflight import Ports, PreflightReport, preflight, refusal, trusted_keys
from orbit.cluster.push import PushResult, push_package
from orbit.cluster.readiness import BringUpLink, collectives_text, collectives_warnings
from orbit.cluster.remote import (
    STOP_GRACE_S,
    HostPool,
    RankLaunch,
    free_remote_port,
    run_all,
)
from orbit.cluster.ssh import DEFAULT_CONNECT_TIMEOUT_S
from orbit.cluster.state import (
    ClusterState,
    HostRecord,
    RankRecord,
    cluster_lock,
    curve_key_dir,
    load_state,
    remove_state,
    save_state,
)
from runtime.curve import ServerKeys, create_keys
from runtime.package import Package, check_draft, open_package

__all__ = ["FrontendBindError", "RankStartError", "UpEvents", "UpOptions", "UpResult", "up"]


@dataclass(frozen=True)
class UpOptions:
    accept_new_host_keys: bool = False
    # Bounds connecting (at most DEFAULT_CONNECT_TIMEOUT_S per host) and, after the push, the
    # wait for every rank's Ready. The push has no overall deadline: cluster.toml's [ssh]
    # bounds each of its requests and gives up on a host that falls silent.
    timeout_s: float = 600.0
    kv_pages: int = 0  # 0: ranks size their KV cache from memory (or kv_cache_mb on CPU)
    kv_cache_mb: int = 512
    kv_dtype: str = "auto"  # the ranks' KV pages: auto, fp8 or model
    stop_grace_s: float = STOP_GRACE_S
    # Start even when the preflight finds HARD problems (they are still reported).
    force: bool = False
    # Each rank's limit on joining the TP group and on the collectives check (its watchdog).
    join_timeout_s: float = 120.0
    log_level: str = "warning"  # the ranks' logging level (orbit up --log-level)
    draft_package: Path | None = None  # pushed to rank 0's host, which drafts with it
    exact_verification: bool = False  # orbit up --exact-verification (ranks/config.py)


class UpEvents:
    """Progress of a bring-up. The CLI draws these with rich; the defaults ignore them."""

    def push_started(self, host_index: int, host_label: str) -> None: ...

    def push_progress(self, host_index: int, done_bytes: int, total_bytes: int) -> None: ...

    def pushed(self, host_index: int, result: PushResult) -> None: ...

    def preflight(self, report: PreflightReport) -> None: ...

    def rank_state(self, rank: int, host_label: str, state: str, detail: str = "") -> None: ...

    def note(self, text: str) -> None: ...


@dataclass(frozen=True)
class UpResult:
    state: ClusterState
    already_running: bool  # nothing was started: the recorded ranks were all alive
    replaced: bool  # ranks of an earlier bring-up were stopped first


async def up(
    config_path: Path | str, opts: UpOptions = UpOptions(), events: UpEvents | None = None
) -> UpResult:
    """Bring the cluster of `config_path` up, or find it already up; raises ClusterError
    subclasses (naming the host, and the rank where one failed), ClusterConfigError or
    PackageError. Nothing this call started is left running when it raises."""
    events = events or UpEvents()
    config = load_cluster_config(config_path)
    pkg = open_package(config.package, trusted_keys=trusted_keys(config))
    config.check_tp_size(pkg.tp_size)
    draft = None
    if opts.draft_package is not None:
        draft = open_package(opts.draft_package, trusted_keys=trusted_keys(config))
        check_draft(pkg, draft)
    _warn_if_unreachable_frontend(config, events)
    with cluster_lock(config_path):
        return await _up(Path(config_path), config, pkg, draft, opts, events)


async def _up(
    config_path: Path,
    config: ClusterConfig,
    pkg: Package,
    draft: Package | None,
    opts: UpOptions,
    events: UpEvents,
) -> UpResult:
    connect_timeout_s = min(opts.timeout_s, DEFAULT_CONNECT_TIMEOUT_S)
    async with HostPool(opts.accept_new_host_keys, connect_timeout_s, config.ssh) as pool:
        conns = await pool.get_all(config.hosts)
        report = await preflight(conns, config, pkg, min(opts.timeout_s, PROBE_TIMEOUT_S))
        events.preflight(report)
        if report.hard and not opts.force:
            raise refusal(report)
        fingerprint = launch_fingerprint(config, opts, report.interfaces, draft)
        previous = load_state(config_path)
        if previous is not None and await _still_up(pool, previous, pkg.digest, fingerprint):
            return UpResult(previous, already_running=True, replaced=False)
        pushed = await _push_all(conns, config, pkg, events)  # the old ranks serve meanwhile
        draft_dir = ""
        if draft is not None:  # rank 0's host alone drafts (ranks/drafting.py)
            stall_s = config.ssh.stall_timeout_s
            draft_dir = (await push_package(conns[0], draft.root, config.hosts[0].workdir, [0],
                                            None, stall_s)).remote_dir  # fmt: skip
        if previous is not None:
            events.note("stopping the ranks of the previous bring-up")
            await stop_cluster(pool, previous, opts.stop_grace_s)
            remove_state(config_path)  # they are gone, whatever happens next
        launch = _Launch(config, conns, pushed, pkg, fingerprint, report, draft_dir)
        state = await _start(config_path, launch, opts, events)
    return UpResult(state, already_running=False, replaced=previous is not None)


async def _still_up(pool: HostPool, previous: ClusterState, digest: str, fingerprint: str) -> bool:
    """Whether the recorded ranks run this package with these launch settings, all alive."""
    same = (previous.package_digest, previous.launch_fingerprint) == (digest, fingerprint)
    return same and await all_alive(pool, previous)


def _warn_if_unreachable_frontend(config: ClusterConfig, events: UpEvents) -> None:
    loopback = ("127.", "localhost", "::1")
    if not config.frontend.address.startswith(loopback):
        return
    remote = [h.address for h in config.hosts if not h.address.startswith(loopback)]
    if remote:
        events.note(
            f"warning: frontend.address is {config.frontend.address}, which ranks on "
            f"{', '.join(remote)} cannot reach unless they are this machine; set it to this "
            "machine's address on the cluster network."
        )


def launch_fingerprint(
    config: ClusterConfig,
    opts: UpOptions,
    interfaces: tuple[str | None, ...] = (),
    draft: Package | None = None,
) -> str:
    """A hash of every setting that changes how ranks are started, including the interfaces
    the preflight chose for collectives and the draft package (its digest)."""
    hosts = [
        [
            h.address,
            h.ssh_port,
            h.user,
            h.workdir,
            list(h.gpus),
            h.python,
            h.nccl_interface,
            h.device,
            sorted(h.env.items()),
        ]
        for h in config.hosts
    ]
    frontend = [config.frontend.address, list(config.frontend.port_range)]
    # The log level, KV dtype and exact verification count only when set: clusters brought up
    # before they existed keep their fingerprint.
    extra = [opts.log_level] if opts.log_level != "warning" else []
    extra += [opts.kv_dtype] if opts.kv_dtype != "auto" else []
    extra += ["exact-verification"] if opts.exact_verification else []
    extra += [["draft", draft.digest]] if draft is not None else []
    data = json.dumps([hosts, frontend, opts.kv_pages, opts.kv_cache_mb, list(interfaces), *extra])
    return hashlib.sha256(data.encode()).hexdigest()


async def _push_all(
    conns: list[asyncssh.SSHClientConnection],
    config: ClusterConfig,
    pkg: Package,
    events: UpEvents,
) -> list[PushResult]:
    async def one(i: int) -> PushResult:
        def progress(done_bytes: int, total_bytes: int) -> None:
            events.push_progress(i, done_bytes, total_bytes)

        host = config.hosts[i]
        events.push_started(i, host.label)
        stall_s = config.ssh.stall_timeout_s
        result = await push_package(
            conns[i], pkg.root, host.workdir, config.ranks_on(i), progress, stall_s
        )
        events.pushed(i, result)
        return result

    return await run_all(one(i) for i in range(len(config.hosts)))


@dataclass(frozen=True)
class _Launch:
    """What step 5 starts from: the hosts, what was pushed, and what the preflight chose."""

    config: ClusterConfig
    conns: list[asyncssh.SSHClientConnection]
    pushed: list[PushResult]
    pkg: Package
    fingerprint: str
    report: PreflightReport
    draft_dir: str = ""  # the draft package on rank 0's host; "": none


async def _ports(launch: _Launch) -> Ports:
    """The ports the preflight checked; picked here, unchecked, when it could not (--force)."""
    if launch.report.ports is not None:
        return launch.report.ports
    config = launch.config
    frontend_port = pick_frontend_port(config.frontend)
    dist_port = await free_remote_port(
        launch.conns[0], config.hosts[0].python, config.frontend.port_range, frontend_port
    )
    return Ports(frontend_port, dist_port)


async def _start(
    config_path: Path, launch: _Launch, opts: UpOptions, events: UpEvents
) -> ClusterState:
    """Steps 5 to 7 of the bring-up; returns the recorded state."""
    config, conns, pkg = launch.config, launch.conns, launch.pkg
    ports = await _ports(launch)
    keys = create_keys(curve_key_dir(config_path), pkg.tp_size)  # fresh per bring-up
    if config.require_signature:  # ranks check the signature themselves, with these keys
        for i, key in enumerate(config.trusted_keys):
            shutil.copyfile(key, keys / f"trusted-{i}.pub")
    state = ClusterState(
        config_path=str(config_path.absolute()),
        package_path=str(pkg.root.absolute()),
        package_digest=pkg.digest,
        launch_fingerprint=launch.fingerprint,
        tp_size=pkg.tp_size,
        frontend_address=config.frontend.address,
        frontend_port=ports.frontend_port,
        dist_init=f"tcp://{config.hosts[0].address}:{ports.dist_port}",
        started_at=time.time(),
        curve_dir=str(keys),
        hosts=tuple(_host_record(i, h, r, pkg.digest) for i, (h, r) in
                    enumerate(zip(config.hosts, launch.pushed))),
        ranks=(),
    )  # fmt: skip
    launches = _launches(config, state, opts, launch.report.interfaces, launch.draft_dir)
    started = [
        Started(_rank_record(config, spec), state.hosts[i], conns[i])
        for i, host_launches in enumerate(launches)
        for spec in host_launches
    ]
    link = bind_frontend(
        state.tp_size, state.frontend_address, ports.frontend_port, ServerKeys.load(keys)
    )
    link.start()
    try:
        stall_s = config.ssh.stall_timeout_s
        found = await run_all(
            start_host(conns[h.index], h, launches[h.index], keys, events.rank_state, stall_s)
            for h in state.hosts
        )
        await wait_ready(link, started, pkg.digest, opts.timeout_s, events.rank_state)
        _report_collectives(link, events)
        pids = {rank: pid for host_pids in found for rank, pid in host_pids.items()}
        ranks = tuple(dataclasses.replace(s.record, pid=pids[s.record.rank]) for s in started)
        state = dataclasses.replace(state, ranks=ranks, started_at=time.time())
        save_state(state)
        return state
    except BaseException as e:
        await stop_started(started, opts.stop_grace_s, e)
        shutil.rmtree(keys, ignore_errors=True)
        raise
    finally:
        link.close()


def _report_collectives(link: BringUpLink, events: UpEvents) -> None:
    readies = [r.ready for r in link.ranks if r.ready is not None]
    summary = collectives_text(readies)
    for line in ([summary] if summary else []) + collectives_warnings(readies):
        events.note(line)


def _host_record(index: int, host: HostConfig, pushed: PushResult, digest: str) -> HostRecord:
    workdir = posixpath.dirname(posixpath.dirname(pushed.remote_dir))  # {workdir}/packages/<d>
    return HostRecord(
        index=index,
        address=host.address,
        ssh_port=host.ssh_port,
        user=host.user,
        identity_file=str(host.identity_file) if host.identity_file else None,
        known_hosts=str(host.known_hosts),
        workdir=workdir,
        package_dir=pushed.remote_dir,
        run_dir=posixpath.join(workdir, "run", digest[:12]),
    )


def _launches(
    config: ClusterConfig,
    state: ClusterState,
    opts: UpOptions,
    interfaces: tuple[str | None, ...],
    draft_dir: str = "",
) -> list[list[RankLaunch]]:
    """Per host, in rank order, how each of its ranks is started."""
    launches: list[list[RankLaunch]] = [[] for _ in config.hosts]
    for p in config.rank_placements():
        host = config.hosts[p.host_index]
        launches[p.host_index].append(rank_launch(
            host, state.hosts[p.host_index], state, p.rank, p.local_gpu_index, opts.kv_pages,
            opts.kv_cache_mb, interfaces[p.host_index], opts.join_timeout_s,
            len(config.trusted_keys) if config.require_signature else 0, opts.log_level,
            opts.kv_dtype, draft_dir if p.rank == 0 else "", opts.exact_verification,
        ))  # fmt: skip
    return launches


def _rank_record(config: ClusterConfig, launch: RankLaunch) -> RankRecord:
    placement = config.rank_placements()[launch.rank]
    return RankRecord(
        launch.rank, placement.host_index, placement.local_gpu_index, 0, launch.pid_file,
        launch.log_file,
    )  # fmt: skip
