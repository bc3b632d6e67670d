"""The frontend's ZeroMQ link with CURVE: only ranks holding the allowed client key get in."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from orbit.curve import ClientKeys, ServerKeys, create_keys, secure_client
from orbit.rank_link import RankLink
from proto import wire_pb2


async def _send_hello(endpoint: str, rank: int, keys: ClientKeys | None) -> zmq.asyncio.Socket:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(endpoint)
    hello = wire_pb2.FromRank(hello=wire_pb2.Hello(rank=rank, tp_size=3))
    await sock.send(hello.SerializeToString())
    return sock


async def _scenario(tmp_path):
    good = create_keys(tmp_path / "cluster")
    stranger = create_keys(tmp_path / "stranger")  # a well-formed key the frontend never allowed
    server = ServerKeys.load(good)
    link = RankLink(3, curve=server)
    strange = ClientKeys.load(stranger)
    link.start()
    socks = [
        await _send_hello(link.endpoint, 0, ClientKeys.load(good)),
        await _send_hello(link.endpoint, 1, None),  # plain ZeroMQ, no CURVE at all
        await _send_hello(
            link.endpoint, 2, ClientKeys(strange.public, strange.secret, server.public)
        ),
    ]
    for _ in range(40):
        if link.ranks[0].hello is not None:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # time enough for the refused ones to have arrived, were they let in
    seen = [r.hello is not None for r in link.ranks]
    for s in socks:
        s.close()
    link.close()
    return seen


def test_only_the_allowed_key_gets_through(tmp_path):
    assert asyncio.run(_scenario(tmp_path)) == [True, False, False]
