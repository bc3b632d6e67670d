"""SSH to cluster hosts with asyncssh: connect with strict host-key checking, run commands.

Host keys are always checked against the host's known_hosts file (asyncssh is never given
known_hosts=None). A key the file does not know is refused unless the caller accepts new keys,
which then trusts it and appends it to that file, like OpenSSH's StrictHostKeyChecking=accept-new.
A key that differs from the one on file is always refused. Agent forwarding is off, and
~/.ssh/config is not read: cluster.toml alone says how each host is reached.

Nothing waits on a host without limit: connecting has a timeout, every command has one, every
connection sends keepalives (cluster.toml's [ssh]) so a host that falls silent is given up after
interval x (count + 1) seconds, and each SFTP request of an SftpSession has a stall limit. A
connection that dies under a command or a transfer, however it dies (silence, reset, killed
session), is reported the same way: HostLostError, naming the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Self, TypeVar

import asyncssh

from orbit.cluster.config import DEFAULT_SSH_PORT, HostConfig, SshConfig

T = TypeVar("T")
# SFTP errors that mean the connection or the session is gone, not that a request failed.
SFTP_LOST = (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection)
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_COMMAND_TIMEOUT_S = 60.0
STDERR_TAIL_CHARS = 2000
SAFE_WRITE_BYTES = 16 << 10  # what every SFTP server accepts in one write
ABORT_WAIT_S = 2.0  # an aborted connection fails what waits on it within a few loop turns
# Stored on each connection so errors name the host as cluster.toml does.
_HOST_LABEL = "orbit_host_label"


class ClusterError(Exception):
    """Something on or on the way to a cluster host failed; the message says what to do."""


class HostUnreachableError(ClusterError):
    """No SSH session could be opened (refused, no route, timed out, lost)."""


class HostLostError(HostUnreachableError):
    """An open SSH connection died under a command or a transfer, or stopped answering."""

    def __init__(self, host: str, during: str, reason: str, fix: str = "") -> None:
        fix = fix or "check that the host is up and reachable, then run the command again"
        super().__init__(f"lost SSH to {host} {during} ({reason}); {fix}.")
        self.host = host
        self.reason = reason


def lost(conn: asyncssh.SSHClientConnection, during: str, e: BaseException) -> HostLostError:
    """The HostLostError for an exception that ended a command or transfer on `conn`."""
    return HostLostError(host_label(conn), during, reason_of(e))


def reason_of(e: BaseException) -> str:
    """asyncssh's reason, the OS error's text, or the exception's message or name."""
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
    return reason or type(e).__name__


class HostKeyUnknownError(ClusterError):
    """The host's key is not in known_hosts and new keys were not accepted."""


class HostKeyChangedError(ClusterError):
    """The host presented a key that differs from the one in known_hosts."""


class AuthenticationError(ClusterError):
    """The host refused every client key."""


class RemoteCommandError(ClusterError):
    """A remote command exited non-zero, was killed, or ran past its timeout."""

    def __init__(self, message: str, exit_status: int | None, stderr_tail: str) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        self.stderr_tail = stderr_tail


class _HostKeyPolicy(asyncssh.SSHClient):
    """Decides on host keys that known_hosts does not already trust.

    asyncssh calls validate_host_public_key only for a key outside the trusted set, both for
    a host it has never seen and for one whose key changed; the known_hosts snapshot tells the
    two apart. The decision is kept so connect() can raise the matching error, and an accepted
    key is written to known_hosts only after the server has proved it holds it (the connection
    is up).
    """

    def __init__(self, host: HostConfig, known: asyncssh.SSHKnownHosts, accept_new: bool):
        self._host = host
        self._known = known
        self._accept_new = accept_new
        self.refusal: ClusterError | None = None
        self.new_key: asyncssh.SSHKey | None = None

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey):
        if _has_entry(self._known, host, addr, port):
            self.refusal = HostKeyChangedError(
                f"host key for {self._host.label} has changed since it was recorded in "
                f"{self._host.known_hosts} (possible man-in-the-middle, or the host was "
                "reinstalled); if the change is expected, remove its old line from that file."
            )
            return False
        if not self._accept_new:
            self.refusal = HostKeyUnknownError(
                f"host key for {self._host.label} is not in {self._host.known_hosts}; "
                "pass --accept-new-host-keys to trust it on first use."
            )
            return False
        self.new_key = key
        return True


def _has_entry(known: asyncssh.SSHKnownHosts, host: str, addr: str, port: int) -> bool:
    port_or_none = None if port == DEFAULT_SSH_PORT else port
    host_keys, ca_keys, *_ = known.match(host, addr, port_or_none)
    return bool(host_keys or ca_keys)


def known_hosts_pattern(address: str, ssh_port: int) -> str:
    """The host field of a known_hosts line, as OpenSSH writes it."""
    return address if ssh_port == DEFAULT_SSH_PORT else f"[{address}]:{ssh_port}"


