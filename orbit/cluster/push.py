"""Push a package to a host's content-addressed store over SFTP, resuming partial uploads.

Remote layout under the host's workdir (resolved to an absolute path first):
    store/sha256/<hex>          a blob, named by the SHA-256 of its bytes
    store/sha256/<hex>.part     an upload in progress; the next push continues from its size
    packages/<digest>/...       the package's relative paths as relative symlinks to blobs,
                                digest = sha256(manifest.pb), i.e. runtime.package's digest
    packages/.tmp-<digest>-<n>  the same while it is being built

How a push works:
1. Every blob the host needs is hashed on the host with sha256sum, on every push. A `.verified`
   marker would be cheaper but would keep trusting a blob that was edited or rotted after it was
   written; hashing costs about a second per GB, all files in parallel, and ranks read these
   blobs right after anyway. A blob with the wrong hash is deleted.
2. Each missing blob is written to <hex>.part starting at the .part's current size, hashed on
   the host, and renamed into place (posix-rename: a blob name never holds partial bytes). On a
   mismatch the .part is deleted and the file uploaded once more from the start; a second
   mismatch fails the push (the local file no longer matches its manifest).
3. The package directory is built under a temporary name and renamed when every blob is in
   place, so packages/<digest> never lists a file that is not complete and verified. If it
   already exists (another set of ranks was pushed to this workdir before), the links it lacks
   are added, each made under a temporary name and renamed.
Run one push per host and workdir at a time: two pushes of one blob would share its .part.

Every remote step is bounded (orbit/cluster/ssh.py): commands by their timeouts, each SFTP request (an
8 MiB write, a rename) by [ssh] stall_timeout_s, the connection by its keepalives. A push has no
overall deadline: a large package takes as long as its bytes take.
"""

from __future__ import annotations

import asyncio
import hashlib
import posixpath
import re
import secrets
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import asyncssh

from orbit.cluster.config import DEFAULT_STALL_TIMEOUT_S
from orbit.cluster.ssh import (
    SFTP_LOST,
    ClusterError,
    HostLostError,
    SftpSession,
    host_label,
    reason_of,
    run,
)
from proto import package_pb2
from runtime.package import MANIFEST_NAME, PackageError, read_manifest
from runtime.signing import SIGNATURE_NAME

ProgressFn = Callable[[int, int], None]  # (bytes_done, bytes_total) of this host's files
UPLOAD_CHUNK_BYTES = 8 << 20  # one request under the stall limit, sent as parallel writes
HASH_TIMEOUT_S = 60.0
HASH_TIMEOUT_S_PER_GB = 30.0  # generous: sha256sum reads at several hundred MB/s
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
PUSH_LOST_FIX = (
    "check that the host is up and reachable, then run `orbit up` again: the push resumes where "
    "it stopped"
)


class PushError(ClusterError):
    """A package file could not be placed on a host intact."""


@dataclass(frozen=True)
class PushFile:
    """One file of the package that a host needs."""

    path: str  # relative to the package root, '/'-separated
    size_bytes: int
    sha256: str
    local: Path


@dataclass(frozen=True)
class PushResult:
    remote_dir: str  # absolute: {workdir}/packages/<digest>
    bytes_uploaded: int  # bytes sent this push, counting a retried file twice
    files_uploaded: int
    files_skipped: int  # already in the store, verified


@dataclass(frozen=True)
class RemoteLayout:
    workdir: str  # absolute path on the host

    @property
    def store(self) -> str:
        return posixpath.join(self.workdir, "store", "sha256")

    @property
    def packages(self) -> str:
        return posixpath.join(self.workdir, "packages")

    def blob(self, sha256: str) -> str:
        return posixpath.join(self.store, sha256)

    def part(self, sha256: str) -> str:
        return self.blob(sha256) + ".part"

    def package_dir(self, digest: str) -> str:
        return posixpath.join(self.packages, digest)


