"""LoopReader (runtime/zmq_reader.py) over real sockets on loopback: every message reaches the
callback, in order, also when a send takes the descriptor's signal while a reply waits."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from runtime.zmq_reader import LoopReader


def _echo(ctx: zmq.Context, endpoint: str, count: int) -> None:
    """A peer that says hello, then sends back each of `count` messages (giving up after 10 s
    of silence, so the thread always ends)."""
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(endpoint)
    try:
        peer.send(b"hello")
        for _ in range(count):
            if not peer.poll(10_000):
                return
            peer.send(peer.recv())
    finally:
        peer.close()


@pytest.fixture
def echo_router():
    """A ROUTER on loopback with an echo peer; yields (router, the peer's identity, start),
    start(count) starting the peer for count echoes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    threads = []

    def start(count: int) -> bytes:
        thread = threading.Thread(target=_echo, args=(ctx, endpoint, count), daemon=True)
        thread.start()
        threads.append(thread)
        assert sock.poll(10_000), "the echo peer never said hello"
        identity, hello = sock.recv_multipart()
        assert hello == b"hello"
        return identity

    yield sock, start
    for thread in threads:
        thread.join(timeout=15)
    sock.close()
    ctx.term()


async def _until(got: list, n: int, arrived: asyncio.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        arrived.clear()
        try:
            await asyncio.wait_for(arrived.wait(), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            pass


async def test_a_reply_waiting_when_another_send_goes_out_is_read(echo_router):
    """Each round sends "a", blocks the loop until a's echo has surely arrived, then sends "b"
    before the loop looks again: that send takes the descriptor's signal for the waiting echo,
    which send must notice. Without that look both echoes stay in the socket."""
    sock, start = echo_router
    rounds = 10
    identity = start(2 * rounds)
    got: list[bytes] = []
    arrived = asyncio.Event()

    def on_message(frames):
        got.append(frames[1].bytes)
        arrived.set()

    reader = LoopReader(sock, on_message)
    reader.start()
    try:
        sent = []
        for i in range(rounds):
            for tag in "ab":
                body = f"{i}{tag}".encode()
                reader.send([identity, body])
                sent.append(body)
                if tag == "a":
                    time.sleep(0.02)  # noqa: ASYNC251 - blocking on purpose: the loop cannot look
            await _until(got, len(sent), arrived, 5.0)
            assert got == sent, f"round {i}"
    finally:
        reader.stop()


async def test_a_message_whose_handler_raises_does_not_hold_back_the_next(echo_router, caplog):
    sock, start = echo_router
    identity = start(3)
    got: list[bytes] = []
    arrived = asyncio.Event()

    def on_message(frames):
        got.append(frames[1].bytes)
        arrived.set()
        if frames[1].bytes == b"1":
            raise RuntimeError("a handler's bug")

    reader = LoopReader(sock, on_message)
    for body in (b"1", b"2", b"3"):
        sock.send_multipart([identity, body])
    time.sleep(0.1)  # noqa: ASYNC251 - all three echoes wait before the reader starts
    reader.start()
    try:
        await _until(got, 3, arrived, 5.0)
    finally:
        reader.stop()
        reader.stop()  # twice is fine
    assert got == [b"1", b"2", b"3"]
    assert "could not be handled" in caplog.text
