"""orbit.cluster.ssh and orbit.cluster.push against a real OpenSSH sshd (tests/sshd.py): host-key policy,
errors, and pushing a package into the host's content-addressed store."""

from __future__ import annotations

import hashlib
import itertools
import random
import socket
import time
from dataclasses import replace
from pathlib import Path

import asyncssh
import pytest

from orbit.cluster import push as push_module
from orbit.cluster.push import PushError, push_package, shell_path
from orbit.cluster.ssh import (
    AuthenticationError,
    HostKeyChangedError,
    HostKeyUnknownError,
    HostUnreachableError,
    RemoteCommandError,
    append_known_host,
    connect,
    run,
)
from proto import package_pb2
from runtime.package import PackageError, shard_path
from tests.sshd import TestHost, free_port, keygen, ssh_host  # noqa: F401

TIMEOUT_S = 5.0
TOKENIZER_SIZES = {"tokenizer/tokenizer.json": 40_000, "tokenizer/tokenizer_config.json": 700}
SHARD_SIZES = (900_000, 1_100_000)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    return make_fake_package(tmp_path_factory.mktemp("package"))


def make_fake_package(root: Path, tokenizer_sha256: dict[str, str] | None = None) -> Path:
    """A package dir with random bytes for files and a manifest listing 2 shards."""
    rng = random.Random(0)
    manifest = package_pb2.Manifest(format_version=1, tp_size=len(SHARD_SIZES), dtype="float32")
    for rel, size in TOKENIZER_SIZES.items():
        entry = _write(root, rel, rng.randbytes(size))
        if tokenizer_sha256 and rel in tokenizer_sha256:
            entry.sha256 = tokenizer_sha256[rel]
        manifest.tokenizer.files.append(entry)
    for rank, size in enumerate(SHARD_SIZES):
        entry = _write(root, shard_path(rank, len(SHARD_SIZES)), rng.randbytes(size))
        manifest.shards.append(package_pb2.Shard(rank=rank, file=entry))
    (root / "manifest.pb").write_bytes(manifest.SerializeToString())
    return root


def _write(root: Path, rel: str, data: bytes) -> package_pb2.FileEntry:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
    return package_pb2.FileEntry(
        path=rel, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
    )


def manifest_of(package: Path) -> package_pb2.Manifest:
    return package_pb2.Manifest.FromString((package / "manifest.pb").read_bytes())


def digest_of(package: Path) -> str:
    return hashlib.sha256((package / "manifest.pb").read_bytes()).hexdigest()


def needed_files(package: Path, ranks: list[int]) -> list[str]:
    m = manifest_of(package)
    return ["manifest.pb", *(e.path for e in m.tokenizer.files)] + [
        m.shards[r].file.path for r in ranks
    ]


def needed_bytes(package: Path, ranks: list[int]) -> int:
    return sum((package / rel).stat().st_size for rel in needed_files(package, ranks))


def blob(workdir: Path, package: Path, rel: str) -> Path:
    sha = hashlib.sha256((package / rel).read_bytes()).hexdigest()
    return workdir / "store" / "sha256" / sha


def listing(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}


@pytest.fixture
async def conn(ssh_host: TestHost):  # noqa: F811
    connection = await connect(ssh_host.host_config(), False, TIMEOUT_S)
    yield connection
    connection.close()
    await connection.wait_closed()


# --- connect and run -----------------------------------------------------------------------


async def test_connect_with_known_host_key(ssh_host: TestHost):  # noqa: F811
    async with await connect(ssh_host.host_config(), False, TIMEOUT_S) as connection:
        assert await run(connection, "echo hello; id -un") == f"hello\n{ssh_host.user}\n"


