"""The rank's settings, built once from its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from runtime.quant import KV_DTYPES


@dataclass(frozen=True)
class RankConfig:
    package: str  # package directory
    rank: int
    tp_size: int
    frontend: str  # ZeroMQ endpoint of the frontend's ROUTER, e.g. tcp://127.0.0.1:5555
    dist_init: str  # torch.distributed init method, e.g. tcp://127.0.0.1:29500
    device: str  # "cpu" or "cuda"
    kv_pages: int  # 0: size from free memory (cuda) or from kv_cache_mb (cpu)
    kv_cache_mb: int
    kv_dtype: str  # auto, fp8 or model: what the KV pages hold (runtime/quant.py KV_DTYPES)
    heartbeat_s: float
    threads: int  # torch intra-op threads on CPU; 0 leaves torch's default (CUDA ranks: 1)
    exit_with_parent: bool  # local ranks of `orbit serve` end when the frontend process does
    trusted_keys: tuple[str, ...]  # Ed25519 public keys; non-empty: the package must be signed
    curve_dir: str  # client-R.key_secret + server.key (runtime/curve.py): the link's CURVE keys
    # Limit on joining the TP group and on the collectives check; past it the rank reports a
    # Failure naming the phase and exits (NCCL and gloo init cannot be aborted from inside).
    join_timeout_s: float = 120.0
    log_level: str = "warning"  # debug, info, warning or error (orbit serve --log-level)
    # A package rank 0 drafts with (speculative decoding's draft proposer); "": none.
    draft_package: str = ""
    # CUDA ranks: verification rows of up to 32 tokens computed bit for bit as one-token
    # steps (runtime/cuda_runner.py, exact graphs), so speculation's greedy output is the
    # output without it; such a verification costs several one-token steps.
    exact_verification: bool = False

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> RankConfig:
        p = argparse.ArgumentParser(prog="python -m ranks", description=__doc__)
        p.add_argument("--package", required=True)
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--tp-size", type=int, required=True)
        p.add_argument("--frontend", required=True)
        p.add_argument("--dist-init", required=True)
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument("--kv-pages", type=int, default=0)
        p.add_argument("--kv-cache-mb", type=int, default=512)
        p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
        p.add_argument("--heartbeat-s", type=float, default=1.0)
        p.add_argument("--threads", type=int, default=0)
        p.add_argument("--exit-with-parent", action="store_true")
        p.add_argument("--trusted-key", action="append", default=[])
        p.add_argument("--curve-dir", default="")
        p.add_argument("--join-timeout-s", type=float, default=120.0)
        p.add_argument(
            "--log-level", choices=["debug", "info", "warning", "error"], default="warning"
        )
        p.add_argument("--draft-package", default="")
        p.add_argument("--exact-verification", action="store_true")
        a = p.parse_args(argv)
        return cls(
            package=a.package,
            rank=a.rank,
            tp_size=a.tp_size,
            frontend=a.frontend,
            dist_init=a.dist_init,
            device=a.device,
            kv_pages=a.kv_pages,
            kv_cache_mb=a.kv_cache_mb,
            kv_dtype=a.kv_dtype,
            heartbeat_s=a.heartbeat_s,
            threads=a.threads,
            exit_with_parent=a.exit_with_parent,
            trusted_keys=tuple(a.trusted_key),
            curve_dir=a.curve_dir,
            join_timeout_s=a.join_timeout_s,
            log_level=a.log_level,
            draft_package=a.draft_package,
            exact_verification=a.exact_verification,
        )
