"""The command line `orbit up` gives a rank, built without hosts: one record of a host at a
made-up address, for tests that check what a launch flag adds to it."""

from __future__ import annotations

from orbit.cluster.config import HostConfig
from orbit.cluster.launch import rank_launch
from orbit.cluster.state import ClusterState, HostRecord


def cluster_rank_argv(rank: int = 0, tp: int = 1, **launch) -> list[str]:
    """Rank `rank`'s argv in a cluster of `tp` ranks on one host; `launch`: rank_launch's
    keyword arguments (log_level, kv_dtype, draft_dir, exact_verification)."""
    host = HostRecord(0, "gpu-a", 22, "orbit", None, "/kh", "/w", "/w/packages/d", "/w/run/d")
    state = ClusterState(
        "/c.toml", "/pkg", "d", "f", tp, "10.0.0.1", 29517, "tcp://10.0.0.1:29518", "/keys", 0.0,
        (host,), (),
    )  # fmt: skip
    got = rank_launch(HostConfig("gpu-a"), host, state, rank, 0, 0, 512, **launch)
    return [str(arg) for arg in got.argv]
