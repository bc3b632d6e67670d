"""Run `orbit serve` as a real child process for tests, and stop it leaving nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from orbit.core.local_ranks import free_port

REPO = Path(__file__).resolve().parents[1]


class ServerProcess:
    def __init__(
        self,
        package: Path,
        *args: str,
        ready_timeout_s: float = 180.0,
        orbit_args: tuple[str, ...] = (),
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.package = Path(package)
        self.cmd = [sys.executable, "-m", "orbit", *orbit_args, "serve", str(package)]
        self.cmd += ["--port", str(self.port), *args]
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        """Start the server without waiting for it (tests of start-up faults)."""
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.proc

    def __enter__(self) -> ServerProcess:
        self.start()
        started = time.monotonic()
        deadline = started + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orbit serve exited:\n{self.proc.stdout.read().decode()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    # how long this machine takes to start the server, for tests that bound a
                    # restart by it rather than by seconds that a loaded machine may not keep
                    self.started_in_s = time.monotonic() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        # what it printed says why (a server that fills the pipe also blocks on it)
        said = self.proc.stdout.read().decode(errors="replace")[-6000:]
        raise TimeoutError(
            f"orbit serve was not healthy within {self.ready_timeout_s} s; it printed:\n{said}"
        )

    def __exit__(self, *exc) -> None:
        self.stop()

    def rank_pids(self) -> list[int]:
        """Pids of this server's rank processes (children started in their own sessions)."""
        return [pid for pid, cmd in children(self.proc.pid) if " -m ranks " in cmd]

    def api_server_pids(self) -> list[int]:
        """Pids of this server's API server processes."""
        return [pid for pid, cmd in children(self.proc.pid) if " -m orbit.http " in cmd]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        kids = [pid for pid, _ in children(self.proc.pid)]
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in kids:
                _kill(pid)
            raise
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of each direct child of pid."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = []
    for child in (int(p) for p in out.stdout.split()):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append((child, f" {cmd} "))
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def started_at(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None once it is gone: with a pid
    it names one process, where a pid alone may be reused (pid_max is 32,768 on CI)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def left_behind(procs: dict[int, int | None]) -> list[str]:
    """What is still running of {pid: started_at(pid)}, a line each, for an assertion's
    message: its state, parent and command line."""
    left = []
    for pid, start in procs.items():
        fields = _stat(pid)
        if fields is None or fields[0] == "Z" or int(fields[19]) != start:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        left.append(f"pid {pid} state {fields[0]} parent {fields[1]}: {cmd[:300]}")
    return left


def live_in_group(group: int) -> list[str]:
    """The processes of process group `group` that still run (zombies are not), a line each."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    members = {pid: fields for pid in pids if (fields := _stat(pid)) and int(fields[2]) == group}
    return left_behind({pid: int(f[19]) for pid, f in members.items() if f[0] != "Z"})


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from its state field on (the command name before it may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
