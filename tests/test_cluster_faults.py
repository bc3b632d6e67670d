"""Hosts failing under `orbit up`, on real OpenSSH hosts in network namespaces (tests/sshd.py):
a host whose link is cut mid-push, one whose sftp-server hangs, one whose SSH session dies, and
Ctrl-C while a host is gone. Every case must end `orbit up` (a real CLI process) within a bounded
time with one error line naming the host, no traceback, and nothing started or recorded.

The link to host1 is throttled for each test so that its push (16 MB) lasts long enough
to be interrupted once its first upload is under way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orbit.cluster.state import state_path
from tests.cli import REPO, STATE_ARGS, default_sigint, state_dir  # noqa: F401
from tests.sshd import TestHost, ssh_hosts  # noqa: F401
from tests.two_host_cluster import Cluster, hosts, package, write_cluster  # noqa: F401

THROTTLE_KBIT = 16_000  # 2 MB/s: host1's push (16 MB) lasts about 8 s unless cut short
MID_PUSH_TIMEOUT_S = 120.0  # CLI start, preflight, until host1's first upload is under way
MID_PUSH_BYTES = 100_000
# The [ssh] stall_timeout_s of the hung sftp-server case: above the 4 s an 8 MiB write takes
# over the throttled link, so only the hang trips it.
STALL_TIMEOUT_S = 10
# From the fault to `orbit up`'s exit: the default keepalive gives up on a silent host after
# 5 s x (3 + 1) = 20 s; the rest is slack for a loaded machine.
LOST_HOST_BOUND_S = 40.0


@pytest.fixture
def host1(hosts) -> Iterator[TestHost]:
    """hosts[1] with its link throttled; link, throttle and stopped processes undone after."""
    host = hosts[1]
    host.throttle(THROTTLE_KBIT)
    try:
        yield host
    finally:
        # Sessions the test froze or left behind. Never a shell: the hosts' login shells run
        # `pyenv rehash`, and one killed inside it leaves the lock that every later one waits on.
        for pid in host.session_pids("sshd") + host.session_pids("sftp-server"):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        host.restore_link()


def start_up(cluster: Cluster) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orbit", *STATE_ARGS, "up", str(cluster.path), "--timeout", "60"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, COLUMNS="250"),
        preexec_fn=default_sigint,  # noqa: PLW1509 - the test sends it SIGINT
    )


def wait_mid_push(process: subprocess.Popen, workdir: Path) -> None:
    """Return once a large upload to the host is under way: a .part in its store holding
    MID_PUSH_BYTES (the manifest's, a few hundred bytes, is hashed at once by a shell)."""
    store = workdir / "store" / "sha256"
    deadline = time.monotonic() + MID_PUSH_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(_size(p) >= MID_PUSH_BYTES for p in store.glob("*.part")):
            return
        if process.poll() is not None:
            pytest.fail(f"orbit up ended before the push began:\n{process.stderr.read()}")
        time.sleep(0.05)
    process.kill()
    pytest.fail("the push to host1 did not begin in time")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:  # renamed into place meanwhile
        return 0


def finish(process: subprocess.Popen, bound_s: float) -> tuple[int, str, float]:
    """(exit status, stderr, seconds taken); fails the test when it runs past bound_s."""
    start = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=bound_s)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"orbit up still ran {bound_s:g} s after the fault:\n{stderr[-3000:]}")
    return process.returncode, stderr, time.monotonic() - start


def the_error_line(stderr: str) -> str:
    """stderr's one error line, which must also be its last line."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert stderr.rstrip().splitlines()[-1] == errors[0], stderr
    return errors[0]


def assert_nothing_started(cluster: Cluster) -> None:
    """No rank was started (the push failed first) and nothing was recorded. A command that
    was running on a host when its session died may still finish there: it is not a rank."""
    assert not any((w / "run").exists() for w in cluster.workdirs)
    assert not state_path(cluster.path).exists()


# fault: (what the test does to host1, the [ssh] table of cluster.toml). The link cut and the
# killed session use the defaults: keepalives end the first, the dead connection the second.
FAULTS = {
    "link cut": (lambda host: host.cut_link(), ""),
    "sftp-server hangs": (
        lambda host: [os.kill(pid, signal.SIGSTOP) for pid in host.session_pids("sftp-server")],
        f"[ssh]\nstall_timeout_s = {STALL_TIMEOUT_S}\n",
    ),
    "session killed": (
        lambda host: [os.kill(pid, signal.SIGKILL) for pid in host.session_pids("sshd")],
        "",
    ),
}


@pytest.mark.parametrize(
    "fault, run",
    [("link cut", 1), ("sftp-server hangs", 1)] + [("session killed", n) for n in (1, 2, 3)],
)
def test_a_host_lost_mid_push_ends_up_with_one_error_line(
    fault, run, hosts, host1, package, tmp_path
):
    do_fault, ssh_table = FAULTS[fault]
    cluster = write_cluster(tmp_path, package, hosts, f"lost-{run}", tables=ssh_table)
    process = start_up(cluster)
    wait_mid_push(process, cluster.workdirs[1])
    do_fault(host1)
    code, stderr, elapsed = finish(process, LOST_HOST_BOUND_S)
    print(f"{fault}: orbit up ended {elapsed:.1f} s after the fault: {stderr.splitlines()[-1]}")
    assert code == 1, stderr
    line = the_error_line(stderr)
    host_label = f"{host1.address}:{host1.port}"
    assert line.startswith(f"error: lost SSH to {host_label} during the push ("), line
    assert line.endswith(
        "check that the host is up and reachable, then run `orbit up` again: the push resumes "
        "where it stopped."
    ), line
    if fault == "link cut":
        assert "(Server not responding to keepalive)" in line
    if fault == "sftp-server hangs":
        assert f"(no answer to an SFTP request for {STALL_TIMEOUT_S} s)" in line
    assert_nothing_started(cluster)


def test_one_ctrl_c_ends_up_at_once_while_a_host_is_gone(hosts, host1, package, tmp_path):
    cluster = write_cluster(tmp_path, package, hosts, "ctrl-c")
    process = start_up(cluster)
    wait_mid_push(process, cluster.workdirs[1])
    host1.cut_link()
    time.sleep(1.0)  # the push is now waiting on a host that will never answer
    process.send_signal(signal.SIGINT)
    code, stderr, elapsed = finish(process, 10.0)
    print(f"Ctrl-C: orbit up ended {elapsed:.1f} s after it")
    assert code == 130, stderr
    assert the_error_line(stderr).startswith("error: interrupted;")
    assert_nothing_started(cluster)
