"""Serving the gateway: uvicorn on its own thread and (uvloop) event loop in the router's process,
so HTTP parsing never delays the router's message handling; guarded against slow and excess
connections. :func:`start_gateway` is what ``radixserve serve --http-port`` calls."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.openai.app import Gateway, GatewayConfig
from radixserve.serve.openai.protocols import protocol
from radixserve.serve.openai.tenants import Tenants
from radixserve.serve.tenants import configured_keys

log = logging.getLogger("radixserve.http")


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
            http=protocol(http, header_timeout_s, body_timeout_s, max_connections, gateway),
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
