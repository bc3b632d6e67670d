"""Real OpenSSH servers for tests: one sshd per test host, with its own keys and config.

Import the fixtures into a test module: `from tests.sshd import ssh_host, ssh_hosts  # noqa: F401`.

Isolation: when the tests run as root and `ip netns` works, each host is a network namespace
on a private bridge: the bridge holds 10.211.X.1 (the test process's side, `TestHost.gateway`)
and host n holds 10.211.X.(n+2), with sshd on port 22 there. X is a /24 no interface or route
uses yet, picked under a lock so parallel test runs do not collide; the bridge, veths and
namespaces are deleted at teardown. Otherwise each host is a loopback address 127.0.0.(n+10)
with its own free port. Either way no traffic leaves the machine. The namespaces share the
filesystem, so each host gets its own folder (`TestHost.root`) for workdirs. With namespaces a
test can also fail a host: cut or throttle its link (`cut_link`, `throttle`, `restore_link`) and
find its SSH sessions' processes (`session_pids`).

Needs the Debian packages openssh-server (sshd; it pulls in openssh-sftp-server for sftp-server
and openssh-client for ssh-keygen) and iproute2 (ip; without it the hosts use loopback). Tests
skip with the reason when sshd, sftp-server or ssh-keygen is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from orbit.cluster.config import HostConfig

SSHD = Path("/usr/sbin/sshd")
SFTP_SERVERS = (
    Path("/usr/lib/openssh/sftp-server"),
    Path("/usr/libexec/openssh/sftp-server"),
    Path("/usr/libexec/sftp-server"),
)
SUBNET_PREFIX = "10.211"
NETNS_LOCK = Path("/tmp/orbit-test-netns.lock")
START_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0
# Set to 1 to use loopback addresses even where namespaces work.
FORCE_LOOPBACK_ENV = "ORBIT_TEST_SSH_LOOPBACK"


@dataclass(frozen=True)
class TestHost:
    """One sshd the tests can reach, and what a client needs to log in to it."""

    __test__ = False  # not a test class, despite the name

    name: str
    address: str
    port: int
    user: str
    identity_file: Path
    # Holds this host's key only; tests of unknown keys pass their own file to host_config().
    known_hosts: Path
    known_hosts_line: str
    # This host's private folder on the shared filesystem: its workdirs go here.
    root: Path
    netns: str | None
    # The address this host reaches the test process at (a frontend's address).
    gateway: str
    # The host's end of its link as seen from the test process's namespace (None on loopback):
    # what cut_link() takes down and throttle() slows.
    veth: str | None = None
    sshd_pid: int = 0  # the listening sshd; each SSH session is a child process of it

    def host_config(self, **overrides) -> HostConfig:
        config = HostConfig(
            address=self.address,
            ssh_port=self.port,
            user=self.user,
            identity_file=self.identity_file,
            known_hosts=self.known_hosts,
            workdir=str(self.root / "orbit"),
            device="cpu",
        )
        return replace(config, **overrides)

    def new_workdir(self, name: str) -> Path:
        """A fresh, empty folder for one test's workdir."""
        path = self.root / "workdirs" / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def run(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """Run a shell command "on the host" (inside its namespace) and return its stdout."""
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        done = subprocess.run(
            [*prefix, "sh", "-c", command],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{command!r} on {self.name} exited {done.returncode}: {done.stderr}"
            )
        return done.stdout

    def cut_link(self) -> None:
        """Take the host's link down: from now on its packets, both ways, are lost (as when a
        host loses power or its cable), without any reset reaching either side."""
        _ip("link", "set", self._need_veth(), "down")

    def restore_link(self) -> None:
        """Undo cut_link() and throttle()."""
        subprocess.run(
            ["tc", "qdisc", "del", "dev", self._need_veth(), "root"],
            check=False, capture_output=True, timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip
        _ip("link", "set", self._need_veth(), "up")

    def throttle(self, rate_kbit: int) -> None:
        """Slow what the test process sends to the host to rate_kbit (a token bucket on the
        link), so that a push lasts long enough to be interrupted on purpose."""
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", self._need_veth(), "root", "tbf", "rate",
             f"{rate_kbit}kbit", "burst", "32kbit", "latency", "5s"],
            check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip

    def session_pids(self, name: str = "") -> list[int]:
        """Processes below the host's sshd (its SSH sessions and what they run), optionally
        only those whose command line contains `name`."""
        children: dict[int, list[int]] = {}
        for pid, ppid in _parents().items():
            children.setdefault(ppid, []).append(pid)
        found, todo = [], list(children.get(self.sshd_pid, []))
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            if name in _cmdline(pid):
                found.append(pid)
        return sorted(found)

    def _need_veth(self) -> str:
        if self.veth is None:
            pytest.skip("needs network namespaces: a loopback host has no link to cut")
        return self.veth


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            found[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def skip_reason() -> str | None:
    if not SSHD.is_file():
        return f"{SSHD} is not installed (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen is not installed (apt-get install openssh-client)"
    if sftp_server() is None:
        return "sftp-server is not installed (apt-get install openssh-server)"
    return None


def sftp_server() -> Path | None:
    return next((p for p in SFTP_SERVERS if p.is_file()), None)


def keygen(path: Path, comment: str) -> str:
    """Make an ed25519 key pair at path (and path.pub); return the public key line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    return path.with_name(path.name + ".pub").read_text().strip()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)


def _ip_out(*args: str) -> str:
    done = subprocess.run(
        ["ip", *args], check=False, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    return done.stdout


class _Namespaces:
    """A bridge in this namespace and one network namespace per host attached to it."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.bridge = f"ob{tag}"
        self.netns_prefix = f"orbit-test-{tag}-"
        self.veth_prefix = f"ov{tag}h"
        self.subnet: str | None = None
        self.created: list[tuple[str, str]] = []  # (kind, name), undone in reverse

    def start(self) -> None:
        with open(NETNS_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            _remove_stale()
            self.subnet = _free_subnet()
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            self.created.append(("link", self.bridge))
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def add_host(self, n: int) -> tuple[str, str, str]:
        """Make host n's namespace; return (namespace name, its address, the outer veth)."""
        netns, outer, inner = f"{self.netns_prefix}{n}", f"{self.veth_prefix}{n}", f"ovi{n}"
        address = f"{self.subnet}.{n + 2}"
        _ip("netns", "add", netns)
        self.created.append(("netns", netns))
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", netns)
        self.created.append(("link", outer))
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", netns, "link", "set", inner, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        return netns, address, outer

    def stop(self) -> None:
        for kind, name in reversed(self.created):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip(kind, "del", name)
        self.created.clear()


def _free_subnet() -> str:
    used = _ip_out("-o", "-4", "addr", "show") + _ip_out("-4", "route", "show", "table", "all")
    for x in range(1, 255):
        if f"{SUBNET_PREFIX}.{x}." not in used:
            return f"{SUBNET_PREFIX}.{x}"
    raise RuntimeError(f"every {SUBNET_PREFIX}.X.0/24 is in use; delete stale test bridges")


def _remove_stale() -> None:
    """Delete namespaces and links left by test runs that died before their teardown."""
    for line in _ip_out("netns", "list").splitlines():
        match = re.match(r"(orbit-test-(\d+)-\d+)", line)
        if match and not _alive(int(match.group(2))):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", match.group(1))
    links = _ip_out("-o", "link")
    for name, pid in re.findall(r"^\d+: ((?:ob|ov)(\d+)h?\d*)[@:]", links, re.MULTILINE):
        if not _alive(int(pid)):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("link", "del", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces_usable() -> bool:
    if os.environ.get(FORCE_LOOPBACK_ENV) == "1" or os.geteuid() != 0 or not shutil.which("ip"):
        return False
    probe = f"orbit-test-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.SubprocessError, OSError):
        return False
    with contextlib.suppress(subprocess.SubprocessError):
        _ip("netns", "del", probe)
    return True


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
PidFile {dir}/sshd.pid
HostKey {dir}/host_ed25519
AuthorizedKeysFile {authorized_keys}
StrictModes no
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
AllowAgentForwarding no
X11Forwarding no
Subsystem sftp {sftp_server}
LogLevel VERBOSE
"""


class _Sshd:
    """One sshd process, started in the foreground (-D) from its own config."""

    def __init__(self, folder: Path, address: str, port: int, netns: str | None) -> None:
        self.folder, self.address, self.port, self.netns = folder, address, port, netns
        self.process: subprocess.Popen | None = None

    def configure(self, authorized_keys: Path) -> str:
        """Write keys and sshd_config, check it with sshd -t; return the host's public key."""
        self.folder.mkdir(parents=True)
        host_public = keygen(self.folder / "host_ed25519", "test host key")
        config = SSHD_CONFIG.format(
            port=self.port,
            address=self.address,
            dir=self.folder,
            authorized_keys=authorized_keys,
            sftp_server=sftp_server(),
        )
        (self.folder / "sshd_config").write_text(config)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        subprocess.run(
            [str(SSHD), "-t", "-f", str(self.folder / "sshd_config")],
            check=True,
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        return host_public

    def start(self) -> None:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        log = self.folder / "sshd.log"
        command = [*prefix, str(SSHD), "-D", "-f", str(self.folder / "sshd_config"), "-E", str(log)]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_listening(log)

    def _wait_listening(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited {self.process.returncode}: {_tail(log)}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.address, self.port), timeout=0.5),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.address}:{self.port}: {_tail(log)}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def _tail(path: Path, num_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


@contextlib.contextmanager
def start_test_hosts(root: Path, count: int) -> Iterator[list[TestHost]]:
    """Start `count` sshd hosts under `root`; stop them and remove their networks on exit."""
    if reason := skip_reason():
        pytest.skip(reason)
    client_key = root / "client" / "id_ed25519"
    client_key.parent.mkdir(parents=True)
    authorized_keys = client_key.parent / "authorized_keys"
    authorized_keys.write_text(keygen(client_key, "orbit tests") + "\n")
    network = _Namespaces() if namespaces_usable() else None
    servers: list[_Sshd] = []
    try:
        if network:
            network.start()
        hosts = [
            _start_host(root, n, network, client_key, authorized_keys, servers)
            for n in range(count)
        ]
        yield hosts
    finally:
        for server in servers:
            server.stop()
        if network:
            network.stop()


def _start_host(
    root: Path,
    n: int,
    network: _Namespaces | None,
    client_key: Path,
    authorized_keys: Path,
    servers: list[_Sshd],
) -> TestHost:
    if network:
        netns, address, veth = network.add_host(n)
        port, gateway = 22, network.gateway
    else:
        netns, address, gateway, veth = None, f"127.0.0.{n + 10}", "127.0.0.1", None
        port = free_port(address)
    folder = root / f"host{n}"
    server = _Sshd(folder / "sshd", address, port, netns)
    servers.append(server)
    host_public = server.configure(authorized_keys)
    server.start()
    pattern = address if port == 22 else f"[{address}]:{port}"
    line = f"{pattern} {' '.join(host_public.split()[:2])}"
    known_hosts = folder / "known_hosts"
    known_hosts.write_text(line + "\n")
    return TestHost(
        name=f"host{n}",
        address=address,
        port=port,
        user=getpass.getuser(),
        identity_file=client_key,
        known_hosts=known_hosts,
        known_hosts_line=line,
        root=folder,
        netns=netns,
        gateway=gateway,
        veth=veth,
        sshd_pid=server.process.pid,
    )


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory) -> Iterator[list[TestHost]]:
    """Two sshd hosts, shared by the tests of one module."""
    with start_test_hosts(tmp_path_factory.mktemp("sshd"), 2) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def ssh_host(tmp_path_factory) -> Iterator[TestHost]:
    """One sshd host, shared by the tests of one module."""
    with start_test_hosts(tmp_path_factory.mktemp("sshd"), 1) as hosts:
        yield hosts[0]
