"""The HTTP listening socket of `orbit serve`: bound by the engine core, inherited by every API
server. Standard library only, so the CLI can check the address before anything heavy loads."""

from __future__ import annotations

import socket


class ListenError(RuntimeError):
    """The HTTP address cannot be listened on."""


def bind_http(host: str, port: int) -> socket.socket:
    """The listening socket every API server accepts on; raises ListenError (port taken,
    address not local) before anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ListenError(
            f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host."
        ) from None
    sock.set_inheritable(True)
    return sock