@pytest.mark.parametrize("file_exists", [True, False])
async def test_unknown_host_key_is_refused(ssh_host: TestHost, tmp_path, file_exists):  # noqa: F811
    known_hosts = tmp_path / "known_hosts"
    if file_exists:
        known_hosts.write_text("")
    host = ssh_host.host_config(known_hosts=known_hosts)
    with pytest.raises(HostKeyUnknownError) as e:
        await connect(host, False, TIMEOUT_S)
    assert str(e.value) == (
        f"host key for {ssh_host.address}:{ssh_host.port} is not in {known_hosts}; "
        "pass --accept-new-host-keys to trust it on first use."
    )
    assert known_hosts.exists() == file_exists
    assert not file_exists or known_hosts.read_text() == ""


async def test_accept_new_appends_the_key_then_it_is_known(ssh_host: TestHost, tmp_path):  # noqa: F811
    known_hosts = tmp_path / "new" / "known_hosts"
    other = f"{ssh_host.address}-other ssh-ed25519 {'A' * 68}"
    known_hosts.parent.mkdir()
    known_hosts.write_text(other)  # no final newline: the new line must not join it
    host = ssh_host.host_config(known_hosts=known_hosts)
    async with await connect(host, True, TIMEOUT_S) as connection:
        assert await run(connection, "echo ok") == "ok\n"
    assert known_hosts.read_text() == f"{other}\n{ssh_host.known_hosts_line}\n"
    async with await connect(host, False, TIMEOUT_S) as connection:
        assert await run(connection, "echo again") == "again\n"
    assert known_hosts.read_text() == f"{other}\n{ssh_host.known_hosts_line}\n"


async def test_changed_host_key_is_refused_even_with_accept_new(ssh_host: TestHost, tmp_path):  # noqa: F811
    impostor = keygen(tmp_path / "impostor", "another host key")
    pattern = ssh_host.known_hosts_line.split()[0]
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"{pattern} {' '.join(impostor.split()[:2])}\n")
    before = known_hosts.read_text()
    with pytest.raises(
        HostKeyChangedError, match=rf"^host key for {ssh_host.address}:\d+ has changed"
    ):
        await connect(ssh_host.host_config(known_hosts=known_hosts), True, TIMEOUT_S)
    assert known_hosts.read_text() == before


async def test_wrong_client_key_is_an_authentication_error(ssh_host: TestHost, tmp_path):  # noqa: F811
    keygen(tmp_path / "stranger", "not authorized")
    host = ssh_host.host_config(identity_file=tmp_path / "stranger")
    with pytest.raises(AuthenticationError, match=f"{ssh_host.user}@{ssh_host.address}:"):
        await connect(host, False, TIMEOUT_S)


async def test_missing_identity_file_is_named(ssh_host: TestHost, tmp_path):  # noqa: F811
    host = ssh_host.host_config(identity_file=tmp_path / "nope")
    with pytest.raises(AuthenticationError, match=f"identity_file {tmp_path / 'nope'} for"):
        await connect(host, False, TIMEOUT_S)


def test_known_hosts_lines_name_non_default_ports_like_openssh(tmp_path):
    key = asyncssh.generate_private_key("ssh-ed25519")
    public = key.export_public_key("openssh").decode().split()
    path = tmp_path / "ssh" / "known_hosts"
    append_known_host(path, "10.0.0.1", 2222, key)
    append_known_host(path, "10.0.0.2", 22, key)
    assert path.read_text() == (
        f"[10.0.0.1]:2222 {public[0]} {public[1]}\n10.0.0.2 {public[0]} {public[1]}\n"
    )
    assert path.parent.stat().st_mode & 0o777 == 0o700


