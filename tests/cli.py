"""Run the orbit CLI as a user would, against the calling test module's own cluster-state
folder (`orbit --state-dir`): import `orbit`, `STATE_ARGS` and the autouse `state_dir` fixture."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orbit.cluster.state import use_state_dir

REPO = Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 180.0
# `orbit --state-dir DIR` for every CLI call, set by `state_dir` for the module that uses it
# (and kept in a list so modules that imported it see the change).
STATE_ARGS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def state_dir(tmp_path_factory):
    """Cluster state records go to a test folder, for this process and the CLI it runs."""
    folder = tmp_path_factory.mktemp("state")
    use_state_dir(folder)
    STATE_ARGS[:] = ["--state-dir", str(folder)]
    yield folder
    STATE_ARGS[:] = []
    use_state_dir(Path("~/.cache/orbit/clusters"))


def orbit(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orbit", *STATE_ARGS, *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, COLUMNS="250"),  # rich tables wide enough to read in asserts
    )


def default_sigint() -> None:
    """preexec_fn for a child that a test stops with SIGINT: a shell that runs the test suite in
    the background hands its children SIGINT ignored, and Python then never raises
    KeyboardInterrupt; restoring the default lets the child's Python install its handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
