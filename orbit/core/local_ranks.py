"""Start and stop a package's ranks as child processes of this machine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LocalRankOptions:
    device: str = "cpu"
    kv_pages: int = 0
    kv_cache_mb: int = 512
    kv_dtype: str = "auto"  # auto, fp8 or model (runtime/quant.py KV_DTYPES)
    threads: int = 0  # torch threads per CPU rank; 0: default_rank_threads()
    log_level: str = "warning"  # the ranks' logging level
    trusted_keys: tuple[Path, ...] = ()  # passed on: ranks refuse packages not signed by one
    draft_package: Path | None = None  # rank 0 drafts with it (orbit serve --draft)
    exact_verification: bool = False  # orbit serve --exact-verification (ranks/config.py)


# Cores left to the engine core and the API servers (tokenizing, detokenizing, SSE) when the
# machine has more cores than ranks: a rank's torch threads on every core starve them.
FRONTEND_CORES = 1


def default_rank_threads(num_cores: int, tp_size: int) -> int:
    """torch threads per CPU rank: the cores left after FRONTEND_CORES, shared by the ranks;
    at least one each."""
    reserved = FRONTEND_CORES if num_cores > tp_size else 0
    return max(1, (num_cores - reserved) // tp_size)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRanks:
    def __init__(
        self,
        package: Path,
        tp_size: int,
        frontend: str,
        log_dir: Path,
        opts: LocalRankOptions,
        curve_dir: Path,
    ):
        """curve_dir: the run's CURVE keys (runtime/curve.py), from which each rank takes its own."""
        self.package, self.tp_size, self.frontend = package, tp_size, frontend
        self.log_dir, self.opts, self.curve_dir = log_dir, opts, curve_dir
        self.procs: list[subprocess.Popen] = []

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{rank}.log"

    def rank_argv(self, rank: int, dist_init: str) -> list[str]:
        """How rank `rank` is started (python -m ranks and its flags)."""
        threads = self.opts.threads or default_rank_threads(os.cpu_count() or 1, self.tp_size)
        if self.opts.device != "cpu":
            threads = 0  # a CUDA rank sets its own (ranks/worker.py rank_threads)
        cmd = [
            sys.executable,
            "-m",
            "ranks",
            "--package",
            str(self.package),
            "--rank",
            str(rank),
            "--tp-size",
            str(self.tp_size),
            "--frontend",
            self.frontend,
            "--dist-init",
            dist_init,
            "--device",
            self.opts.device,
            "--kv-pages",
            str(self.opts.kv_pages),
            "--kv-cache-mb",
            str(self.opts.kv_cache_mb),
            "--kv-dtype",
            self.opts.kv_dtype,
            "--threads",
            str(threads),
            "--exit-with-parent",
            "--curve-dir",
            str(self.curve_dir),
            "--log-level",
            self.opts.log_level,
        ]
        for key in self.opts.trusted_keys:
            cmd += ["--trusted-key", str(Path(key).resolve())]
        if self.opts.exact_verification:
            cmd.append("--exact-verification")
        if self.opts.draft_package is not None and rank == 0:
            cmd += ["--draft-package", str(Path(self.opts.draft_package).resolve())]
        return cmd

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        dist_init = f"tcp://127.0.0.1:{free_port()}"
        for rank in range(self.tp_size):
            cmd = self.rank_argv(rank, dist_init)
            # Every listener of the ranks (gloo's pairs, NCCL's bootstrap) stays on loopback.
            env = dict(
                os.environ,
                PYTHONPATH=pythonpath(),
                GLOO_SOCKET_IFNAME="lo",
                NCCL_SOCKET_IFNAME="lo",
            )
            if self.opts.device == "cuda":
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            log = open(self.log_path(rank), "wb")
            # A session of its own: a Ctrl-C at the terminal reaches the frontend only, which
            # then stops the ranks in order.
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO_ROOT,
                    start_new_session=True,
                )
            )
            log.close()

    def exited(self) -> list[tuple[int, int]]:
        """(rank, exit code) of every rank that is no longer running."""
        return [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]

    def log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(rank).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, ranks) -> None:
        """KILL these ranks at once: a stopped or hung process cannot answer a shutdown."""
        for rank in ranks:
            if self.procs[rank].poll() is None:
                _signal_group(self.procs[rank], signal.SIGKILL)

    def stop(self, grace_s: float = 10.0, term_grace_s: float = 5.0) -> None:
        """Wait grace_s for ranks told to shut down; TERM what is still running, and KILL what
        is left term_grace_s later."""
        deadline = time.monotonic() + grace_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None and sig is not None:
                    _signal_group(p, sig)
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            if all(p.poll() is not None for p in self.procs):
                return
            deadline = time.monotonic() + term_grace_s
        for p in self.procs:
            p.wait(timeout=5)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def pythonpath() -> str:
    # Ranks run from the source tree too (the GPU machine cannot pip-install).
    existing = os.environ.get("PYTHONPATH")
    return str(REPO_ROOT) + (os.pathsep + existing if existing else "")