async def test_closed_port_fails_fast_naming_the_host(ssh_host: TestHost):  # noqa: F811
    # Inside the host's namespace only port 22 listens; on loopback, a port just found free.
    port = 23 if ssh_host.netns else free_port(ssh_host.address)
    start = time.monotonic()
    with pytest.raises(HostUnreachableError, match=f"cannot open SSH to {ssh_host.address}:{port}"):
        await connect(ssh_host.host_config(ssh_port=port), False, TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S


async def test_silent_host_times_out_naming_the_host(ssh_host: TestHost):  # noqa: F811
    with socket.socket() as listener:  # accepts TCP (kernel backlog) but never speaks SSH
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        host = replace(ssh_host.host_config(), address="127.0.0.1", ssh_port=port)
        start = time.monotonic()
        with pytest.raises(HostUnreachableError, match=f"cannot open SSH to 127.0.0.1:{port}"):
            await connect(host, False, connect_timeout_s=1.0)
        assert time.monotonic() - start < 3.0


async def test_run_failure_carries_status_and_stderr(conn):
    with pytest.raises(RemoteCommandError) as e:
        await run(conn, "echo partial; echo 'disk full' >&2; exit 3")
    assert e.value.exit_status == 3
    assert e.value.stderr_tail == "disk full"
    assert "exited 3: disk full" in str(e.value)
    assert await run(conn, "echo partial; exit 3", check=False) == "partial\n"


async def test_run_timeout_is_a_command_error(conn):
    start = time.monotonic()
    with pytest.raises(RemoteCommandError, match="ran past 0.5 s"):
        await run(conn, "sleep 10", timeout_s=0.5)
    assert time.monotonic() - start < 5


async def test_shell_path_expands_the_remote_home(conn):
    home = (await run(conn, 'printf %s "$HOME"')).strip()
    assert await run(conn, f"printf %s {shell_path('~/a b')}") == f"{home}/a b"
    assert await run(conn, f"printf %s {shell_path('/x/$y')}") == "/x/$y"


# --- push ----------------------------------------------------------------------------------


async def test_push_places_only_the_hosts_shards(conn, ssh_host, package):  # noqa: F811
    workdir = ssh_host.new_workdir("only-rank-1")
    calls: list[tuple[int, int]] = []
    result = await push_package(conn, package, str(workdir), [1], lambda d, t: calls.append((d, t)))

    package_dir = workdir / "packages" / digest_of(package)
    assert result.remote_dir == str(package_dir.resolve())
    assert listing(package_dir) == set(needed_files(package, [1]))
    for rel in needed_files(package, [1]):
        assert (package_dir / rel).is_symlink()
        assert (package_dir / rel).read_bytes() == (package / rel).read_bytes()
    assert not blob(workdir, package, shard_path(0, 2)).exists()
    assert len(listing(workdir / "store")) == len(needed_files(package, [1]))  # no .part left
    assert [p.name for p in (workdir / "packages").iterdir()] == [digest_of(package)]
    total = needed_bytes(package, [1])
    assert (result.bytes_uploaded, result.files_uploaded, result.files_skipped) == (total, 4, 0)
    assert calls[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))


async def test_push_again_uploads_nothing(conn, ssh_host, package):  # noqa: F811
    workdir = str(ssh_host.new_workdir("twice"))
    await push_package(conn, package, workdir, [1], None)
    calls: list[tuple[int, int]] = []
    again = await push_package(conn, package, workdir, [1], lambda d, t: calls.append((d, t)))
    assert (again.bytes_uploaded, again.files_uploaded, again.files_skipped) == (0, 0, 4)
    assert calls[-1] == (needed_bytes(package, [1]),) * 2


async def test_push_of_other_ranks_adds_their_links(conn, ssh_host, package):  # noqa: F811
    workdir = ssh_host.new_workdir("add-rank-0")
    await push_package(conn, package, str(workdir), [1], None)
    result = await push_package(conn, package, str(workdir), [0], None)
    assert result.bytes_uploaded == (package / shard_path(0, 2)).stat().st_size
    package_dir = workdir / "packages" / digest_of(package)
    assert listing(package_dir) == set(needed_files(package, [0, 1]))
    assert (package_dir / shard_path(0, 2)).read_bytes() == (
        package / shard_path(0, 2)
    ).read_bytes()


