"""CURVE keys for the ZeroMQ link between the frontend and ranks on other hosts.

ZeroMQ's CURVE gives the link authentication and encryption ("Ironhouse"): the frontend holds
a server key pair and accepts only clients whose public keys sit in its allowed directory; a
rank holds a client key pair and the frontend's public key. `orbit up` makes the keys in the
cluster's local state directory and pushes to each host only what its ranks need.

Layout of a key directory:
    server.key, server.key_secret   the frontend's pair (the secret never leaves this machine)
    client.key, client.key_secret   the ranks' pair
    allowed/client.key              public keys the frontend accepts
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth


class CurveError(RuntimeError):
    """CURVE keys are missing or ZeroMQ was built without CURVE."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveError("this pyzmq/libzmq has no CURVE support; install pyzmq's wheels.")


def create_keys(directory: Path) -> Path:
    """Make a fresh server and client pair in directory (created, private)."""
    require_curve()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in ("server", "client"):
        for suffix in (".key", ".key_secret"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
        zmq.auth.create_certificates(str(directory), name)
    allowed = directory / "allowed"
    allowed.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(directory / "client.key", allowed / "client.key")
    return directory


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed_dir: Path

    @classmethod
    def load(cls, directory: Path) -> ServerKeys:
        public, secret = _pair(directory / "server.key_secret")
        return cls(public, secret, directory / "allowed")


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, directory: Path) -> ClientKeys:
        public, secret = _pair(directory / "client.key_secret")
        server_public, _ = _public(directory / "server.key")
        return cls(public, secret, server_public)


def _pair(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: cannot read the CURVE key ({e}).") from e
    if secret is None:
        raise CurveError(f"{path}: holds no secret key.")
    return public, secret


def _public(path: Path) -> tuple[bytes, None]:
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: cannot read the CURVE key ({e}).") from e
    return public, None


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
