"""Every message a plain (not asyncio) ZeroMQ socket receives, taken in the event loop's own
reader callback, and the socket's sends.

pyzmq's asyncio sockets make a future per receive and per send, with callbacks and several
getsockopt calls around each; for the engine core's links, which move a message or two a step,
that was about half of the link's CPU time (30 of 66 µs a round trip on a 2-core VM). Here a
send is a plain non-blocking send and a readable socket is drained with non-blocking receives.

ZeroMQ's file descriptor signals only that the socket's state may have changed, and a send can
consume that signal while a message waits: every send goes through `send`, which then looks at
the socket's events and drains it if a message is there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

log = logging.getLogger("orbit.zmq_reader")


class LoopReader:
    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None]):
        """on_message: called with each message's frames (copy=False) in arrival order. It
        should not raise: one that does is logged and the reader goes on with the next message
        (leaving the rest for the descriptor's next signal could leave them unread for good)."""
        self.sock, self.on_message = sock, on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1

    def start(self) -> None:
        """Start reading, in the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._fd = self.sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self.drain)
        self._loop.call_soon(self.drain)  # what arrived before the reader was added

    def drain(self) -> None:
        sock, on_message = self.sock, self.on_message
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:  # the socket was closed under us
                return
            try:
                on_message(frames)
            except Exception:
                log.exception("a message could not be handled")

    def send(self, frames: list[bytes]) -> None:
        """Queue a message without waiting; raises zmq.ZMQError where ZeroMQ cannot take it (a
        ROUTER's peer not connected, or the queue at its high-water mark)."""
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        finally:
            if self._loop is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._loop.call_soon(self.drain)

    def stop(self) -> None:
        """Stop reading (before the socket is closed); safe to call twice, or never started."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)
