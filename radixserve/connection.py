"""The SDK's connection to a router: one DEALER socket owned by one asyncio loop, replies
demultiplexed by request id, and a heartbeat watchdog.

While calls are pending, the connection sends a health probe whenever the router has been quiet
for ``heartbeat`` seconds; after ``router_timeout`` seconds with no message at all, every pending
call fails with :class:`~radixserve.errors.RouterLostError` (code ``router_lost``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.errors import ROUTER_LOST, BadRequestError, RequestTimeoutError, error_from_code

Opened = tuple[asyncio.Queue, Awaitable[Any]]  # Connection.open: (the call's reply queue, its send)


class Connection:
    """Connected on first use; :meth:`call` for one reply, :meth:`events` for a stream of them."""

    def __init__(self, address: str, *, max_frame_bytes: int, heartbeat: float, router_timeout: float | None):
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat = heartbeat
        self.router_timeout = router_timeout
        self._last_rx = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._pending: dict[str, asyncio.Queue] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _ensure(self) -> zmq.asyncio.Socket:
        """The socket, connected (and its reader and watchdog started) on first use."""
        if self._closed:
            raise RuntimeError("client is closed")
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            sock = self._sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.address)
            self._reader = asyncio.ensure_future(self._read(sock))
            if self.router_timeout is not None:
                self._watchdog = asyncio.ensure_future(self._watch(sock, self.router_timeout))
        return self._sock

    def _register(self, rid: str, q: asyncio.Queue) -> None:
        if not self._pending:
            self._last_rx = time.monotonic()  # the quiet time before this call does not count
        self._pending[rid] = q

    async def _watch(self, sock: zmq.asyncio.Socket, router_timeout: float) -> None:
        """Probe a quiet router while calls are pending; fail them all when it stays silent."""
        n = itertools.count()
        while True:
            await asyncio.sleep(min(self.heartbeat, router_timeout / 4))
            if not self._pending:
                continue
            quiet = time.monotonic() - self._last_rx
            if quiet > router_timeout:
                lost = P.Error(
                    id="", code=ROUTER_LOST, message=f"no word from the router at {self.address} for {quiet:.1f} s (heartbeat); it is gone or unreachable"
                )
                for q in list(self._pending.values()):
                    q.put_nowait(lost)
                self._pending.clear()
            elif quiet > self.heartbeat:
                try:
                    await sock.send(P.encode(P.Health(id=f"{self._prefix}-hb-{next(n)}")), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        async for frame in P.received(sock.recv):
            self._last_rx = time.monotonic()
            try:
                msg = P.decode(frame, max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
            except P.DecodeError:
                continue
            q = self._pending.get(getattr(msg, "id", ""))
            if q is not None:
                q.put_nowait(msg)
            elif isinstance(msg, P.Error) and not msg.id and len(self._pending) == 1:
                next(iter(self._pending.values())).put_nowait(msg)  # unattributable: only one waiter

    def _frame(self, msg) -> bytes:
        frame = P.encode(msg)
        if len(frame) > self.max_frame_bytes:
            raise BadRequestError("request", f"encodes to {len(frame)} bytes; the limit is {self.max_frame_bytes}")
        return frame

    async def send(self, msg) -> None:
        await self._ensure().send(self._frame(msg))

    def open(self, msg: P.Generate | P.Choose) -> Opened:
        """Register ``msg``'s replies and send it now, not at the first step of a task (pyzmq
        sends at once unless the socket is full): pass the result to :meth:`events`, and
        :meth:`forget` the id when that is done (a task cancelled before its first step never
        runs the generator, whose end would)."""
        frame = self._frame(msg)
        sock = self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._register(msg.id, q)
        return q, sock.send(frame)

    def forget(self, rid: str) -> None:
        """Drop call ``rid`` if :meth:`events` never ran for it, aborting it on the server."""
        if self._pending.pop(rid, None) is not None and self._sock is not None and not self._closed:
            try:
                self._sock.send(P.encode(P.Abort(id=rid)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    async def call(self, msg, timeout: float | None):
        """One request, one reply (health, stats)."""
        self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._register(msg.id, q)
        try:
            await self.send(msg)
            reply = await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"no reply from {self.address} within {timeout} s") from None
        finally:
            self._pending.pop(msg.id, None)
        if isinstance(reply, P.Error):
            raise error_from_code(reply.code, reply.message)
        return reply

    async def events(self, msg: P.Generate | P.Choose, timeout: float | None, opened: Opened | None = None) -> AsyncIterator:
        """The replies to a generate or choose up to its final one (an error raises); leaving early,
        or running past ``timeout``, aborts the request on the server. ``opened``: what
        :meth:`open` returned for ``msg`` (already sent); None: sent here."""
        deadline = None if timeout is None else time.monotonic() + timeout
        done = False
        try:
            if opened is None:
                opened = self.open(msg)
            q, sent = opened
            await sent
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    reply = await asyncio.wait_for(q.get(), left)
                except asyncio.TimeoutError:
                    raise RequestTimeoutError(f"request {msg.id} did not finish within {timeout} s; it was aborted") from None
                if isinstance(reply, P.Error):
                    done = True
                    raise error_from_code(reply.code, reply.message)
                if isinstance(reply, (P.Final, P.ChoiceFinal)):
                    done = True
                yield reply
                if done:
                    return
        finally:
            self._pending.pop(msg.id, None)
            if not done and self._sock is not None and not self._closed:
                try:
                    await self.send(P.Abort(id=msg.id))
                except Exception:
                    pass

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
