"""Serving the gateway: uvicorn on its own thread and (uvloop) event loop in the router's process,
so HTTP parsing never delays the router's message handling; guarded against slow and excess
connections. :func:`start_gateway` is what ``radixserve serve --http-port`` calls."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.openai.app import Gateway, GatewayConfig
from radixserve.serve.openai.tenants import Tenants, load_keys_file, tenant_for_key

log = logging.getLogger("radixserve.http")


def _guarded_h11(header_timeout_s: float, max_connections: int):
    """uvicorn's h11 protocol with two guards uvicorn lacks: a connection must complete each
    request head within ``header_timeout_s`` (slowloris), and connections beyond
    ``max_connections`` are closed at once."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("HTTP connection cap (%d) reached; closing a new connection", max_connections)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # still no complete request head

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # part of a request head: it has header_timeout_s to finish
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


class GatewayServer:
    """uvicorn serving a :class:`Gateway` on a thread with its own (uvloop) event loop.
    ``header_timeout_s``: time a connection has to send a complete request head;
    ``max_connections``: open connections at most (beyond: closed at once)."""

    def __init__(self, gateway: Gateway, host: str, port: int, *, header_timeout_s: float = 10.0,
                 max_connections: int = 1024):
        import uvicorn

        self.gateway = gateway
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # here, so a busy port fails `serve` at once
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.config = uvicorn.Config(gateway.app, lifespan="off", log_level="warning", access_log=False,
                                     timeout_keep_alive=15, timeout_graceful_shutdown=3,
                                     http=_guarded_h11(header_timeout_s, max_connections),
                                     h11_max_incomplete_event_size=64 * 1024)
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
    keys = {key: tenant_for_key(key) for key in getattr(args, "api_key", None) or []}
    if getattr(args, "api_keys_file", None):
        try:
            keys.update(load_keys_file(args.api_keys_file))
        except (OSError, ValueError) as exc:
            raise RadixServeError(f"--api-keys-file: {exc}") from None
    return keys


def start_gateway(args, router_address: str, limits: P.Limits, tokenizer=None) -> GatewayServer:
    """Start the gateway for ``radixserve serve`` (``args``: its parsed options)."""
    keys = _keys(args)
    if tokenizer is None:
        from radixserve.serve.router import load_tokenizer

        tokenizer = load_tokenizer(args.model)  # its own instance: this runs on another thread
    model = str(args.model)
    names = [Path(model).name or model, model]
    config = GatewayConfig(router=router_address, model_names=names, host=args.host, port=args.http_port,
                           max_body_bytes=limits.max_frame_bytes, limits=limits)
    try:
        server = GatewayServer(Gateway(config, tokenizer, Tenants(keys)), args.host, args.http_port,
                               header_timeout_s=getattr(args, "http_header_timeout", 10.0),
                               max_connections=getattr(args, "http_max_connections", 1024)).start()
    except OSError as exc:
        raise RadixServeError(f"--http-port {args.http_port}: cannot listen on {args.host}: {exc}") from None
    print(f"radixserve: HTTP API on {server.url}/v1 (model {names[0]!r}; "
          f"{f'{len(keys)} API keys' if keys else 'no API key required'})", flush=True)
    return server
