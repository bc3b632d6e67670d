"""CURVE keys for the ZeroMQ link between the frontend and its ranks, in every mode.

ZeroMQ's CURVE gives the link authentication and encryption ("Ironhouse"): the frontend holds
a server key pair and accepts only clients whose public keys sit in its allowed directory. Each
rank holds a client pair of its own, so the frontend knows which rank sent a message from the
authenticated key (ZeroMQ's User-Id of the message), never from a field of the message body.
`orbit up` makes the keys in the cluster's local state directory and pushes to each host only
what its ranks need; `orbit serve PKG` makes a fresh set per run in a private temporary folder.

Layout of a key directory:
    server.key, server.key_secret        the frontend's pair (the secret never leaves its machine)
    client-R.key, client-R.key_secret    rank R's pair
    allowed/client-R.key                 public keys the frontend accepts
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

_CLIENT_KEY = re.compile(r"client-(\d+)\.key")


class CurveError(RuntimeError):
    """CURVE keys are missing or ZeroMQ was built without CURVE."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError("this pyzmq/libzmq has no CURVE support; install pyzmq's wheels.")


def client_name(rank: int) -> str:
    return f"client-{rank}"


def rank_key_files(ranks) -> tuple[str, ...]:
    """The files a host running `ranks` needs: their secret keys and the frontend's public key."""
    return ("server.key", *(f"{client_name(r)}.key_secret" for r in sorted(ranks)))


def create_keys(directory: Path, num_ranks: int) -> Path:
    """Make a fresh server pair and one client pair per rank in directory (created, private);
    keys of an earlier set are removed first."""
    require_curve()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in directory.glob("*.key*"):
        old.unlink()
    allowed = directory / "allowed"
    shutil.rmtree(allowed, ignore_errors=True)
    allowed.mkdir(mode=0o700)
    zmq.auth.create_certificates(str(directory), "server")
    for rank in range(num_ranks):
        zmq.auth.create_certificates(str(directory), client_name(rank))
        name = f"{client_name(rank)}.key"
        shutil.copy(directory / name, allowed / name)
    return directory


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed_dir: Path
    # z85 public key (ZeroMQ's User-Id of an authenticated message) -> the rank holding it
    rank_of_user: dict[str, int]

    @classmethod
    def load(cls, directory: Path) -> ServerKeys:
        public, secret = _pair(directory / "server.key_secret")
        allowed = directory / "allowed"
        ranks = {}
        for path in sorted(allowed.glob("client-*.key")):
            match = _CLIENT_KEY.fullmatch(path.name)
            if match:
                ranks[_public(path).decode("ascii")] = int(match.group(1))
        if not ranks:
            raise CurveError(f"{allowed}: holds no rank keys (client-R.key).")
        return cls(public, secret, allowed, ranks)


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, directory: Path, rank: int) -> ClientKeys:
        public, secret = _pair(directory / f"{client_name(rank)}.key_secret")
        return cls(public, secret, _public(directory / "server.key"))


def _pair(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: cannot read the CURVE key ({e}).") from e
    if secret is None:
        raise CurveError(f"{path}: holds no secret key.")
    return public, secret


def _public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: cannot read the CURVE key ({e}).") from e
    return public


def secure_server(socket: zmq.Socket, keys: ServerKeys) -> None:
    """Before bind: the socket accepts only CURVE clients whose keys are allowed (the
    authenticator on the socket's context enforces that)."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def secure_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    """Before connect."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = keys.server_public
