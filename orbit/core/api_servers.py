"""The API server processes of `orbit serve`: started by the engine core on the HTTP socket it
bound, watched, and replaced when one dies.

Every server accepts on the one listening socket (inherited), so connections spread over the
servers by which one accepts first: a busy server accepts fewer. Each runs in a session of its
own, so a Ctrl-C at the terminal reaches only the core, which drains and then stops them. Their
logs go to the core's own stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from orbit.core.api_link import ApiLink
from orbit.core.local_ranks import REPO_ROOT, pythonpath

log = logging.getLogger("orbit.core")

WATCH_INTERVAL_S = 0.2
RESTART_PAUSE_S = 1.0
MAX_RESTART_PAUSE_S = 30.0


def default_api_servers(ranks_on_cpu: bool) -> int:
    """One per four cores, between 1 and 4: the core, the ranks' host threads and the HTTP
    clients' share of the machine need the rest. One where the ranks compute on this machine's
    CPU: they take every core but the frontend's one (local_ranks.FRONTEND_CORES), and more API
    servers on it only add their own per-step and idle costs (docs/performance.md)."""
    if ranks_on_cpu:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


class ApiServers:
    def __init__(self, count: int, config_path: Path, listener: socket.socket, link: ApiLink):
        self.count, self.config_path, self.listener, self.link = count, config_path, listener, link
        self.procs: dict[int, subprocess.Popen] = {}
        self.reached: set[int] = set()  # indices whose server has reached the core at least once
        self.pause_s: dict[int, float] = {}
        self.failure = ""  # why watch() gave up: orbit serve then ends

    def start(self) -> None:
        for index in range(self.count):
            self._start(index)

    def _start(self, index: int) -> None:
        fd = self.listener.fileno()
        cmd = [sys.executable, "-m", "orbit.http", "--config", str(self.config_path)]
        cmd += ["--index", str(index), "--fd", str(fd)]
        env = dict(os.environ, PYTHONPATH=pythonpath())
        self.procs[index] = subprocess.Popen(
            cmd, pass_fds=(fd,), env=env, cwd=REPO_ROOT, start_new_session=True
        )

    async def watch(self) -> None:
        """Replace a server that exits; its sequences are aborted (the others go on). Return,
        with self.failure set, when a server exits before any server of its index has reached
        the core: a fault at start-up (a module that does not import, a tokenizer that does not
        load) fails the same way every time, and restarting it for ever would leave
        orbit serve up, answering nothing."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for index, proc in list(self.procs.items()):
                reached = self.link.reached(proc.pid)
                if reached:
                    self.reached.add(index)
                if proc.poll() is None:
                    continue
                self.link.forget_pid(proc.pid)
                if index not in self.reached:
                    self.failure = (
                        f"API server {index} (pid {proc.pid}) exited with code {proc.returncode} "
                        "before it reached the engine core; its error is printed above: fix "
                        "what it names (a missing module: run ./deploy/install.sh) and start "
                        "orbit serve again"
                    )
                    log.error("%s", self.failure)
                    return
                # One that keeps failing as it starts waits longer each time; one that got as
                # far as the core is replaced after the short pause again.
                pause = RESTART_PAUSE_S if reached else self.pause_s.get(index, RESTART_PAUSE_S)
                self.pause_s[index] = min(2 * pause, MAX_RESTART_PAUSE_S)
                log.error(
                    "API server %d (pid %d) exited with code %s; starting a new one in %g s",
                    index, proc.pid, proc.returncode, pause,
                )  # fmt: skip
                await asyncio.sleep(pause)
                self._start(index)

    def stop(self, grace_s: float = 10.0) -> None:
        """TERM every server (uvicorn closes its connections), then KILL what is left."""
        for proc in self.procs.values():
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        for proc in self.procs.values():
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=5)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
