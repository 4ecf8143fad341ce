"""The SDK's connection to a router: one DEALER socket owned by one asyncio loop, replies
demultiplexed by request id, and a heartbeat watchdog.

While calls are pending, the connection sends a health probe whenever the router has been quiet
for ``heartbeat`` seconds; after ``router_timeout`` seconds with no message at all, every pending
call fails with :class:`~radixserve.errors.RouterLostError` (code ``router_lost``).

No send ever waits past its call's timeout or the watchdog: a call whose frame the socket cannot
take yet waits for it only up to its deadline, and fails as soon as the watchdog (or a refused
handshake) fails it, its send then withdrawn. That matters: a router at its client cap refuses the
connection at the handshake, libzmq then drops the connection without retrying, and the DEALER,
left without a pipe, would hold an awaited send for ever. The refusal is seen on the socket's
monitor: pending calls fail at once with :class:`~radixserve.errors.RouterRefusedError` (code
``router_refused``) and the next call connects anew.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import cast

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.errors import ROUTER_LOST, ROUTER_REFUSED, BadRequestError, RequestTimeoutError, error_from_code

_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL  # libzmq does not reconnect after these
_PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_") :] for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}
ABORT_SEND_S = 10.0  # an abort the socket cannot take at once stays queued this long at most
Opened = tuple[asyncio.Queue, asyncio.Future]  # Connection.open: (the call's reply queue, its send)


def _send_future(sock: zmq.asyncio.Socket, frame: bytes) -> asyncio.Future:
    """pyzmq's send: a future, done at once when the socket took the frame; else queued (in order)
    until it can, and withdrawn by cancelling it."""
    return cast(asyncio.Future, sock.send(frame))


async def _peek(q: asyncio.Queue) -> None:
    """Return once ``q`` holds an item, leaving it there."""
    q.put_nowait(await q.get())


class Connection:
    """Connected on first use; :meth:`call` for one reply, :meth:`events` for a stream of them."""

    def __init__(self, address: str, *, max_frame_bytes: int, heartbeat: float, router_timeout: float | None):
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.heartbeat = heartbeat
        self.router_timeout = router_timeout
        self._last_rx = time.monotonic()
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._hb = itertools.count()
        self._pending: dict[str, asyncio.Queue] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []  # the reader, watchdog and monitor of the current socket
        self._refused: str | None = None  # why the current socket's connection was refused (it is then replaced)
        self._closed = False

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def _ensure(self) -> zmq.asyncio.Socket:
        """The socket, connected (and its reader, watchdog and monitor started) on first use, and
        anew after the router refused the previous one's connection."""
        if self._closed:
            raise RuntimeError("client is closed")
        if self._sock is not None and self._refused is not None:
            self._drop_socket()
        if self._sock is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            sock = self._sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
            sock.connect(self.address)
            self._refused = None
            self._tasks = [asyncio.ensure_future(self._read(sock)), asyncio.ensure_future(self._watch_handshake(self._monitor))]
            if self.router_timeout is not None:
                self._tasks.append(asyncio.ensure_future(self._watch(self.router_timeout)))
        return self._sock

    def _drop_socket(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            if self._monitor is not None:
                self._monitor.close(linger=0)
            self._sock.close(linger=0)
        self._sock = self._monitor = None

    def _register(self, rid: str, q: asyncio.Queue) -> None:
        if not self._pending:
            self._last_rx = time.monotonic()  # the quiet time before this call does not count
        self._pending[rid] = q

    def _fail_all(self, code: str, message: str) -> None:
        err = P.Error(id="", code=code, message=message)
        for q in list(self._pending.values()):
            q.put_nowait(err)
        self._pending.clear()

    async def _watch(self, router_timeout: float) -> None:
        """Probe a quiet router while calls are pending; fail them all when it stays silent."""
        while True:
            await asyncio.sleep(min(self.heartbeat, router_timeout / 4))
            if not self._pending:
                continue
            quiet = time.monotonic() - self._last_rx
            if quiet > router_timeout:
                why = self._refused or "it is gone or unreachable"
                self._fail_all(ROUTER_LOST, f"no word from the router at {self.address} for {quiet:.1f} s (heartbeat); {why}")
            elif quiet > self.heartbeat:
                self._send_nowait(P.encode(P.Health(id=f"{self._prefix}-hb-{next(self._hb)}")))

    async def _watch_handshake(self, monitor: zmq.asyncio.Socket) -> None:
        """Fail the pending calls at once when the router refuses the connection's handshake
        (libzmq then drops it for good; the next call connects anew)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except (ValueError, KeyError, IndexError):
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = (
                    f"the router at {self.address} did not accept this client's connection (refused at the handshake, "
                    f"status {event['value']}): it is most likely at its client cap (max_clients; serve --max-clients, "
                    f"its stats count refused_clients). Retry later; the next call connects anew"
                )
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                what = _PROTOCOL_ERRORS.get(event["value"], f"protocol error {event['value']:#x}")
                self._refused = (
                    f"{self.address} did not accept this client's connection (the handshake failed: {what}); is it a "
                    f"radixserve router's client address (not its worker port)? The next call connects anew"
                )
            else:
                continue
            self._fail_all(ROUTER_REFUSED, self._refused)

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

    def _encode(self, msg) -> bytes:
        frame = P.encode(msg)
        if len(frame) > self.max_frame_bytes:
            raise BadRequestError("request", f"encodes to {len(frame)} bytes; the limit is {self.max_frame_bytes}")
        return frame

    async def _send(self, rid: str, frame: bytes, q: asyncio.Queue, deadline: float | None, timeout: float | None) -> bool:
        """Send a request's frame (:meth:`_sent`). Returns whether the socket took it."""
        sock = self._ensure()
        if not q.empty():
            return False
        return await self._sent(rid, _send_future(sock, frame), q, deadline, timeout)

    async def _sent(self, rid: str, sending: asyncio.Future, q: asyncio.Queue, deadline: float | None, timeout: float | None) -> bool:
        """Wait for a request's send. When the socket cannot take the frame at once (the router is
        unreachable, slow to read, or refused the connection: no pipe), wait no longer than
        ``deadline``, and only until an error for the call arrives on ``q`` (the watchdog's, or a
        refusal's; the caller reads it); the queued send is then withdrawn (pyzmq skips a
        cancelled send future). Returns whether the socket took the frame."""
        if sending.cancelled():
            return False
        if sending.done():  # taken at once (or an error other than EAGAIN: raised)
            sending.result()
            return True
        failed = asyncio.ensure_future(_peek(q))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait((sending, failed), timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not sending.done():
                sending.cancel()
        if sending.done() and not sending.cancelled():
            sending.result()
            return True
        if not q.empty():
            return False
        if self._closed:
            raise RuntimeError("client is closed")
        why = self._refused or (
            "no connection to it took the request: it is unreachable, or did not accept this client's connection "
            "(a router at its client cap, max_clients, refuses new ones)"
        )
        raise RequestTimeoutError(f"request {rid} could not be sent to {self.address} within {timeout} s; {why}")

    def _send_nowait(self, frame: bytes, keep_s: float = 0.0) -> None:
        """Send without waiting. A frame the socket cannot take at once stays queued ``keep_s``
        seconds at most (dropped sooner when the socket closes)."""
        if self._sock is None or self._closed:
            return
        try:
            sending = _send_future(self._sock, frame)
        except zmq.ZMQError:
            return
        if sending.done():
            if not sending.cancelled():
                sending.exception()  # retrieved: a failed heartbeat or abort is dropped
            return
        if keep_s <= 0:
            sending.cancel()
        else:
            sending.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure is dropped, not logged
            asyncio.get_running_loop().call_later(keep_s, sending.cancel)

    def open(self, msg: P.Generate | P.Choose) -> Opened:
        """Register ``msg``'s replies and start its send now, not at the first step of a task
        (pyzmq sends at once unless the socket cannot take the frame): pass the result to
        :meth:`events`, and :meth:`forget` the id when that is done (a task cancelled before its
        first step never runs the generator, whose end would)."""
        frame = self._encode(msg)
        sock = self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._register(msg.id, q)
        return q, _send_future(sock, frame)

    def forget(self, rid: str) -> None:
        """Drop call ``rid`` if :meth:`events` never ran for it, aborting it on the server."""
        if self._pending.pop(rid, None) is not None:
            self._send_nowait(P.encode(P.Abort(id=rid)), keep_s=ABORT_SEND_S)

    async def call(self, msg, timeout: float | None):
        """One request, one reply (health, stats)."""
        frame = self._encode(msg)
        self._ensure()
        q: asyncio.Queue = asyncio.Queue()
        self._register(msg.id, q)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await self._send(msg.id, frame, q, deadline, timeout)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = await asyncio.wait_for(q.get(), left)
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
        :meth:`open` returned for ``msg`` (its send started); None: sent here."""
        q, sending = self.open(msg) if opened is None else opened
        deadline = None if timeout is None else time.monotonic() + timeout
        done = sent = False
        try:
            sent = await self._sent(msg.id, sending, q, deadline, timeout)  # (False: an error came before the socket took it)
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
            if sent and not done:
                self._send_nowait(P.encode(P.Abort(id=msg.id)), keep_s=ABORT_SEND_S)  # never waits: leaving must not hang

    async def close(self) -> None:
        """Close the socket and its context; never waits (queued frames are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._drop_socket()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
