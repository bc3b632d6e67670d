"""What `orbit up` learns from its ranks while they start: the phase each is in, for how long,
and the collectives check each ran before Ready (ranks/startup.py, ranks/collectives.py).

BringUpLink is the frontend endpoint during bring-up: a RankLink that also keeps every rank's
Phase messages. The texts built here name the phase a rank is stuck in, and judge the measured
all-reduce against what its transport should reach.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from orbit.core.rank_link import RankLink
from proto import wire_pb2
from proto.phases import PHASE_TEXT

# What a healthy link of each NCCL transport reaches for one all-reduce: (latency µs, GB/s).
# Orders of magnitude from NCCL's benchmarks (docs/doctor.md); a check slower than SLOW_FACTOR
# times this points at the wrong interface, a fallback to sockets, or a busy GPU. gloo is not
# judged: it runs CPU ranks (development, tests), whose all-reduce time says more about the
# host's CPU load than about its network.
TRANSPORT_COSTS = {
    "nccl/p2p": (10.0, 100.0),
    "nccl/ib": (50.0, 10.0),
    "nccl/socket": (200.0, 1.0),
}
SLOW_FACTOR = 10.0


@dataclass(frozen=True)
class PhaseEntry:
    name: int  # wire_pb2.PhaseName
    elapsed_s: float  # since the rank process started, by its own clock
    received_at: float  # time.monotonic() here


class BringUpLink(RankLink):
    """A RankLink that also records each rank's start-up phases and the phase it failed in."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.phases: dict[int, list[PhaseEntry]] = {r: [] for r in range(self.tp_size)}
        self.failed_in: dict[int, int] = {}  # rank -> the phase its Failure named
        self.failure_messages: dict[int, str] = {}

    def _handle(self, rank: int, kind: str, body) -> None:
        if kind == "phase":
            self.phases[rank].append(PhaseEntry(body.name, body.elapsed_s, time.monotonic()))
        elif kind == "failure":
            self.failure_messages[rank] = body.message
            if body.phase:
                self.failed_in[rank] = body.phase
        super()._handle(rank, kind, body)

    def last_phase(self, rank: int) -> PhaseEntry | None:
        entries = self.phases.get(rank)
        return entries[-1] if entries else None


def phase_name(name: int) -> str:
    return PHASE_TEXT.get(name, "unknown")


def where_text(link: BringUpLink, rank: int) -> str:
    """Where a rank that is not ready got to: "in join group for 8.1 s", "never connected"."""
    if rank in link.failed_in:
        return f"failed in {phase_name(link.failed_in[rank])}"
    last = link.last_phase(rank)
    if last is None:
        return "connected, no phase reported" if link.ranks[rank].hello else "never connected"
    return f"in {phase_name(last.name)} for {time.monotonic() - last.received_at:.1f} s"


def phase_times_text(link: BringUpLink, rank: int, ready: wire_pb2.Ready) -> str:
    """ "5.4 s: start 2.4, connect 0.1, join group 0.3, ..." from the rank's own clock; "start"
    is the interpreter start and imports before the first phase."""
    entries = link.phases.get(rank, [])
    ends = [e.elapsed_s for e in entries[1:]] + [ready.startup_s]
    parts = [f"start {entries[0].elapsed_s:.1f}"] if entries else []
    parts += [f"{phase_name(e.name)} {end - e.elapsed_s:.1f}" for e, end in zip(entries, ends)]
    return f"{ready.startup_s:.1f} s" + (": " + ", ".join(parts) if parts else "")


def collectives_text(readies: list[wire_pb2.Ready]) -> str | None:
    """One line for the whole group: size, transport, interface, and each rank's latency."""
    checked = [r for r in readies if r.allreduce_bytes]
    if not checked:
        return None
    first = checked[0]
    transports = sorted({r.transport for r in checked})
    where = f", interface {first.interface}" if first.interface else ""
    hosts = f" across {first.num_hosts} hosts" if first.num_hosts > 1 else ""
    times = ", ".join(f"rank {r.rank} {r.allreduce_us:.0f} µs" for r in checked)
    return (
        f"collectives check: all-reduce of {_size(first.allreduce_bytes)} over "
        f"{'/'.join(transports)}{hosts}{where}: {times}"
    )


def collectives_warnings(readies: list[wire_pb2.Ready]) -> list[str]:
    warnings = []
    if any(r.transport == "nccl/socket" for r in readies):
        warnings.append(
            "warning: cross-host NCCL traffic runs over plain TCP sockets (no usable "
            "InfiniBand/RoCE device, or NCCL_IB_DISABLE/NCCL_NET in the host env): each "
            "all-reduce costs hundreds of µs; use RDMA networking or keep TP within a host."
        )
    for r in readies:
        expected = expected_us(r.transport, r.allreduce_bytes)
        if expected and r.allreduce_us > SLOW_FACTOR * expected:
            warnings.append(
                f"warning: rank {r.rank}'s all-reduce of {_size(r.allreduce_bytes)} took "
                f"{r.allreduce_us:.0f} µs, over {SLOW_FACTOR:g}x what {r.transport} allows "
                f"(~{expected:.0f} µs): check the interface the collectives use "
                f"({r.interface or 'not pinned'}) and whether the host is overloaded."
            )
    return warnings


def expected_us(transport: str, num_bytes: int) -> float | None:
    cost = TRANSPORT_COSTS.get(transport)
    if cost is None:
        return None
    latency_us, gb_per_s = cost
    return latency_us + num_bytes / (gb_per_s * 1e3)  # 1 GB/s = 1e3 bytes per µs


def _size(num_bytes: int) -> str:
    if num_bytes < 1 << 20:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"
