"""The router's transport: its two ROUTER sockets (clients on one, workers on the other, a CURVE
server), their ZAP handler, the count of client connections, and sending and receiving frames.
What it receives it decodes and hands on; what a message means is the router's business."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.runtime import open_files_limit
from radixserve.serve.router.state import Metrics, RouterConfig

log = logging.getLogger("radixserve.router")

MAX_CLIENTS = 16384  # client connections at most by default (also at most half the open-file limit)
MAX_DROPPABLE_BACKLOG = 64  # stats/health replies waiting for a client whose connection is full; more are dropped
_SENT, _FULL, _GONE = range(3)  # what a send to a client did


@dataclass(eq=False)
class _Backlog:
    """Frames waiting for a client whose connection holds ``client_sndhwm`` unread ones."""

    frames: collections.deque[tuple[bytes, bool]] = field(default_factory=collections.deque)  # (frame, droppable)
    droppable: int = 0


class Transport:
    """The client and worker sockets: binding them, sending to clients (holding a slow client's
    frames rather than dropping results) and to workers, and receiving frames, decoded, for the
    router's handlers. Owns the ZMQ context, both sockets, the ZAP thread that admits workers
    holding the secret and bounds client connections, each slow client's backlog, and which
    connections are the trusted gateway's. Tests use a subclass that records what is sent."""

    def __init__(self, config: RouterConfig, secret: str, metrics: Metrics) -> None:
        self.config = config
        self.secret = secret
        self.metrics = metrics
        self.address = ""
        self.worker_address = ""
        self.clients = 0  # open client connections (count_clients)
        self.max_clients = config.max_clients or 0  # beyond: new client connections are refused; set by bind() when None
        self._clients_full_logged = -60.0
        self._backlog: dict[bytes, _Backlog] = {}  # client connection -> frames waiting for it
        self._flush_scheduled = False
        self._trusted: set[bytes] = set()  # connections that authenticated as the gateway (their replies are never dropped)
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None  # clients
        self.wsock: zmq.asyncio.Socket | None = None  # workers
        self._auth: Any = None  # zmq.auth.thread.ThreadAuthenticator
        self._client_monitor: zmq.asyncio.Socket | None = None  # the client socket's connection events

    @property
    def bound(self) -> bool:
        return self.sock is not None

    def bind(self, *, keyless: bool) -> str:
        """Bind the client and worker sockets; returns the client address (with the real port
        when port is 0); the worker socket's is :attr:`worker_address`. A busy address raises
        :class:`~radixserve.errors.RadixServeError` naming it, and so does a client socket
        reachable from other hosts on a ``keyless`` server."""
        self.ctx = zmq.asyncio.Context()
        try:
            return self._bind_sockets(self.ctx, keyless)
        except BaseException:
            self.close(linger=0)  # an open socket or the ZAP thread would keep the process from exiting
            raise

    def _bind_sockets(self, ctx: zmq.asyncio.Context, keyless: bool) -> str:
        from radixserve.serve import auth

        cfg = self.config
        where = cfg.address or f"tcp://{cfg.host}:{cfg.port}"
        if keyless and not is_local_address(where):
            raise RadixServeError(
                f"refusing to open the client socket ({where}) beyond this host without API keys: anyone who "
                f"reaches it could run requests and probe every namespace's cache. Pass --api-key KEY or "
                f"--api-keys-file FILE (clients then send it: Client(..., api_key=KEY) or RADIXSERVE_API_KEY), or "
                f"keep clients on 127.0.0.1 and open only the worker socket (--worker-address tcp://HOST:PORT)"
            )
        self.max_clients = cfg.max_clients or min(MAX_CLIENTS, open_files_limit() // 2)
        self._auth = auth.start_authenticator(ctx, self.secret, self.metrics.counters, self.admit_client)
        sock = self.sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        # A client that reads nothing must not grow the router without bound (20k unread Stats
        # replies took 43 MB), and a busy one (the HTTP gateway: one connection, many streams)
        # must lose nothing. Past SNDHWM frames queued for one connection, libzmq refuses more
        # (ROUTER_MANDATORY: EAGAIN, not a silent drop): the router then holds that connection's
        # frames itself (send) and drops only stats/health replies beyond a few.
        sock.setsockopt(zmq.SNDHWM, cfg.client_sndhwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Hard cap (libzmq drops the peer): well above the soft limit, so a frame a bit too big
        # still gets an error reply naming the limit.
        sock.setsockopt(zmq.MAXMSGSIZE, max(4 * cfg.limits.max_frame_bytes, 16 * 2**20))
        # Client connections are bounded (see admit_client), counted from the socket's events.
        sock.zap_domain = auth.CLIENT_ZAP_DOMAIN.encode()
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._client_monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.address = _bind(sock, cfg.address, cfg.host, cfg.port, "client")
        wsock = self.wsock = ctx.socket(zmq.ROUTER)
        wsock.setsockopt(zmq.LINGER, 500)
        wsock.setsockopt(zmq.SNDHWM, 0)
        wsock.setsockopt(zmq.MAXMSGSIZE, P.WORKER_MAX_FRAME_BYTES)
        # A worker reconnecting after a link cut keeps its identity: the new connection takes
        # over from the old one (which TCP may not have noticed is dead yet).
        wsock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # ZMTP pings clean up connections that died without a FIN. Their timeout must be set: it
        # defaults to the interval, and one slow round trip would then drop a live connection.
        # Longer than heartbeat_timeout_s, so the router declares a worker dead before libzmq
        # drops its connection (messages still queued on it would be lost).
        wsock.setsockopt(zmq.HEARTBEAT_IVL, int(cfg.heartbeat_s * 1000))
        wsock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int((cfg.heartbeat_timeout_s + 2.0) * 1000))
        auth.make_server(wsock, self.secret)
        worker_address = cfg.worker_address
        if worker_address is None and cfg.address and cfg.address.startswith("ipc://"):
            worker_address = cfg.address + "-workers"
        port = cfg.worker_port if cfg.worker_port is not None else (cfg.port + 1 if cfg.port and not cfg.address else 0)
        host = cfg.host
        if cfg.address and cfg.address.startswith("tcp://"):
            host = cfg.address[len("tcp://") :].rsplit(":", 1)[0]
        self.worker_address = _bind(wsock, worker_address, host, port, "worker")
        return self.address

    def close(self, linger: int = 500) -> None:
        """Stop the ZAP handler, close both sockets and end the context (after ``linger`` ms for
        replies still queued). Idempotent, and safe after a :meth:`bind` that failed half-way:
        ``Context.term()`` waits forever for a socket left open."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        for sock in (self._client_monitor, self.sock, self.wsock):
            if sock is not None:
                sock.close(linger=linger)
        if self.ctx is not None:
            self.ctx.term()

    # -- client connections --------------------------------------------------------------------
    def admit_client(self) -> bool:
        """(On the ZAP thread, at each client handshake.) Whether a new client connection may
        stay: while at most :attr:`max_clients` are open. Every connection holds a file
        descriptor; past the process's limit libzmq spins on accept() and a worker restart
        fails (EMFILE), so the bound sits well below it. A refused libzmq peer does not retry."""
        if self.clients <= self.max_clients:
            return True
        self.metrics.count("refused_clients")
        now = time.monotonic()
        if now - self._clients_full_logged >= 60.0:
            self._clients_full_logged = now
            log.warning("%d client connections are open (at most %d): refusing new ones (refused_clients counts them)", self.clients, self.max_clients)
        return False

    async def count_clients(self) -> None:
        """Keep :attr:`clients`, the open client connections, from the client socket's monitor."""
        from zmq.utils.monitor import parse_monitor_message

        assert self._client_monitor is not None, "bind() first"
        while True:
            frames = await self._client_monitor.recv_multipart()
            try:
                accepted = parse_monitor_message(frames)["event"] == zmq.EVENT_ACCEPTED
            except Exception:
                self.metrics.task_failed("client count")
                continue
            self.clients = max(0, self.clients + (1 if accepted else -1))

    def trust(self, identity: bytes) -> None:
        """``identity`` authenticated as the in-process gateway: its replies are never dropped."""
        if identity not in self._trusted:
            if len(self._trusted) >= 64:  # reconnects: forget the old ones
                self._trusted.clear()
            self._trusted.add(identity)

    # -- sending -------------------------------------------------------------------------------
    def send(self, identity: bytes, msg: Any) -> None:
        """Send to a client. When its connection already holds ``client_sndhwm`` unread frames,
        the frame waits in a per-connection backlog (sent in order as the client reads), except
        a stats or health reply beyond :data:`MAX_DROPPABLE_BACKLOG` waiting ones: dropped
        (``dropped_replies``), unless the client is the trusted gateway. Request results are
        never dropped (a busy client loses nothing); what a client that never reads can make the
        router hold is its own requests' results and a few replies."""
        frame = P.encode(msg)
        backlog = self._backlog.get(identity)
        if backlog is None:
            if self._try_send(identity, frame) != _FULL:
                return
            backlog = self._backlog[identity] = _Backlog()
            self._flush_later(0.005)
        droppable = isinstance(msg, (P.StatsReply, P.HealthReply)) and identity not in self._trusted
        if droppable:
            if backlog.droppable >= MAX_DROPPABLE_BACKLOG:
                self.metrics.count("dropped_replies")
                return
            backlog.droppable += 1
        backlog.frames.append((frame, droppable))

    def reply_error(self, identity: bytes, rid: str, code: str, message: str) -> None:
        self.metrics.count(f"errors_{code}")
        self.send(identity, P.Error(id=rid, code=code, message=message))

    def send_worker(self, identity: bytes, msg: Any) -> None:
        """Send to a worker (on the worker socket)."""
        assert self.wsock is not None, "bind() first"
        try:
            self.wsock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("send to worker %r failed: %s", identity, exc)

    def _try_send(self, identity: bytes, frame: bytes) -> int:
        assert self.sock is not None, "bind() first"
        # pyzmq's asyncio send with NOBLOCK returns a finished future holding any error
        fut: Any = self.sock.send_multipart([identity, frame], flags=zmq.NOBLOCK)
        exc = fut.exception() if fut.done() else None
        if exc is None:
            return _SENT
        if isinstance(exc, zmq.Again):
            return _FULL
        log.debug("send to %r failed: %s", identity, exc)  # EHOSTUNREACH: the client left
        return _GONE

    def _flush_later(self, delay: float) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_later(delay, self._flush_backlog, delay)

    def _flush_backlog(self, delay: float) -> None:
        """Send what waits for each client, in order, as far as its connection takes it; retry
        soon after progress, less and less often (up to 0.5 s) without."""
        self._flush_scheduled = False
        progress = False
        for identity, backlog in list(self._backlog.items()):
            frames = backlog.frames
            while frames:
                frame, droppable = frames[0]
                outcome = self._try_send(identity, frame)
                if outcome == _FULL:
                    break
                frames.popleft()
                backlog.droppable -= droppable
                progress = True
                if outcome == _GONE:
                    frames.clear()
            if not frames:
                del self._backlog[identity]
        if self._backlog:
            self._flush_later(0.005 if progress else min(0.5, delay * 2))

    # -- receiving -----------------------------------------------------------------------------
    async def receive_clients(self, handle: Callable[[list[bytes]], None]) -> None:
        """Hand every message on the client socket to ``handle(frames)``, for good."""
        assert self.sock is not None, "bind() first"
        async for parts in P.received(self.sock.recv_multipart):
            try:
                handle(parts)
            except Exception:  # a bug handling one message must not take the router down
                log.exception("router failed handling a message")

    async def receive_workers(self, handle: Callable[[list[bytes]], None]) -> None:
        """Hand every message on the worker socket to ``handle(frames)``, for good."""
        assert self.wsock is not None, "bind() first"
        async for parts in P.received(self.wsock.recv_multipart):
            try:
                handle(parts)
            except Exception:
                log.exception("router failed handling a worker message")

    def client_message(self, parts: list[bytes]) -> Any:
        """The message in a client's frames; None after answering a malformed one with an error."""
        identity = parts[0]
        if len(parts) != 2:
            self.metrics.count("bad_frames")
            self.reply_error(identity, "", P.BAD_REQUEST, f"frame: expected one frame per message, got {len(parts) - 1}")
            return None
        try:
            return P.decode(parts[1], max_frame_bytes=self.config.limits.max_frame_bytes)
        except P.DecodeError as exc:
            self.metrics.count("bad_frames")
            self.reply_error(identity, exc.request_id, P.BAD_REQUEST, str(exc))
            return None

    def worker_message(self, parts: list[bytes]) -> Any:
        """The message in a worker's frames (the peer holds the secret: CURVE let it in); None
        for a malformed one (counted and logged)."""
        if len(parts) != 2:
            self.metrics.count("bad_frames")
            return None
        try:
            return P.decode(parts[1], max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
        except P.DecodeError as exc:
            self.metrics.count("bad_frames")
            log.warning("bad frame from worker %r: %s", parts[0], exc)
            return None


def is_local_address(address: str) -> bool:
    """Whether a ZMQ address can only be reached from this host: ipc:// or inproc://, or tcp://
    on a loopback address (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or interface (eth0, *): it may well be reachable from elsewhere
        return False


def _bind(sock, address: str | None, host: str, port: int, what: str) -> str:
    try:
        if address:
            sock.bind(address)
            return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if port == 0:
            return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
        sock.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"
    except zmq.ZMQError as exc:
        where = address or f"tcp://{host}:{port}"
        hint = " (is another radixserve running? pick another --port, or 0 for a free one)" if exc.errno == zmq.EADDRINUSE else ""
        raise RadixServeError(f"cannot bind the {what} socket to {where}: {exc}{hint}") from None
