"""The local record of a cluster that `orbit up` brought up: what runs where, and how to reach it.

`orbit up` writes one JSON file per cluster.toml once every rank is ready; `orbit serve
--cluster`, `status`, `logs` and `down` read it. It holds everything those commands need to
reach the ranks (SSH login, pids, files, endpoints), so `orbit down` stops what was started even
after cluster.toml has been edited. The file is local and written only by Orbit; it is never read
from a socket. It is replaced atomically (temp file + rename), so a reader never sees half of it.

Location: `orbit --state-dir DIR`, else ~/.cache/orbit/clusters, as <stem>-<hash>.json where the
hash is of cluster.toml's absolute path (two cluster.toml files with one name do not collide).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from orbit.cluster.config import HostConfig
from orbit.cluster.ssh import ClusterError

STATE_FORMAT_VERSION = 1


class ClusterStateError(ClusterError):
    """The state record is missing or cannot be read."""


@dataclass(frozen=True)
class HostRecord:
    """One host as it was reached at bring-up."""

    index: int  # position in cluster.toml's [[hosts]]
    address: str
    ssh_port: int
    user: str
    identity_file: str | None
    known_hosts: str
    workdir: str  # absolute on the host
    package_dir: str  # {workdir}/packages/<digest>
    run_dir: str  # {workdir}/run/<digest[:12]>: pid and log files

    @property
    def label(self) -> str:
        return f"{self.address}:{self.ssh_port}"

    @property
    def curve_dir(self) -> str:
        """The ranks' CURVE keys on the host: their client pair and the frontend's public key."""
        return f"{self.run_dir}/curve"

    def host_config(self) -> HostConfig:
        """What orbit.cluster.ssh.connect needs; the launch settings of the host do not matter here."""
        identity = Path(self.identity_file) if self.identity_file else None
        return HostConfig(
            address=self.address,
            ssh_port=self.ssh_port,
            user=self.user,
            identity_file=identity,
            known_hosts=Path(self.known_hosts),
            workdir=self.workdir,
        )


@dataclass(frozen=True)
class RankRecord:
    rank: int
    host_index: int
    local_gpu_index: int
    pid: int  # in the host's pid namespace
    pid_file: str
    log_file: str


@dataclass(frozen=True)
class ClusterState:
    config_path: str  # absolute path of cluster.toml
    package_path: str  # the local package directory
    package_digest: str  # sha256 of manifest.pb
    # Hash of every setting that shapes the launch (hosts, GPUs, env, KV options): `orbit up`
    # with the same digest and fingerprint and all ranks alive is a no-op.
    launch_fingerprint: str
    tp_size: int
    frontend_address: str
    frontend_port: int  # where the ranks' DEALERs connect; `orbit serve --cluster` binds it
    dist_init: str  # torch.distributed init method, tcp://<rank 0's host>:<port>
    # Local CURVE keys of this bring-up (runtime/curve.py layout); serve binds with its server pair.
    curve_dir: str
    started_at: float  # Unix time the ranks were started
    hosts: tuple[HostRecord, ...]
    ranks: tuple[RankRecord, ...]
    format_version: int = STATE_FORMAT_VERSION

    @property
    def frontend_endpoint(self) -> str:
        return f"tcp://{self.frontend_address}:{self.frontend_port}"

    def host_of(self, rank: RankRecord) -> HostRecord:
        return self.hosts[rank.host_index]

    def ranks_on(self, host_index: int) -> list[RankRecord]:
        return [r for r in self.ranks if r.host_index == host_index]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        data = json.loads(text)
        if data.get("format_version") != STATE_FORMAT_VERSION:
            raise ValueError(f"format_version {data.get('format_version')!r} is not readable")
        data["hosts"] = tuple(HostRecord(**h) for h in data["hosts"])
        data["ranks"] = tuple(RankRecord(**r) for r in data["ranks"])
        return cls(**data)


_state_dir = Path("~/.cache/orbit/clusters").expanduser()


def use_state_dir(path: Path | str) -> None:
    """Set once by the CLI's --state-dir (Orbit reads no environment variable for it)."""
    global _state_dir
    _state_dir = Path(path).expanduser()


def state_dir() -> Path:
    return _state_dir


def state_path(config_path: Path | str) -> Path:
    absolute = Path(config_path).absolute()
    tag = hashlib.sha256(str(absolute).encode()).hexdigest()[:12]
    return state_dir() / f"{absolute.stem}-{tag}.json"


def load_state(config_path: Path | str) -> ClusterState | None:
    """The record for this cluster.toml, or None when no cluster is recorded for it."""
    return read_state_file(state_path(config_path))


def read_state_file(path: Path) -> ClusterState | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ClusterStateError(f"{path}: cannot be read ({e.strerror}).") from e
    try:
        return ClusterState.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise ClusterStateError(
            f"{path}: is not a cluster state record this Orbit can read ({e}); stop the ranks "
            "it lists by hand if any still run, then delete the file."
        ) from e


def save_state(state: ClusterState) -> Path:
    """Write the record atomically; returns its path."""
    path = state_path(state.config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def curve_key_dir(config_path: Path | str) -> Path:
    """Where `orbit up` keeps the cluster's CURVE keys: private, beside the record."""
    return state_path(config_path).with_suffix(".curve")


def remove_state(config_path: Path | str) -> None:
    """Forget the cluster: its record and its CURVE keys."""
    state_path(config_path).unlink(missing_ok=True)
    shutil.rmtree(curve_key_dir(config_path), ignore_errors=True)


@contextlib.contextmanager
def cluster_lock(config_path: Path | str) -> Iterator[None]:
    """Held by `orbit up` and `orbit down` for one cluster.toml: two of them at once would
    start or stop ranks behind each other's back. Not waited for: the second one fails."""
    path = state_path(config_path).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterStateError(
                f"another `orbit up` or `orbit down` for {config_path} is running; wait for it "
                "to finish."
            ) from None
        yield  # the lock is released when the file closes


def all_states() -> list[ClusterState]:
    """Every recorded cluster, for `orbit status` without an argument."""
    folder = state_dir()
    if not folder.is_dir():
        return []
    states = (read_state_file(p) for p in sorted(folder.glob("*.json")))
    return [s for s in states if s is not None]
