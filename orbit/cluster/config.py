"""cluster.toml: which hosts run which ranks, how to reach them, and where the package is.

The file is parsed with tomllib into frozen dataclasses. Every error names the file, the line
and the field (`cluster.toml:7: hosts[1].gpus ...`); tomllib reports no line numbers for
values, so the line is found by scanning the text for the key inside its table (see _LineIndex).
The schema, with defaults, is documented in docs/cluster.md.
"""

from __future__ import annotations

import difflib
import getpass
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SSH_PORT = 22
DEFAULT_WORKDIR = "~/.orbit"
DEFAULT_PYTHON = "python3"
DEFAULT_FRONTEND_ADDRESS = "127.0.0.1"
DEFAULT_PORT_RANGE = (29500, 29600)
DEVICES = ("cuda", "cpu")
# [ssh] defaults, chosen for hosts on one LAN (docs/cluster.md, "[ssh]").
DEFAULT_KEEPALIVE_INTERVAL_S = 5.0
DEFAULT_KEEPALIVE_COUNT_MAX = 3
DEFAULT_STALL_TIMEOUT_S = 60.0

TOP_KEYS = ("package", "require_signature", "trusted_keys", "frontend", "ssh", "hosts")
FRONTEND_KEYS = ("address", "port_range")
SSH_KEYS = ("keepalive_interval_s", "keepalive_count_max", "stall_timeout_s")
HOST_KEYS = (
    "address",
    "ssh_port",
    "user",
    "identity_file",
    "known_hosts",
    "gpus",
    "workdir",
    "python",
    "nccl_interface",
    "device",
    "env",
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One table path element: a table or array-of-tables name, or an index into an array.
FieldPath = tuple[str | int, ...]


class ClusterConfigError(ValueError):
    """cluster.toml is missing, is not valid TOML, or breaks the schema (docs/cluster.md)."""


def default_known_hosts() -> Path:
    return Path("~/.ssh/known_hosts").expanduser()


@dataclass(frozen=True)
class FrontendConfig:
    # The address ranks use to reach the frontend; it must be reachable from every host.
    address: str = DEFAULT_FRONTEND_ADDRESS
    # Inclusive [start, end] of the ports the frontend may bind for rank traffic.
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE


@dataclass(frozen=True)
class SshConfig:
    """How long Orbit waits on hosts over SSH before it gives one up."""

    # Seconds without a byte from a host before an SSH keepalive is sent to it.
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    # Keepalives left unanswered before the connection counts as lost: a host that falls
    # silent (power, cable, firewall) is given up after interval x (count_max + 1) seconds.
    keepalive_count_max: int = DEFAULT_KEEPALIVE_COUNT_MAX
    # Longest wait for the answer to one SFTP request of a push (an 8 MiB write, a rename) on
    # a connection that still answers keepalives (a hung disk or sftp-server). A limit per
    # request, not per push: a large package takes as long as it takes.
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S

    @property
    def silence_limit_s(self) -> float:
        """How long a silent host takes to count as lost."""
        return self.keepalive_interval_s * (self.keepalive_count_max + 1)


@dataclass(frozen=True)
class HostConfig:
    """One machine of the cluster and how Orbit reaches it over SSH."""

    address: str
    ssh_port: int = DEFAULT_SSH_PORT
    user: str = field(default_factory=getpass.getuser)
    # None: asyncssh's default keys (~/.ssh/id_*) and the SSH agent.
    identity_file: Path | None = None
    # Host keys are always checked against this file; it is never skipped.
    known_hosts: Path = field(default_factory=default_known_hosts)
    # Local GPU index of each rank on this host, in rank order; on CPU hosts only the count matters.
    gpus: tuple[int, ...] = (0,)
    # Remote directory for the blob store, packages, pid and log files; "~" is the remote home.
    workdir: str = DEFAULT_WORKDIR
    python: str = DEFAULT_PYTHON
    # Pinned as NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME so collectives use the cluster network.
    nccl_interface: str | None = None
    device: str = "cuda"
    # Extra environment of the rank processes; excluded from hash() because dicts cannot hash.
    env: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def num_ranks(self) -> int:
        return len(self.gpus)

    @property
    def label(self) -> str:
        """How errors and progress bars name the host."""
        return f"{self.address}:{self.ssh_port}"


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    host_index: int
    # The GPU index on that host (CUDA_VISIBLE_DEVICES); on CPU hosts, the rank's slot there.
    local_gpu_index: int


@dataclass(frozen=True)
class ClusterConfig:
    # Local package directory, resolved against the directory of cluster.toml.
    package: Path
    hosts: tuple[HostConfig, ...]
    frontend: FrontendConfig = FrontendConfig()
    # The package must carry a valid Ed25519 signature by one of trusted_keys (public key
    # files): orbit up checks it before pushing, and every rank checks it before loading.
    require_signature: bool = False
    trusted_keys: tuple[Path, ...] = ()
    ssh: SshConfig = SshConfig()

    @property
    def world_size(self) -> int:
        return sum(h.num_ranks for h in self.hosts)

    def rank_placements(self) -> list[RankPlacement]:
        """Ranks fill hosts in file order: host 0 gets ranks 0..g0-1, host 1 the next g1, ..."""
        placements = []
        for host_index, host in enumerate(self.hosts):
            for gpu in host.gpus:
                placements.append(RankPlacement(len(placements), host_index, gpu))
        return placements

    def ranks_on(self, host_index: int) -> list[int]:
        return [p.rank for p in self.rank_placements() if p.host_index == host_index]

    def check_tp_size(self, tp_size: int) -> None:
        """Raise unless the hosts hold exactly one rank per TP shard of the package."""
        if self.world_size != tp_size:
            counts = ", ".join(f"hosts[{i}]: {h.num_ranks}" for i, h in enumerate(self.hosts))
            raise ClusterConfigError(
                f"the hosts place {self.world_size} ranks ({counts}) but the package has "
                f"tp_size {tp_size}; change the hosts' gpus or prepare the package with "
                f"--tp {self.world_size}."
            )


def load_cluster_config(path: Path | str) -> ClusterConfig:
    """Read and validate cluster.toml; relative paths in it are relative to its directory."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ClusterConfigError(f"{path}: cannot be read ({e.strerror}).") from e
    return parse_cluster_config(text, source=str(path), base_dir=path.absolute().parent)


def parse_cluster_config(
    text: str, source: str = "cluster.toml", base_dir: Path | None = None
) -> ClusterConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ClusterConfigError(_toml_error_message(source, e)) from e
    reader = _Reader(source, _LineIndex(text), base_dir or Path.cwd())
    return reader.cluster(data)


def _toml_error_message(source: str, e: tomllib.TOMLDecodeError) -> str:
    # tomllib puts the position in the message: "Invalid value (at line 3, column 9)".
    match = re.search(r"^(.*) \(at line (\d+), column \d+\)$", str(e))
    if not match:
        return f"{source}: not valid TOML ({e}); see docs/cluster.md."
    return f"{source}:{match.group(2)}: not valid TOML: {match.group(1)}; see docs/cluster.md."


class _LineIndex:
    """Maps field paths like ("hosts", 1, "gpus") to the line that sets them.

    A scan, not a TOML parser: it follows [table] and [[array]] headers and `key =` lines,
    which is what cluster.toml files contain. A field it cannot place falls back to the line
    of the nearest enclosing table, or to no line at all.
    """

    _HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\s]+?)\s*\]\]?")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*=")

    def __init__(self, text: str) -> None:
        self.lines: dict[FieldPath, int] = {}
        self._array_counts: dict[str, int] = {}
        table: FieldPath = ()
        for number, line in enumerate(text.splitlines(), start=1):
            if header := self._HEADER.match(line):
                table = self._enter(header.group(1), header.group(2))
                self.lines.setdefault(table, number)
            elif key := self._KEY.match(line):
                self.lines.setdefault(table + tuple(key.group(1).split(".")), number)

    def _enter(self, brackets: str, name: str) -> FieldPath:
        parts = [p.strip() for p in name.split(".")]
        if brackets == "[[":
            count = self._array_counts.get(parts[0], 0)
            self._array_counts[parts[0]] = count + 1
            return (parts[0], count, *parts[1:])
        # [hosts.env] belongs to the latest [[hosts]] entry.
        if parts[0] in self._array_counts:
            return (parts[0], self._array_counts[parts[0]] - 1, *parts[1:])
        return tuple(parts)

    def line_of(self, path: FieldPath) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return None


def _field_name(path: FieldPath) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name


@dataclass(frozen=True)
class _Reader:
    """Validates the parsed TOML, one function per table; errors carry file, line and field."""

    source: str
    index: _LineIndex
    base_dir: Path

    def error(self, path: FieldPath, message: str) -> ClusterConfigError:
        line = self.index.line_of(path)
        where = f"{self.source}:{line}" if line else self.source
        return ClusterConfigError(f"{where}: {_field_name(path)} {message}")

    def check_keys(self, table: Mapping[str, Any], allowed: tuple[str, ...], at: FieldPath):
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                hint = (
                    f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(allowed)}."
                )
                raise self.error((*at, key), f"is not a known setting; {hint}")

    def cluster(self, data: dict[str, Any]) -> ClusterConfig:
        self.check_keys(data, TOP_KEYS, ())
        if "package" not in data:
            raise self.error(("package",), 'is required: package = "path/to/package".')
        return ClusterConfig(
            package=self.path(data, ("package",), relative_to=self.base_dir),
            hosts=self.hosts(data.get("hosts")),
            frontend=self.frontend(data.get("frontend", {})),
            require_signature=self.require_signature(data),
            trusted_keys=self.trusted_keys(data),
            ssh=self.ssh(data.get("ssh", {})),
        )

    def require_signature(self, data: dict[str, Any]) -> bool:
        value = self.boolean(data, ("require_signature",), False)
        if value and not data.get("trusted_keys"):
            raise self.error(
                ("require_signature",),
                '= true needs trusted_keys = ["signer.pub", ...] (made by `orbit keygen`).',
            )
        return value

    def trusted_keys(self, data: dict[str, Any]) -> tuple[Path, ...]:
        at: FieldPath = ("trusted_keys",)
        value = data.get("trusted_keys", [])
        if not isinstance(value, list):
            raise self.error(at, f"must be a list of public key paths, got {value!r}.")
        return tuple(self.path({"trusted_keys": v}, at, self.base_dir) for v in value)

    def frontend(self, table: Any) -> FrontendConfig:
        at: FieldPath = ("frontend",)
        if not isinstance(table, dict):
            raise self.error(at, "must be a table: [frontend].")
        self.check_keys(table, FRONTEND_KEYS, at)
        return FrontendConfig(
            address=self.word(table, (*at, "address"), DEFAULT_FRONTEND_ADDRESS),
            port_range=self.port_range(table, (*at, "port_range")),
        )

    def ssh(self, table: Any) -> SshConfig:
        at: FieldPath = ("ssh",)
        if not isinstance(table, dict):
            raise self.error(at, "must be a table: [ssh].")
        self.check_keys(table, SSH_KEYS, at)
        return SshConfig(
            keepalive_interval_s=self.seconds(
                table, (*at, "keepalive_interval_s"), DEFAULT_KEEPALIVE_INTERVAL_S
            ),
            keepalive_count_max=self.count(
                table, (*at, "keepalive_count_max"), DEFAULT_KEEPALIVE_COUNT_MAX
            ),
            stall_timeout_s=self.seconds(table, (*at, "stall_timeout_s"), DEFAULT_STALL_TIMEOUT_S),
        )

    def port_range(self, table: dict[str, Any], at: FieldPath) -> tuple[int, int]:
        value = table.get(at[-1], list(DEFAULT_PORT_RANGE))
        ok = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
        if not ok or not 1 <= value[0] <= value[1] <= 65535:
            raise self.error(
                at, f"must be [start, end] with 1 <= start <= end <= 65535, got {value!r}."
            )
        return (value[0], value[1])

    def hosts(self, value: Any) -> tuple[HostConfig, ...]:
        if value is None:
            raise self.error(("hosts",), "needs at least one [[hosts]] entry with an address.")
        if not isinstance(value, list) or not all(isinstance(h, dict) for h in value):
            raise self.error(("hosts",), "must be a list of tables: write each as [[hosts]].")
        if not value:
            raise self.error(("hosts",), "needs at least one [[hosts]] entry with an address.")
        hosts = tuple(self.host(table, ("hosts", i)) for i, table in enumerate(value))
        self.check_distinct(hosts)
        return hosts

    def host(self, table: dict[str, Any], at: FieldPath) -> HostConfig:
        self.check_keys(table, HOST_KEYS, at)
        if "address" not in table:
            raise self.error((*at, "address"), 'is required: address = "10.0.0.1" or a host name.')
        known_hosts = self.optional_path(table, (*at, "known_hosts"))
        return HostConfig(
            address=self.word(table, (*at, "address"), ""),
            ssh_port=self.port(table, (*at, "ssh_port"), DEFAULT_SSH_PORT),
            user=self.word(table, (*at, "user"), getpass.getuser()),
            identity_file=self.optional_path(table, (*at, "identity_file")),
            known_hosts=known_hosts or default_known_hosts(),
            gpus=self.gpus(table, (*at, "gpus")),
            workdir=self.workdir(table, (*at, "workdir")),
            python=self.word(table, (*at, "python"), DEFAULT_PYTHON),
            nccl_interface=self.word(table, (*at, "nccl_interface"), None),
            device=self.choice(table, (*at, "device"), DEVICES),
            env=self.env(table.get("env", {}), (*at, "env")),
        )

    def check_distinct(self, hosts: tuple[HostConfig, ...]) -> None:
        # Two entries for one login and workdir would share pid and log files.
        seen: dict[tuple[str, int, str, str], int] = {}
        for i, h in enumerate(hosts):
            key = (h.address, h.ssh_port, h.user, h.workdir)
            if key in seen:
                raise self.error(
                    ("hosts", i, "address"),
                    f"repeats hosts[{seen[key]}] ({h.user}@{h.label}, workdir {h.workdir}); "
                    "list all of a host's GPUs in one [[hosts]] entry.",
                )
            seen[key] = i

    def gpus(self, table: dict[str, Any], at: FieldPath) -> tuple[int, ...]:
        value = table.get(at[-1], 1)
        if _is_int(value) and value >= 1:
            return tuple(range(value))
        indices = isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)
        if indices and value and len(set(value)) == len(value):
            return tuple(value)
        raise self.error(
            at,
            f"must be a count >= 1 or a list of distinct GPU indices like [0, 1], got {value!r}.",
        )

    def workdir(self, table: dict[str, Any], at: FieldPath) -> str:
        value = self.word(table, at, DEFAULT_WORKDIR)
        # Only "~" and "~/..." are expanded remotely; "~user" and relative paths are ambiguous.
        if not (value.startswith(("/", "~/")) or value == "~"):
            raise self.error(at, f'must be absolute or start with "~/", got {value!r}.')
        return value

    def env(self, value: Any, at: FieldPath) -> dict[str, str]:
        if not isinstance(value, dict):
            raise self.error(at, 'must be a table of strings, e.g. env = { NCCL_DEBUG = "WARN" }.')
        for name, item in value.items():
            if not _ENV_NAME.fullmatch(name):
                raise self.error((*at, name), "is not a valid environment variable name.")
            if not isinstance(item, str):
                raise self.error((*at, name), f"must be a string, got {item!r}; quote it.")
        return dict(value)

    def word(self, table: dict[str, Any], at: FieldPath, default: Any) -> Any:
        if at[-1] not in table:
            return default
        value = table[at[-1]]
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise self.error(at, f"must be a non-empty string without spaces, got {value!r}.")
        return value

    def port(self, table: dict[str, Any], at: FieldPath, default: int) -> int:
        value = table.get(at[-1], default)
        if not _is_int(value) or not 1 <= value <= 65535:
            raise self.error(at, f"must be an integer from 1 to 65535, got {value!r}.")
        return value

    def seconds(self, table: dict[str, Any], at: FieldPath, default: float) -> float:
        value = table.get(at[-1], default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise self.error(at, f"must be a number of seconds > 0, got {value!r}.")
        return float(value)

    def count(self, table: dict[str, Any], at: FieldPath, default: int) -> int:
        value = table.get(at[-1], default)
        if not _is_int(value) or value < 1:
            raise self.error(at, f"must be an integer >= 1, got {value!r}.")
        return value

    def boolean(self, table: dict[str, Any], at: FieldPath, default: bool) -> bool:
        value = table.get(at[-1], default)
        if not isinstance(value, bool):
            raise self.error(at, f"must be true or false, got {value!r}.")
        return value

    def choice(self, table: dict[str, Any], at: FieldPath, choices: tuple[str, ...]) -> str:
        value = table.get(at[-1], choices[0])
        if value not in choices:
            raise self.error(at, f"must be one of {', '.join(map(repr, choices))}, got {value!r}.")
        return value

    def path(self, table: dict[str, Any], at: FieldPath, relative_to: Path | None = None) -> Path:
        value = table[at[-1]]
        if not isinstance(value, str) or not value:
            raise self.error(at, f"must be a non-empty path string, got {value!r}.")
        path = Path(value).expanduser()
        return relative_to / path if relative_to and not path.is_absolute() else path

    def optional_path(self, table: dict[str, Any], at: FieldPath) -> Path | None:
        return self.path(table, at, self.base_dir) if at[-1] in table else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