async def test_interrupted_upload_resumes_from_the_part(conn, ssh_host, package, monkeypatch):  # noqa: F811
    monkeypatch.setattr(push_module, "UPLOAD_CHUNK_BYTES", 64 * 1024)  # several chunks per file
    workdir = ssh_host.new_workdir("resume")
    shard = shard_path(1, 2)
    done_bytes = 300_001
    part = Path(f"{blob(workdir, package, shard)}.part")
    part.parent.mkdir(parents=True)
    part.write_bytes((package / shard).read_bytes()[:done_bytes])

    result = await push_package(conn, package, str(workdir), [1], None)
    assert result.bytes_uploaded == needed_bytes(package, [1]) - done_bytes
    assert blob(workdir, package, shard).read_bytes() == (package / shard).read_bytes()
    assert not part.exists()


async def test_damaged_part_is_uploaded_again_from_the_start(conn, ssh_host, package):  # noqa: F811
    workdir = ssh_host.new_workdir("bad-part")
    shard = shard_path(1, 2)
    part = Path(f"{blob(workdir, package, shard)}.part")
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)  # not a prefix of the shard

    result = await push_package(conn, package, str(workdir), [1], None)
    shard_bytes = (package / shard).stat().st_size
    assert result.bytes_uploaded == needed_bytes(package, [1]) - 1000 + shard_bytes
    assert blob(workdir, package, shard).read_bytes() == (package / shard).read_bytes()


async def test_corrupted_blob_is_detected_and_pushed_again(conn, ssh_host, package):  # noqa: F811
    workdir = str(ssh_host.new_workdir("corrupt"))
    await push_package(conn, package, workdir, [1], None)
    stored = blob(Path(workdir), package, shard_path(1, 2))
    data = bytearray(stored.read_bytes())
    data[12345] ^= 0x01
    ssh_host.run(f"printf '\\x{data[12345]:02x}' | dd of={stored} bs=1 seek=12345 conv=notrunc")
    assert hashlib.sha256(stored.read_bytes()).hexdigest() != stored.name

    result = await push_package(conn, package, workdir, [1], None)
    assert (result.bytes_uploaded, result.files_uploaded) == (SHARD_SIZES[1], 1)
    assert hashlib.sha256(stored.read_bytes()).hexdigest() == stored.name


async def test_package_dir_appears_only_when_complete(conn, ssh_host, package):  # noqa: F811
    workdir = ssh_host.new_workdir("atomic")
    package_dir = workdir / "packages" / digest_of(package)
    seen_early: list[bool] = []

    def progress(done_bytes: int, total_bytes: int) -> None:
        seen_early.append(package_dir.exists())

    await push_package(conn, package, str(workdir), [0, 1], progress)
    assert seen_early and not any(seen_early)
    assert listing(package_dir) == set(needed_files(package, [0, 1]))
    assert [p.name for p in (workdir / "packages").iterdir()] == [package_dir.name]  # no .tmp-*


async def test_file_that_never_verifies_fails_and_publishes_nothing(conn, ssh_host, tmp_path):  # noqa: F811
    wrong = hashlib.sha256(b"something else").hexdigest()
    bad = make_fake_package(tmp_path / "bad", {"tokenizer/tokenizer_config.json": wrong})
    workdir = ssh_host.new_workdir("never-verifies")
    with pytest.raises(PushError, match="tokenizer/tokenizer_config.json arrived on .* twice"):
        await push_package(conn, bad, str(workdir), [0], None)
    assert list((workdir / "packages").iterdir()) == []
    assert not list((workdir / "store" / "sha256").glob("*.part"))


async def test_rank_without_a_shard_is_refused(conn, ssh_host, package):  # noqa: F811
    with pytest.raises(PackageError, match="rank 2 has no shard"):
        await push_package(conn, package, str(ssh_host.new_workdir("rank-2")), [2], None)