def append_known_host(path: Path, address: str, ssh_port: int, key: asyncssh.SSHKey) -> None:
    """Append one trusted key, creating the file (and a private ~/.ssh) when missing."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    algorithm, key_b64 = key.export_public_key("openssh").decode().split()[:2]
    existing = path.read_bytes() if path.exists() else b""
    separator = "\n" if existing and not existing.endswith(b"\n") else ""
    with open(path, "a", encoding="ascii") as f:
        f.write(f"{separator}{known_hosts_pattern(address, ssh_port)} {algorithm} {key_b64}\n")


def _read_known_hosts(path: Path) -> asyncssh.SSHKnownHosts:
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        return asyncssh.import_known_hosts(text)
    except (OSError, ValueError) as e:
        raise ClusterError(
            f"{path}: cannot be read as a known_hosts file ({e}); fix or remove it."
        ) from e


async def connect(
    host: HostConfig,
    accept_new_host_keys: bool = False,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ssh: SshConfig | None = None,
) -> asyncssh.SSHClientConnection:
    """Open an SSH connection to `host`, checking its key, with keepalives as `ssh` says
    (default: [ssh]'s defaults); raises a ClusterError subclass."""
    if host.identity_file and not host.identity_file.is_file():
        raise AuthenticationError(
            f"identity_file {host.identity_file} for {host.label} does not exist; fix the path "
            "in cluster.toml or create the key with ssh-keygen."
        )
    known = _read_known_hosts(host.known_hosts)
    policy = _HostKeyPolicy(host, known, accept_new_host_keys)
    try:
        conn = await asyncio.wait_for(
            _open(host, known, policy, connect_timeout_s, ssh or SshConfig()),
            timeout=connect_timeout_s + 1.0,
        )
    except asyncssh.HostKeyNotVerifiable as e:
        raise policy.refusal or HostKeyChangedError(
            f"host key for {host.label} was refused ({e.reason}); check {host.known_hosts}."
        ) from None
    except asyncssh.PermissionDenied:
        raise AuthenticationError(_auth_message(host)) from None
    except (OSError, TimeoutError, asyncssh.Error) as e:
        raise HostUnreachableError(_unreachable_message(host, e, connect_timeout_s)) from None
    conn.set_extra_info(**{_HOST_LABEL: host.label})
    if policy.new_key:
        _record_new_key(conn, host, policy.new_key)
    return conn


def _record_new_key(
    conn: asyncssh.SSHClientConnection, host: HostConfig, key: asyncssh.SSHKey
) -> None:
    try:
        append_known_host(host.known_hosts, host.address, host.ssh_port, key)
    except OSError as e:
        conn.close()
        raise ClusterError(
            f"cannot record the host key for {host.label} in {host.known_hosts} ({e.strerror}); "
            "make that file writable."
        ) from e


async def _open(
    host: HostConfig,
    known: asyncssh.SSHKnownHosts,
    policy: _HostKeyPolicy,
    connect_timeout_s: float,
    ssh: SshConfig,
) -> asyncssh.SSHClientConnection:
    keys = [str(host.identity_file)] if host.identity_file else ()
    conn, _ = await asyncssh.create_connection(
        lambda: policy,
        host.address,
        port=host.ssh_port,
        username=host.user,
        # A callable, not the SSHKnownHosts object: asyncssh treats an empty (falsy) value as
        # "use ~/.ssh/known_hosts", which would check against the wrong file.
        known_hosts=lambda h, a, p: known.match(h, a, p),
        client_keys=keys,
        agent_forwarding=False,
        config=[],
        connect_timeout=connect_timeout_s,
        keepalive_interval=ssh.keepalive_interval_s,
        keepalive_count_max=ssh.keepalive_count_max,
    )
    return conn


def _auth_message(host: HostConfig) -> str:
    key = host.identity_file or "the default keys (~/.ssh/id_*, SSH agent)"
    return (
        f"{host.user}@{host.label} refused the client key {key}; add its public key to that "
        "user's ~/.ssh/authorized_keys or set identity_file in cluster.toml."
    )


def _unreachable_message(host: HostConfig, e: BaseException, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):
        reason = f"no SSH handshake within {timeout_s:g} s"
    else:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return (
        f"cannot open SSH to {host.label} ({reason}); check that the host is up, that sshd "
        "listens on that port, and that no firewall blocks it."
    )


def host_label(conn: asyncssh.SSHClientConnection) -> str:
    label = conn.get_extra_info(_HOST_LABEL)
    if label:
        return label
    peer = conn.get_extra_info("peername") or ("?", 0)
    return f"{peer[0]}:{peer[1]}"


async def run(
    conn: asyncssh.SSHClientConnection,
    command: str,
    check: bool = True,
    timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
) -> str:
    """Run a shell command on the host and return its stdout.

    With check, a non-zero exit raises RemoteCommandError with the status and stderr's tail;
    a command running past timeout_s always raises it. A connection or session that dies under
    the command raises HostLostError.
    """
    during = f"while running {_short(command, 60)}"
    try:
        result = await conn.run(command, check=False, timeout=timeout_s)
    except asyncssh.TimeoutError as e:
        raise _command_error(conn, command, f"ran past {timeout_s:g} s", None, e.stderr) from None
    except (OSError, asyncssh.Error) as e:
        raise lost(conn, during, e) from None
    if result.exit_status is None and result.exit_signal is None:  # the channel just closed
        raise HostLostError(host_label(conn), during, "the session ended without an exit status")
    if check and result.exit_status != 0:
        status = result.exit_status
        how = f"exited {status}" if status not in (None, -1) else f"killed by {result.exit_signal}"
        raise _command_error(conn, command, how, result.exit_status, result.stderr)
    return _text(result.stdout)


def _command_error(
    conn: asyncssh.SSHClientConnection,
    command: str,
    how: str,
    exit_status: int | None,
    stderr: str | bytes | None,
) -> RemoteCommandError:
    tail = _text(stderr)[-STDERR_TAIL_CHARS:].strip()
    message = f"{_short(command)} on {host_label(conn)} {how}"
    message += f": {tail}" if tail else " (no stderr)."
    return RemoteCommandError(message, exit_status, tail)


def _short(command: str, limit: int = 120) -> str:
    return shlex.quote(command if len(command) <= limit else command[: limit - 3] + "...")


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data or ""


class SftpSession:
    """An SFTP session on `conn` whose every request is bounded: `await sftp(sftp.client.stat(p))`.

    A request left unanswered for stall_timeout_s (a hung disk or sftp-server on a host that
    still answers keepalives) raises HostLostError; that, or a cancellation (Ctrl-C) with
    abort_on_cancel, aborts the whole SSH connection first. Closing a file or the channel
    politely would wait on a host that may no longer answer, and after a stall nothing more
    would come through that connection anyway. Without abort_on_cancel (the connection is still
    needed afterwards, to stop ranks) a cancelled request is cancelled alone.
    """

    def __init__(
        self,
        conn: asyncssh.SSHClientConnection,
        stall_timeout_s: float,
        abort_on_cancel: bool = True,
    ) -> None:
        self.conn = conn
        self.stall_timeout_s = stall_timeout_s
        self.abort_on_cancel = abort_on_cancel
        self.aborted = False
        self._client: asyncssh.SFTPClient | None = None

    @property
    def client(self) -> asyncssh.SFTPClient:
        assert self._client is not None, "used outside `async with`"
        return self._client

    async def __aenter__(self) -> Self:
        self._client = await self(self.conn.start_sftp_client())
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.aborted:
            with contextlib.suppress(OSError, asyncssh.Error):  # a channel already gone
                self.client.exit()  # EOF ends the server's side; nothing here waits for it

    async def __call__(self, request: Awaitable[T]) -> T:
        task = asyncio.ensure_future(request)
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.stall_timeout_s)
        except TimeoutError:
            await self._abort(task)
            reason = f"no answer to an SFTP request for {self.stall_timeout_s:g} s"
            raise HostLostError(host_label(self.conn), "during a transfer", reason) from None
        except asyncio.CancelledError:
            if not self.abort_on_cancel:
                task.cancel()
                raise
            await self._abort(task)
            raise

    @contextlib.asynccontextmanager
    async def open(
        self, path: str, flags: int, attrs: asyncssh.SFTPAttrs | None = None
    ) -> AsyncIterator[asyncssh.SFTPClientFile]:
        """A remote file in binary mode, closed on exit unless the connection was aborted."""
        f = await self(self.client.open(path, flags, attrs or asyncssh.SFTPAttrs(), encoding=None))
        try:
            yield f
        except asyncio.CancelledError:
            if self.abort_on_cancel:
                await self._abort()
            raise
        except BaseException:
            if not self.aborted:  # the error that got here is the one to report
                with contextlib.suppress(Exception):
                    await self(f.close())
            raise
        await self(f.close())

    async def write(self, f: asyncssh.SFTPClientFile, data: bytes, offset: int) -> None:
        """Write data at offset, as one request under the stall limit made of parallel writes
        no larger than the server accepts. Split here, not by asyncssh: its own split abandons
        the other writes when one fails on a lost connection, and they then fail unobserved."""
        block = self.client.limits.max_write_len or SAFE_WRITE_BYTES
        await self(_write_blocks(f, data, offset, block))

    async def _abort(self, task: asyncio.Future | None = None) -> None:
        """Abort the connection, then let the request in flight end by itself, which it does at
        once. Cancelled instead, a large write would leave behind the parallel requests it is
        made of, and they would fail later with nobody to observe it."""
        self.aborted = True
        self.conn.abort()
        if task is None:
            return
        await asyncio.wait([task], timeout=ABORT_WAIT_S)
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # the lost connection, which the caller reports


async def _write_blocks(f: asyncssh.SFTPClientFile, data: bytes, offset: int, block: int) -> None:
    writes = [f.write(data[i : i + block], offset + i) for i in range(0, len(data), block)]
    results = await asyncio.gather(*writes, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
