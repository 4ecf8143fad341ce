"""Serving the gateway: uvicorn on its own thread and (uvloop) event loop in the router's process,
so HTTP parsing never delays the router's message handling; guarded against slow and excess
connections. :func:`start_gateway` is what ``radixserve serve --http-port`` calls."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.openai.app import Gateway, GatewayConfig
from radixserve.serve.openai.tenants import Tenants
from radixserve.serve.tenants import configured_keys

log = logging.getLogger("radixserve.http")


class _Intake:
    """New requests taken in per loop turn, at most ``per_turn``; the others wait, in arrival
    order, for the next turns. uvloop hands over every readable connection in one turn: a burst
    of 300 requests was parsed whole (~75 ms with h11) before the first handler ran, so the
    router saw none of it, nor refused any, until the whole burst was in. Taken in a few per turn,
    the first requests reach the router and its admission view (``Gateway.admission``) refuses
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

    idle: dict[GuardedH11Protocol, None] = {}  # connections that went idle, oldest first (each checked when taken)
    intake = _Intake(per_turn)

    def close_idle() -> bool:
        """Close the connection idle the longest; False when none is."""
        while idle:
            conn = next(iter(idle))
            del idle[conn]
            if not conn.busy and not conn.transport.is_closing():
                conn.transport.close()
                return True
        return False

    class GuardedH11Protocol(H11Protocol):
        _timer = None
        _waiting_for: str | None = None  # "head" or "body": what the timer waits for
        _held: list[bytes] | None = None  # bytes of a new request waiting for its turn (_Intake)

        @property
        def busy(self) -> bool:
            """A request is in progress: its response is not complete yet."""
            return self.cycle is not None and not self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections and not close_idle():
                log.warning("HTTP connection cap (%d) reached, every connection busy; closing a new one", max_connections)
                transport.close()
                return
            idle[self] = None
            self._wait_for("head", header_timeout_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle.pop(self, None)
            idle[self] = None  # the newest idle one

        def data_received(self, data: bytes) -> None:
            if self._held is not None:
                self._held.append(data)
                return
            if self.conn.their_state is h11.IDLE and not self.busy and not intake.admit(self, self.loop):
                self._held = [data]
                return
            self._take(data)

        def take_in(self) -> None:
            """The held request's turn (_Intake)."""
            held, self._held = self._held, None
            if held is not None and not self.transport.is_closing():
                self._take(b"".join(held))

        def _take(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:
                self._wait_for("head", header_timeout_s)  # part of a request head
            elif state is h11.SEND_BODY:
                self._wait_for("body", body_timeout_s)  # the head is in, the body on its way
            else:
                self._stop_waiting()

        def _wait_for(self, what: str, seconds: float) -> None:
            if self._waiting_for != what:
                self._stop_waiting()
                self._waiting_for = what
                self._timer = self.loop.call_later(seconds, self._late)

        def _stop_waiting(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._waiting_for = None

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

        def connection_lost(self, exc) -> None:
            self._held = None  # its turn, if it comes, finds nothing
            self._stop_waiting()
            idle.pop(self, None)
            super().connection_lost(exc)

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
    ``shed(path, headers)``: True for a POST the router would refuse (``Gateway.shed``); it is
    answered ``refusal`` (a whole HTTP response) as soon as its head is in, and closed: no ASGI
    cycle, task or response framing for a request of a burst that cannot run."""
    import httptools
    import msgspec
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from radixserve.serve.openai.errors import APIError

    idle: dict[GuardedHttpToolsProtocol, None] = {}  # connections that went idle, oldest first (each checked when taken)
    intake = _Intake(per_turn)

    def close_idle() -> bool:
        """Close the connection idle the longest; False when none is."""
        while idle:
            conn = next(iter(idle))
            del idle[conn]
            if not conn.busy and not conn.transport.is_closing():
                conn.transport.close()
                return True
        return False

    late = APIError(408, f"the request body did not arrive within {body_timeout_s:g} s of its head", code="request_timeout")
    late_body = msgspec.json.encode(late.body())
    late_response = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(late_body) + late_body
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _timer = None
        _waiting_for: str | None = None  # "head" or "body": what the timer waits for
        _held: list[bytes] | None = None  # bytes of a new request waiting for its turn (_Intake)
        _in_head = True  # no request, or one whose head is not complete yet
        _head_bytes = 0  # bytes received while in the head
        _refused = False  # answered at its head (shed): the connection is closing

        @property
        def busy(self) -> bool:
            """A request is in progress: its response is not complete yet."""
            return self.cycle is not None and not self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections and not close_idle():
                log.warning("HTTP connection cap (%d) reached, every connection busy; closing a new one", max_connections)
                transport.close()
                return
            idle[self] = None
            self._wait_for("head", header_timeout_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle.pop(self, None)
            idle[self] = None  # the newest idle one

        def data_received(self, data: bytes) -> None:
            if self._held is not None:
                self._held.append(data)
                return
            if self._in_head and not self._head_bytes and not self.busy and not intake.admit(self, self.loop):
                self._held = [data]
                return
            self._take(data)

        def take_in(self) -> None:
            """The held request's turn (_Intake)."""
            held, self._held = self._held, None
            if held is not None and not self.transport.is_closing():
                self._take(b"".join(held))

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

        def _wait_for(self, what: str, seconds: float) -> None:
            if self._waiting_for != what:
                self._stop_waiting()
                self._waiting_for = what
                self._timer = self.loop.call_later(seconds, self._late)

        def _stop_waiting(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._waiting_for = None

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

        def connection_lost(self, exc) -> None:
            self._held = None  # its turn, if it comes, finds nothing
            self._stop_waiting()
            idle.pop(self, None)
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


def _protocol(kind: str | None, header_timeout_s: float, body_timeout_s: float, max_connections: int, gateway: Gateway | None = None):
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
        if gateway is None or gateway.admission is None:
            return _guarded_httptools(header_timeout_s, body_timeout_s, max_connections)
        status, headers, body = gateway.overloaded_response()
        head = b"".join(b"%s: %s\r\n" % kv for kv in headers)
        refusal = b"HTTP/1.1 %d Service Unavailable\r\n%sconnection: close\r\n\r\n%s" % (status, head, body)
        return _guarded_httptools(header_timeout_s, body_timeout_s, max_connections, shed=gateway.shed, refusal=refusal)
    if kind == "h11":
        return _guarded_h11(header_timeout_s, body_timeout_s, max_connections)
    raise ValueError(f"unknown HTTP protocol {kind!r}; expected httptools or h11")


class GatewayServer:
    """uvicorn serving a :class:`Gateway` on a thread with its own (uvloop) event loop.
    ``header_timeout_s``: time a connection has to send a complete request head;
    ``body_timeout_s``: time, after the head, for the body; ``max_connections``: open connections
    at most (beyond: the one idle the longest is closed, or the new one when none is); ``http``:
    the HTTP protocol, ``httptools`` or ``h11`` (None: httptools when installed)."""

    def __init__(
        self,
        gateway: Gateway,
        host: str,
        port: int,
        *,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        max_connections: int = 1024,
        http: str | None = None,
    ):
        import uvicorn

        self.gateway = gateway
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # here, so a busy port fails `serve` at once
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.config = uvicorn.Config(
            gateway.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # nothing reads the client's address; a middleware less per request
            timeout_keep_alive=15,
            timeout_graceful_shutdown=3,
            http=_protocol(http, header_timeout_s, body_timeout_s, max_connections, gateway),
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, name="radixserve-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        async def main():
            try:
                await self.server.serve(sockets=[self.sock])
            finally:
                await self.gateway.close()

        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())

    def start(self) -> GatewayServer:
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def _keys(args) -> dict[str, str]:
    """API keys -> tenants from ``--api-key`` (each its own tenant) and ``--api-keys-file``."""
    return configured_keys(getattr(args, "api_key", None), getattr(args, "api_keys_file", None))


def start_gateway(
    args,
    router_address: str,
    limits: P.Limits,
    tokenizer=None,
    *,
    tenant_secret: bytes | None = None,
    router_key: str | None = None,
    admission: Callable[[str], bool] | None = None,
) -> GatewayServer:
    """Start the gateway for ``radixserve serve`` (``args``: its parsed options). ``tenant_secret``:
    the router's (so a tenant's namespace is the same over HTTP and ZMQ); ``router_key``: the key
    the gateway's requests carry to the router (:func:`radixserve.serve.auth.gateway_key`);
    ``admission``: the in-process router's :meth:`AdmissionView.refuses
    <radixserve.serve.router.admission.AdmissionView.refuses>` (refusals answered at once)."""
    keys = _keys(args)
    if tokenizer is None:
        from radixserve.serve.router import load_tokenizer

        tokenizer = load_tokenizer(args.model)  # its own instance: this runs on another thread
    model = str(args.model)
    names = [Path(model).name or model, model]
    config = GatewayConfig(
        router=router_address,
        model_names=names,
        host=args.host,
        port=args.http_port,
        max_body_bytes=limits.max_frame_bytes,
        limits=limits,
        router_key=router_key,
    )
    try:
        server = GatewayServer(
            Gateway(config, tokenizer, Tenants(keys, tenant_secret), admission=admission),
            args.host,
            args.http_port,
            header_timeout_s=getattr(args, "http_header_timeout", 10.0),
            body_timeout_s=getattr(args, "http_body_timeout", 30.0),
            max_connections=getattr(args, "http_max_connections", 1024),
        ).start()
    except OSError as exc:
        raise RadixServeError(f"--http-port {args.http_port}: cannot listen on {args.host}: {exc}") from None
    print(f"radixserve: HTTP API on {server.url}/v1 (model {names[0]!r}; {f'{len(keys)} API keys' if keys else 'no API key required'})", flush=True)
    return server
