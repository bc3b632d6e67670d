"""GPU tests: they run on the lent GPU machine through the device tool and skip everywhere
else (CI has no GPU). Models are random-weight configs built in the test, no download."""

from __future__ import annotations

import json
import os

import pytest
import torch


@pytest.fixture(scope="session")
def nccl_group():
    """A world-size-1 NCCL process group, so that a TP=1 model can still call (and capture)
    the NCCL collectives that TP > 1 uses."""
    import torch.distributed as dist

    from runtime.layers import TPGroup
    from tests.tp_harness import free_port

    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    yield TPGroup(0, 1, always_communicate=True)
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def report():
    """report(name, **numbers): appends one JSON line to $ORBIT_GPU_REPORT when it is set, so
    a device run brings the measured errors back for docs/performance.md."""
    path = os.environ.get("ORBIT_GPU_REPORT")

    def write(name: str, **numbers) -> None:
        print(name, numbers)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": name, **numbers}) + "\n")

    return write