async def push_package(
    conn: asyncssh.SSHClientConnection,
    package_dir: Path,
    workdir: str,
    ranks: Sequence[int],
    progress: ProgressFn | None = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> PushResult:
    """Place the manifest, tokenizer files and the shards of `ranks` on the host.

    The caller checks the local package first (runtime.package.open_package); this checks
    each file's size locally and its SHA-256 on the host. Returns where the package is visible.
    A host lost during the push (silent past the keepalives, an SFTP request unanswered for
    stall_timeout_s, a dead session) raises HostLostError naming it, whatever step it was in;
    what was uploaded stays in the store for the next push.
    """
    files = files_to_push(Path(package_dir), ranks)
    try:
        return await _push(conn, files, workdir, progress, stall_timeout_s)
    except HostLostError as e:
        raise HostLostError(e.host, "during the push", e.reason, PUSH_LOST_FIX) from None
    except SFTP_LOST as e:
        raise _push_lost(conn, e) from None
    except asyncssh.SFTPError as e:
        raise PushError(
            f"writing under {workdir} on {host_label(conn)} failed ({e.reason}); check the free "
            "space and permissions there."
        ) from None
    except (OSError, asyncssh.Error) as e:  # the connection or the SFTP channel went away
        raise _push_lost(conn, e) from None


def _push_lost(conn: asyncssh.SSHClientConnection, e: BaseException) -> HostLostError:
    return HostLostError(host_label(conn), "during the push", reason_of(e), PUSH_LOST_FIX)


async def _push(
    conn: asyncssh.SSHClientConnection,
    files: list[PushFile],
    workdir: str,
    progress: ProgressFn | None,
    stall_timeout_s: float,
) -> PushResult:
    digest = files[0].sha256  # the manifest's own hash names the package
    layout = RemoteLayout(await prepare_workdir(conn, workdir))
    tracker = _Progress(sum(f.size_bytes for f in files), progress)
    stored = await _hash_blobs(conn, layout, files)
    async with SftpSession(conn, stall_timeout_s) as sftp:
        bytes_uploaded, files_uploaded = await _place_blobs(sftp, layout, files, stored, tracker)
        remote_dir = await _publish(sftp, layout, digest, files)
    return PushResult(remote_dir, bytes_uploaded, files_uploaded, len(files) - files_uploaded)


def files_to_push(package_dir: Path, ranks: Sequence[int]) -> list[PushFile]:
    """The manifest (and its signature, if any) first, then tokenizer files, then the shards
    of `ranks`."""
    manifest = read_manifest(package_dir)
    manifest_path = package_dir / MANIFEST_NAME
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    files = [PushFile(MANIFEST_NAME, manifest_path.stat().st_size, digest, manifest_path)]
    signature = package_dir / SIGNATURE_NAME  # not listed in the manifest: it signs it
    if signature.is_file():
        data = signature.read_bytes()
        files.append(
            PushFile(SIGNATURE_NAME, len(data), hashlib.sha256(data).hexdigest(), signature)
        )
    files += [_push_file(package_dir, e) for e in manifest.tokenizer.files]
    for rank in sorted(set(ranks)):
        if not 0 <= rank < len(manifest.shards):
            raise PackageError(
                f"{manifest_path}: rank {rank} has no shard (the package has "
                f"{len(manifest.shards)}); check cluster.toml's gpus against the package's tp."
            )
        files.append(_push_file(package_dir, manifest.shards[rank].file))
    return files


def _push_file(package_dir: Path, entry: package_pb2.FileEntry) -> PushFile:
    where = package_dir / MANIFEST_NAME
    rel = PurePosixPath(entry.path)
    if not entry.path or rel.is_absolute() or ".." in rel.parts:
        raise PackageError(f"{where}: file path {entry.path!r} escapes the package.")
    if not _SHA256_HEX.fullmatch(entry.sha256):
        raise PackageError(f"{where}: {entry.path} has sha256 {entry.sha256!r}, not 64 hex digits.")
    local = package_dir / rel
    size = local.stat().st_size if local.is_file() else None
    if size != entry.size_bytes:
        raise PackageError(
            f"{local}: is {'missing' if size is None else f'{size} bytes'}, the manifest says "
            f"{entry.size_bytes} bytes; copy the package again."
        )
    return PushFile(entry.path, entry.size_bytes, entry.sha256, local)


def shell_path(path: str) -> str:
    """Quote a remote path for sh, expanding a leading "~" to the remote $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


async def prepare_workdir(conn: asyncssh.SSHClientConnection, workdir: str) -> str:
    """Create the store and packages folders; return the workdir as an absolute path."""
    w = shell_path(workdir)
    command = f"mkdir -p -- {w}/store/sha256 {w}/packages && cd -- {w} && pwd -P"
    return (await run(conn, command)).strip()


class _Progress:
    """Bytes of this host's files that are in place or on the way; fed to the callback."""

    def __init__(self, total_bytes: int, callback: ProgressFn | None) -> None:
        self.done_bytes = 0
        self.total_bytes = total_bytes
        self._callback = callback

    def advance(self, num_bytes: int) -> None:
        self.done_bytes += num_bytes
        if self._callback:
            self._callback(self.done_bytes, self.total_bytes)


async def remote_sha256(
    conn: asyncssh.SSHClientConnection, path: str, size_bytes: int = 0
) -> str | None:
    """The file's SHA-256 on the host, or None when it does not exist."""
    p = shlex.quote(path)
    command = f"if [ -f {p} ]; then sha256sum -- {p}; fi"
    out = await run(conn, command, timeout_s=_hash_timeout_s(size_bytes))
    return out.split()[0] if out.strip() else None


async def _hash_blobs(
    conn: asyncssh.SSHClientConnection, layout: RemoteLayout, files: list[PushFile]
) -> dict[str, str | None]:
    """sha256 of each needed blob as stored now (None: absent or unreadable).

    One remote command hashes them all in parallel: each SSH session costs a round trip and
    a login shell, which add up over hosts and files.
    """
    names = " ".join(sorted({f.sha256 for f in files}))  # validated hex: safe unquoted
    script = f'for f in {names}; do if [ -f "$f" ]; then sha256sum -- "$f" & fi; done; wait'
    total_bytes = sum(f.size_bytes for f in files)
    out = await run(
        conn,
        f"cd -- {shlex.quote(layout.store)} && {script}",
        timeout_s=_hash_timeout_s(total_bytes),
    )
    found = _parse_sha256sum(out)
    return {f.sha256: found.get(f.sha256) for f in files}


def _parse_sha256sum(out: str) -> dict[str, str]:
    """sha256sum's "<hex>  <name>" lines as {name: hex}."""
    pairs = (line.split(maxsplit=1) for line in out.splitlines() if line.strip())
    return {name.strip(): digest for digest, name in pairs}


def _hash_timeout_s(size_bytes: int) -> float:
    return HASH_TIMEOUT_S + HASH_TIMEOUT_S_PER_GB * size_bytes / 1e9


async def _place_blobs(
    sftp: SftpSession,
    layout: RemoteLayout,
    files: list[PushFile],
    stored: dict[str, str | None],
    tracker: _Progress,
) -> tuple[int, int]:
    """Upload every blob not stored intact; return (bytes uploaded, files uploaded)."""
    placed = {sha for sha, stored_sha in stored.items() if stored_sha == sha}
    bytes_uploaded = files_uploaded = 0
    for f in files:
        if f.sha256 in placed:  # intact on the host, or a duplicate already sent
            tracker.advance(f.size_bytes)
            continue
        if stored[f.sha256] is not None:  # damaged in place: replace it
            await sftp(sftp.client.remove(layout.blob(f.sha256)))
        bytes_uploaded += await _upload_blob(sftp, layout, f, tracker)
        files_uploaded += 1
        placed.add(f.sha256)
    return bytes_uploaded, files_uploaded


async def _upload_blob(
    sftp: SftpSession, layout: RemoteLayout, f: PushFile, tracker: _Progress
) -> int:
    """Upload f via its .part, verify it on the host, rename it in; return the bytes sent."""
    part = layout.part(f.sha256)
    uploaded = 0
    for _attempt in range(2):
        uploaded += await _upload_part(sftp, part, f, tracker)
        if await remote_sha256(sftp.conn, part, f.size_bytes) == f.sha256:
            await sftp(sftp.client.posix_rename(part, layout.blob(f.sha256)))
            return uploaded
        await sftp(sftp.client.remove(part))
        tracker.advance(-f.size_bytes)
    raise PushError(
        f"{f.path} arrived on {host_label(sftp.conn)} with a different sha256 twice; the local "
        f"file {f.local} may no longer match its manifest (check it with runtime.package's "
        "verify_file) or the host's disk is failing."
    )


async def _upload_part(sftp: SftpSession, part: str, f: PushFile, tracker: _Progress) -> int:
    """Write f to `part` from the part's current size on; return the bytes sent. Each chunk's
    write is one request under the stall limit."""
    offset = await _part_size(sftp, part, f.size_bytes)
    tracker.advance(offset)
    start = offset
    flags = asyncssh.FXF_WRITE | asyncssh.FXF_CREAT  # no truncation: the bytes there are kept
    async with sftp.open(part, flags) as remote:
        while offset < f.size_bytes:
            num_bytes = min(UPLOAD_CHUNK_BYTES, f.size_bytes - offset)
            chunk = await asyncio.to_thread(_read_chunk, f.local, offset, num_bytes)
            if not chunk:
                raise PackageError(f"{f.local}: shrank while being pushed; copy the package again.")
            await sftp.write(remote, chunk, offset)
            offset += len(chunk)
            tracker.advance(len(chunk))
    return offset - start


def _read_chunk(path: Path, offset: int, num_bytes: int) -> bytes:
    # Opened per chunk so the read runs in a worker thread, off the event loop.
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(num_bytes)
    except OSError as e:  # a local error: not to be taken for a lost connection
        raise PackageError(f"{path}: cannot be read ({e.strerror}).") from None


async def _part_size(sftp: SftpSession, part: str, size_bytes: int) -> int:
    """Bytes already uploaded; a .part longer than the file cannot be a prefix of it."""
    try:
        size = (await sftp(sftp.client.stat(part))).size or 0
    except asyncssh.SFTPNoSuchFile:
        return 0
    if size > size_bytes:
        await sftp(sftp.client.remove(part))
        return 0
    return size


async def _publish(
    sftp: SftpSession, layout: RemoteLayout, digest: str, files: list[PushFile]
) -> str:
    """Make packages/<digest> list `files`; every blob is verified before this runs."""
    final = layout.package_dir(digest)
    if not await sftp(sftp.client.exists(final)):
        tmp = posixpath.join(layout.packages, f".tmp-{digest}-{secrets.token_hex(4)}")
        try:
            await _add_links(sftp, layout, tmp, files)
            await sftp(sftp.client.posix_rename(tmp, final))
            return final
        except asyncssh.SFTPError:
            await sftp(sftp.client.rmtree(tmp, ignore_errors=True))
            if not await sftp(sftp.client.exists(final)):  # not lost to a concurrent push
                raise
    await _add_links(sftp, layout, final, files, atomic=True)
    return final


async def _add_links(
    sftp: SftpSession,
    layout: RemoteLayout,
    root: str,
    files: list[PushFile],
    atomic: bool = False,
) -> None:
    """Link each file's path under `root` to its blob, skipping links that exist.

    With atomic, each link is made under a temporary name and renamed, because `root` is
    already visible to ranks.
    """
    for f in files:
        link = posixpath.join(root, f.path)
        if await sftp(sftp.client.lexists(link)):
            continue
        await sftp(sftp.client.makedirs(posixpath.dirname(link), exist_ok=True))
        # Relative, so a link stays right when the tmp folder is renamed or the workdir moves.
        target = posixpath.relpath(layout.blob(f.sha256), posixpath.dirname(link))
        made = f"{link}.tmp-{secrets.token_hex(4)}" if atomic else link
        await sftp(sftp.client.symlink(target, made))
        if atomic:
            await sftp(sftp.client.posix_rename(made, link))
