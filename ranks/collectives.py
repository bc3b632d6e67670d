"""The collectives check every rank runs just before Ready: time one all-reduce at the size the
model's decode steps send, and say which transport carries it.

Message size: hidden size x dtype bytes x the largest decode batch (the row-parallel outputs of
a full decode step). The median of a few timed iterations after a warm-up is reported: the
first collectives of a group set up connections and buffers.

The transport is inferred, not read from NCCL (its debug output is not an API): gloo always
runs over TCP; NCCL within one host uses P2P/NVLink or shared memory; across hosts it uses
InfiniBand/RoCE when the host has RDMA devices and NCCL is not told to avoid them, else sockets.
NCCL_DEBUG=INFO in the host's env shows what NCCL actually picked.
"""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

WARMUP_ITERATIONS = 3
TIMED_ITERATIONS = 10
RDMA_DEVICES = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class CollectivesCheck:
    allreduce_us: float  # median of the timed iterations
    allreduce_bytes: int
    transport: str  # see the module docstring
    num_hosts: int
    interface: str  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME as set for this rank, or ""


def join_check(device: torch.device) -> None:
    """One tiny all-reduce right after init_process_group: NCCL creates its communicator at the
    first collective, so this puts that (hang-prone) step inside the join phase's watchdog."""
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    _sync(device)


def check_collectives(
    hidden_size: int, max_batch: int, dtype: torch.dtype, device: torch.device
) -> CollectivesCheck:
    """Run the check; every rank of the group must call it (the all-reduces are collective)."""
    num_hosts = count_hosts(device)
    x = torch.zeros(max_batch, hidden_size, dtype=dtype, device=device)  # [batch, hidden]
    for _ in range(WARMUP_ITERATIONS):
        dist.all_reduce(x)
    _sync(device)
    times_s = []
    for _ in range(TIMED_ITERATIONS):
        start = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        times_s.append(time.perf_counter() - start)
    backend = dist.get_backend()
    return CollectivesCheck(
        allreduce_us=statistics.median(times_s) * 1e6,
        allreduce_bytes=x.numel() * x.element_size(),
        transport=transport_name(backend, num_hosts, _rdma_usable()),
        num_hosts=num_hosts,
        interface=_pinned_interface(backend),
    )


def count_hosts(device: torch.device) -> int:
    """How many distinct hostnames the group's ranks run on (a 63-bit hash of each, gathered
    as tensors: nothing is pickled)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:8], "big") >> 1], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return len({int(t.item()) for t in every})


def transport_name(backend: str, num_hosts: int, rdma_usable: bool) -> str:
    if backend != "nccl":
        return "gloo/tcp"
    if num_hosts <= 1:
        return "nccl/p2p"
    return "nccl/ib" if rdma_usable else "nccl/socket"


def _rdma_usable() -> bool:
    # Read, not set: these are the variables NCCL itself reads on this host.
    if os.environ.get("NCCL_IB_DISABLE") == "1" or os.environ.get("NCCL_NET") == "Socket":
        return False
    return RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())


def _pinned_interface(backend: str) -> str:
    name = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    return os.environ.get(name, "")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
