"""The frontend's ZeroMQ link with CURVE: only ranks holding an allowed client key get in, a
message's rank is the key's rank whatever its body says, and malformed frames are dropped and
counted without stopping the reader; a link that cannot bind leaves nothing open."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import zmq
import zmq.asyncio

from runtime.curve import ClientKeys, ServerKeys, create_keys, secure_client
from orbit.core.rank_link import RankLink
from proto import wire_pb2


def _socket(endpoint: str, identity: str, keys: ClientKeys | None) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(endpoint)
    return sock


async def _send_hello(endpoint: str, rank: int, keys: ClientKeys | None) -> zmq.asyncio.Socket:
    sock = _socket(endpoint, f"rank-{rank}", keys)
    hello = wire_pb2.FromRank(hello=wire_pb2.Hello(rank=rank, tp_size=3))
    try:
        await sock.send(hello.SerializeToString(), flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # refused before the hello left: ZeroMQ dropped the connection, and the hello
    return sock


async def _until(check, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)


async def _scenario(tmp_path):
    good = create_keys(tmp_path / "cluster", 3)
    stranger = create_keys(tmp_path / "stranger", 3)  # well-formed keys the frontend never allowed
    server = ServerKeys.load(good)
    link = RankLink(3, server)
    strange = ClientKeys.load(stranger, 2)
    socks = []
    try:  # the link closed on every path: one collected open hangs the process (RankLink.close)
        link.start()
        socks.append(await _send_hello(link.endpoint, 0, ClientKeys.load(good, 0)))
        socks.append(await _send_hello(link.endpoint, 1, None))  # plain ZeroMQ, no CURVE at all
        socks.append(
            await _send_hello(
                link.endpoint, 2, ClientKeys(strange.public, strange.secret, server.public)
            )
        )
        await _until(lambda: link.ranks[0].hello is not None)
        await asyncio.sleep(1.0)  # time enough for the refused ones to arrive, were they let in
        return [r.hello is not None for r in link.ranks]
    finally:
        for s in socks:
            s.close()
        link.close()


def test_only_the_allowed_keys_get_through(tmp_path):
    assert asyncio.run(_scenario(tmp_path)) == [True, False, False]


async def _forgeries(tmp_path):
    keys = create_keys(tmp_path / "keys", 2)
    link = RankLink(2, ServerKeys.load(keys))
    # Rank 1's key, speaking for rank 0 (body and routing identity both say rank 0).
    forger = _socket(link.endpoint, "rank-0", ClientKeys.load(keys, 1))
    try:
        link.start()
        forged = wire_pb2.FromRank(failure=wire_pb2.Failure(rank=0, message="forged"))
        await forger.send(forged.SerializeToString())
        await forger.send(b"")  # an empty frame: no message kind at all
        await forger.send(b"\xff\xfe not protobuf")
        await forger.send_multipart([b"two", b"frames"])
        # A genuine message from rank 1 after all that: the reader must still be running.
        heartbeat = wire_pb2.FromRank(heartbeat=wire_pb2.Heartbeat(rank=1, last_step_id=7))
        await forger.send(heartbeat.SerializeToString())
        await _until(lambda: link.ranks[1].last_seen > 0)
        return (
            link.failure,
            link.ranks[0].last_seen,
            link.ranks[1].last_seen,
            link.dropped_messages,
        )
    finally:
        forger.close()
        link.close()


def test_forged_and_malformed_messages_are_dropped_and_counted(tmp_path):
    failure, rank0_seen, rank1_seen, dropped = asyncio.run(_forgeries(tmp_path))
    assert failure is None  # the forged Failure did not fail the link
    assert rank0_seen == 0  # nothing was credited to rank 0
    assert rank1_seen > 0  # the reader survived and took rank 1's real heartbeat
    assert dropped == 4


_BIND_TWICE = """
import asyncio, gc, sys
from pathlib import Path
import zmq
from orbit.core.rank_link import RankLink
from runtime.curve import ServerKeys, create_keys

async def bind(keys, port):
    RankLink(1, keys, port=port)

keys = ServerKeys.load(create_keys(Path(sys.argv[1]), 1))
ctx = zmq.Context()
taken = ctx.socket(zmq.ROUTER)
port = taken.bind_to_random_port("tcp://127.0.0.1")
try:
    asyncio.run(bind(keys, port))  # the task and its traceback: a cycle only gc frees
except zmq.ZMQError:
    pass
gc.collect()
taken.close()
ctx.term()
print("collected")
"""


def test_a_link_that_cannot_bind_leaves_nothing_to_hang_the_collector(tmp_path):
    """A RankLink whose port is taken raises, having closed what it opened: collected open,
    its ZeroMQ context would wait forever for a socket it no longer sees."""
    out = subprocess.run(
        [sys.executable, "-c", _BIND_TWICE, str(tmp_path / "keys")],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr
