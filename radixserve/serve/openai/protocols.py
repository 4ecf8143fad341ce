"""The gateway's HTTP protocols: uvicorn's httptools (C parser) and h11 protocols with the guards
uvicorn lacks. A request must arrive in time: its head within ``header_timeout_s`` and its body
within ``body_timeout_s`` (else 408, or the connection closed); at most ``max_connections`` are open
(beyond: the one idle the longest is closed); new requests are taken in a few per loop turn
(:class:`_Intake`), so a burst's first ones reach the router while the rest wait; and with
httptools, a completion the router would refuse ``overloaded`` is answered 503 as soon as its head
is in (:class:`~radixserve.serve.openai.shed.Shedder`). :func:`protocol` picks one for uvicorn."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.serve.openai.app import Gateway

log = logging.getLogger("radixserve.http")


class _Intake:
    """New requests taken in per loop turn, at most ``per_turn``; the others wait, in arrival
    order, for the next turns. uvloop hands over every readable connection in one turn: a burst
    of 300 requests was parsed whole (~75 ms with h11) before the first handler ran, so the
    router saw none of it, nor refused any, until the whole burst was in. Taken in a few per turn,
    the first requests reach the router and its admission view (the gateway's ``Shedder``) refuses
    the rest of the burst as they come in."""

    def __init__(self, per_turn: int):
        self.per_turn = per_turn
        self.taken = 0
        self.waiting: collections.deque = collections.deque()  # protocols holding a request's first bytes
        self.loop: asyncio.AbstractEventLoop | None = None

    def admit(self, conn, loop: asyncio.AbstractEventLoop) -> bool:
        """May ``conn`` take in its new request now? Else it waits for :meth:`_turn` to call
        its ``take_in``."""
        if self.loop is None:
            self.loop = loop
            loop.call_soon(self._turn)
        if self.taken < self.per_turn and not self.waiting:
            self.taken += 1
            return True
        self.waiting.append(conn)
        return False

    def _turn(self) -> None:
        self.taken = 0
        while self.waiting and self.taken < self.per_turn:
            self.taken += 1
            self.waiting.popleft().take_in()
        assert self.loop is not None
        if self.waiting or self.taken:
            self.loop.call_soon(self._turn)
        else:
            self.loop = None  # quiet: nothing scheduled until the next request


class _Connections:
    """The open connections of one guarded protocol class: the idle ones (between requests, or
    still sending a head), oldest first, each checked when taken; the cap; the intake."""

    def __init__(self, max_connections: int, per_turn: int):
        self.max_connections = max_connections
        self.idle: dict = {}
        self.intake = _Intake(per_turn)

    def close_idle(self) -> bool:
        """Close the connection idle the longest; False when none is."""
        while self.idle:
            conn = next(iter(self.idle))
            del self.idle[conn]
            if not conn.busy and not conn.transport.is_closing():
                conn.transport.close()
                return True
        return False


class _Guarded:
    """What both guarded protocols share, mixed in before uvicorn's protocol class: the connection
    cap, the idle list, the intake's hand-over and the head/body timer. A subclass sets
    ``_conns`` and ``_header_timeout_s`` and defines ``_take(data)`` (the bytes parsed) and
    ``_late()`` (the timer's end)."""

    _conns: _Connections
    _header_timeout_s: float
    _timer = None
    _waiting_for: str | None = None  # "head" or "body": what the timer waits for
    _held: list[bytes] | None = None  # bytes of a new request waiting for its turn (_Intake)
    cycle: Any
    transport: Any
    loop: Any
    connections: Any

    @property
    def busy(self) -> bool:
        """A request is in progress: its response is not complete yet."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self._conns.max_connections and not self._conns.close_idle():
            log.warning("HTTP connection cap (%d) reached, every connection busy; closing a new one", self._conns.max_connections)
            transport.close()
            return
        self._conns.idle[self] = None
        self._wait_for("head", self._header_timeout_s)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._conns.idle.pop(self, None)
        self._conns.idle[self] = None  # the newest idle one

    def _hold_or_take(self, data: bytes, new_request: bool) -> None:
        """Parse ``data``, unless it starts a new request whose turn has not come (_Intake)."""
        if self._held is not None:
            self._held.append(data)
            return
        if new_request and not self.busy and not self._conns.intake.admit(self, self.loop):
            self._held = [data]
            return
        self._take(data)

    def take_in(self) -> None:
        """The held request's turn (_Intake)."""
        held, self._held = self._held, None
        if held is not None and not self.transport.is_closing():
            self._take(b"".join(held))

    def _take(self, data: bytes) -> None:
        raise NotImplementedError

    def _late(self) -> None:
        raise NotImplementedError

    def _wait_for(self, what: str, seconds: float) -> None:
        if self._waiting_for != what:
            self._stop_waiting()
            self._waiting_for = what
            self._timer = self.loop.call_later(seconds, self._late)

    def _stop_waiting(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._waiting_for = None

    def connection_lost(self, exc) -> None:
        self._held = None  # its turn, if it comes, finds nothing
        self._stop_waiting()
        self._conns.idle.pop(self, None)
        super().connection_lost(exc)  # type: ignore[misc]


def _guarded_h11(header_timeout_s: float, body_timeout_s: float, max_connections: int, per_turn: int = 8):
    """uvicorn's h11 protocol with the guards uvicorn lacks. A request must arrive in time: its
    head within ``header_timeout_s`` of its first byte (or of the connection), its body within
    ``body_timeout_s`` of its head (else 408, and the connection is closed). At most
    ``max_connections`` are open: past that, a new connection closes the one idle the longest
    (between requests, or still sending its head; no key is known then), or is itself closed when
    every connection is busy with a request. Idle keep-alive connections (205 of them locked every
    tenant out) and unauthenticated ones (answered 401 at once) thus never hold capacity."""
    import h11
    import msgspec
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from radixserve.serve.openai.errors import APIError

    class GuardedH11Protocol(_Guarded, H11Protocol):
        _conns = _Connections(max_connections, per_turn)
        _header_timeout_s = header_timeout_s

        def data_received(self, data: bytes) -> None:
            self._hold_or_take(data, new_request=self.conn.their_state is h11.IDLE)

        def _take(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:
                self._wait_for("head", header_timeout_s)  # part of a request head
            elif state is h11.SEND_BODY:
                self._wait_for("body", body_timeout_s)  # the head is in, the body on its way
            else:
                self._stop_waiting()

        def _late(self) -> None:
            what, self._timer, self._waiting_for = self._waiting_for, None, None
            state = self.conn.their_state
            if self.transport.is_closing() or state is not (h11.IDLE if what == "head" else h11.SEND_BODY):
                return
            if what == "body" and self.cycle is not None:
                self._refuse_late_body()
            self.transport.close()

        def _refuse_late_body(self) -> None:
            """408 (unless the answer has begun); the app reads the request as abandoned."""
            if not self.cycle.response_started:
                err = APIError(408, f"the request body did not arrive within {body_timeout_s:g} s of its head", code="request_timeout")
                body = msgspec.json.encode(err.body())
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
                self.transport.write(
                    self.conn.send(h11.Response(status_code=408, headers=headers)) + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                )
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    return GuardedH11Protocol


class _Answered(Exception):
    """Raised from a parser callback to stop parsing a request already answered."""


def _guarded_httptools(
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    per_turn: int = 8,
    max_head_bytes: int = 64 * 1024,
    shed: Callable[[str, list], bool] | None = None,
    refusal: bytes = b"",
):
    """uvicorn's httptools protocol (a C parser: a burst of requests costs the gateway about a
    third of h11's time per request) with the guards of :func:`_guarded_h11`: a request head
    within ``header_timeout_s`` (and at most ``max_head_bytes``: else 400), its body within
    ``body_timeout_s`` of the head (else 408), at most ``max_connections`` open (the one idle the
    longest makes room), new requests taken in ``per_turn`` per loop turn (:class:`_Intake`).
    ``shed(path, headers)``: True for a POST the router would refuse (``Shedder.shed``); it is
    answered ``refusal`` (a whole HTTP response) as soon as its head is in, and closed: no ASGI
    cycle, task or response framing for a request of a burst that cannot run."""
    import httptools
    import msgspec
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from radixserve.serve.openai.errors import APIError

    late = APIError(408, f"the request body did not arrive within {body_timeout_s:g} s of its head", code="request_timeout")
    late_body = msgspec.json.encode(late.body())
    late_response = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(late_body) + late_body
    )

    class GuardedHttpToolsProtocol(_Guarded, HttpToolsProtocol):
        _conns = _Connections(max_connections, per_turn)
        _header_timeout_s = header_timeout_s
        _in_head = True  # no request, or one whose head is not complete yet
        _head_bytes = 0  # bytes received while in the head
        _refused = False  # answered at its head (shed): the connection is closing

        def data_received(self, data: bytes) -> None:
            self._hold_or_take(data, new_request=self._in_head and not self._head_bytes)

        def _take(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
                self._wait_for("head", header_timeout_s)  # part of a request head
            self._feed(data)
            if self._in_head and self._head_bytes > max_head_bytes and not self.transport.is_closing():
                self.send_400_response(f"Request head larger than {max_head_bytes} bytes.")

        def _feed(self, data: bytes) -> None:
            """uvicorn's ``data_received``, but a request answered at its head is no parse error."""
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                if self._refused:
                    return
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes = False, 0
            if shed is not None and self.parser.get_method() == b"POST" and shed(self.url.partition(b"?")[0].decode("latin-1"), self.headers):
                self._refused = True
                self.transport.write(refusal)
                self.transport.close()
                raise _Answered  # stops the parser: nothing more of this connection is read
            super().on_headers_complete()
            self._wait_for("body", body_timeout_s)  # the head is in, the body on its way

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True
            self._stop_waiting()

        def _late(self) -> None:
            what, self._timer, self._waiting_for = self._waiting_for, None, None
            if self.transport.is_closing() or self._in_head != (what == "head"):
                return
            cycle = self.cycle
            if what == "body" and cycle is not None:
                if not cycle.response_started:  # else the answer has begun: only the close is left
                    self.transport.write(late_response)
                cycle.disconnected = True  # the app reads the request as abandoned
                cycle.message_event.set()
            self.transport.close()

    return GuardedHttpToolsProtocol


def protocol(kind: str | None, header_timeout_s: float, body_timeout_s: float, max_connections: int, gateway: Gateway | None = None):
    """The guarded protocol ``kind`` (``httptools``, ``h11``; None: httptools when installed);
    with httptools, ``gateway``'s fast refusals are answered at the request head."""
    if kind is None:
        try:
            import httptools  # noqa: F401
        except ImportError:
            kind = "h11"
        else:
            kind = "httptools"
    if kind == "httptools":
        if gateway is None or gateway.shedder is None:
            return _guarded_httptools(header_timeout_s, body_timeout_s, max_connections)
        status, headers, body = gateway.shedder.response()
        head = b"".join(b"%s: %s\r\n" % kv for kv in headers)
        refusal = b"HTTP/1.1 %d Service Unavailable\r\n%sconnection: close\r\n\r\n%s" % (status, head, body)
        return _guarded_httptools(header_timeout_s, body_timeout_s, max_connections, shed=gateway.shedder.shed, refusal=refusal)
    if kind == "h11":
        return _guarded_h11(header_timeout_s, body_timeout_s, max_connections)
    raise ValueError(f"unknown HTTP protocol {kind!r}; expected httptools or h11")
