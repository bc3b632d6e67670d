"""How many KV pages a rank's GPU holds: what is free after the weights, minus what the
activations, CUDA graphs and attention workspaces need, times a configurable fraction.

The arithmetic is a pure function (plan_kv_pool), tested on CPU; the CUDA runner feeds it the
free memory it reads from the device after loading the weights and profiling one forward pass
at the largest step, and keeps the result as its own frozen object (never patched into a
config).
"""

from __future__ import annotations

from dataclasses import dataclass


class KVPoolError(RuntimeError):
    """The device cannot hold the KV pages the package's capacities need."""


@dataclass(frozen=True)
class KVPoolPlan:
    """The page pool a rank allocates once at start-up."""

    num_pages: int  # pages the scheduler may hand out (ids 0 .. num_pages - 1)
    page_bytes: int  # one page across all layers (k and v)
    free_bytes: int  # device memory free when the pool was sized
    reserve_bytes: int  # held back for activations, graph pools and workspaces
    fraction: float  # share of (free - reserve) the pool may take

    @property
    def pool_bytes(self) -> int:
        """Bytes of the allocated pool, the runner's padding page included."""
        return (self.num_pages + 1) * self.page_bytes


def plan_kv_pool(
    page_bytes: int,
    free_bytes: int,
    reserve_bytes: int,
    fraction: float,
    min_pages: int,
    max_pages: int = 0,
) -> KVPoolPlan:
    """Pages = fraction * (free - reserve) / page_bytes, less the one padding page the CUDA
    runner keeps for the rows that pad a batch to its bucket; capped at max_pages (0: no cap).

    Raises KVPoolError, naming the numbers, when fewer than min_pages (one sequence of the
    package's max_seq_len) would fit.
    """
    if not 0.0 < fraction <= 1.0:
        raise KVPoolError(f"the KV memory fraction must be in (0, 1], got {fraction}.")
    usable = max(0, free_bytes - reserve_bytes)
    num_pages = int(usable * fraction) // page_bytes - 1
    if max_pages and max_pages < min_pages:
        raise KVPoolError(
            f"--kv-pages {max_pages} is below the {min_pages} pages one sequence of the "
            f"package's max_seq_len needs; ask for at least {min_pages}."
        )
    if max_pages:
        num_pages = min(num_pages, max_pages)
    if num_pages < min_pages:
        raise KVPoolError(
            f"only {max(num_pages, 0)} KV pages of {page_bytes} bytes fit ({free_bytes} bytes "
            f"free, {reserve_bytes} reserved, fraction {fraction}), but one sequence of the "
            f"package's max_seq_len needs {min_pages}; use more GPUs (a larger --tp), a "
            "smaller --max-seq-len, or a larger KV fraction."
        )
    return KVPoolPlan(num_pages, page_bytes, free_bytes, reserve_bytes, fraction)
