"""The :class:`Router`: its components wired together, the message tables that route each
message type to the bound method that handles it, the main loop, the ticker, shutdown and the
stopping.

Components (each owns its state; they reach one another only through the references given here):
:class:`~radixserve.serve.router.sockets.Transport` (sockets, auth, frames in and out),
:class:`~radixserve.serve.router.registry.WorkerRegistry` (workers, liveness; its
:class:`~radixserve.serve.router.index_sync.IndexSync` keeps their cache-index mirrors),
:class:`~radixserve.serve.router.jobs.JobTable` (jobs and the fair queue),
:class:`~radixserve.serve.router.dispatch.Dispatcher` (jobs onto workers and back),
:class:`~radixserve.serve.router.front.ClientFront` (client calls into jobs) and
:class:`~radixserve.serve.router.status.RouterStatus` (health and the stats document). Each message is
handled to the end on the loop, so the state never races."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from radixserve import protocol as P
from radixserve.serve.metrics import MetricsLog
from radixserve.serve.router.admission import AdmissionView
from radixserve.serve.router.dispatch import Dispatcher
from radixserve.serve.router.front import ClientFront
from radixserve.serve.router.index_sync import IndexSync
from radixserve.serve.router.jobs import JobTable
from radixserve.serve.router.registry import WorkerRegistry
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Metrics, RouterConfig, WorkerState
from radixserve.serve.router.status import RouterStatus
from radixserve.serve.routing import make_policy
from radixserve.serve.tenants import TenantKeys

if TYPE_CHECKING:
    from radixserve.serve.supervisor import Supervisor

log = logging.getLogger("radixserve.router")

Ctx = TypeVar("Ctx")
Msg = TypeVar("Msg")


class Handlers(Generic[Ctx]):
    """Message type -> the bound method that handles it, ``handler(ctx, msg)``. :meth:`add`
    types the pair, so the type checker sees that each handler takes its message type."""

    def __init__(self) -> None:
        self._by_type: dict[type, Callable[[Ctx, Any], None]] = {}

    def add(self, kind: type[Msg], handler: Callable[[Ctx, Msg], None]) -> None:
        self._by_type[kind] = handler

    def get(self, kind: type) -> Callable[[Ctx, Any], None] | None:
        return self._by_type.get(kind)

    def __contains__(self, kind: type) -> bool:
        return kind in self._by_type


class Router:
    """The router process: the components, wired. Client messages are handled with the client's
    connection (``handler(identity, msg)``), worker messages with the registered worker
    (``handler(worker, msg)``); a Register, the one message from a connection that is not a
    worker yet, goes to :meth:`Dispatcher.on_register`."""

    def __init__(self, config: RouterConfig, tokenizer: Any = None, *, transport: type[Transport] = Transport):
        config.check()
        from radixserve.serve import auth

        self.config = config
        self.metrics = Metrics()
        self.secret = auth.check_secret(config.secret) if config.secret else auth.new_secret()
        self.tenants = TenantKeys(config.api_keys)
        self.gateway_key = auth.gateway_key(self.secret)  # the in-process HTTP gateway's (it authenticated its tenants)
        self.transport = transport(config, self.secret, self.metrics)  # tests pass one that records what is sent
        self.registry = WorkerRegistry(config, self.transport, IndexSync(self.transport, self.metrics), self.metrics)
        self.jobs = JobTable()
        policy = make_policy(
            config.policy,
            **(
                dict(balance_abs=config.balance_abs, balance_rel=config.balance_rel, cache_threshold=config.cache_threshold)
                if config.policy == "cache_aware"
                else {}
            ),
        )
        self.dispatcher = Dispatcher(config, self.jobs, self.registry, policy, self.transport, self.metrics)
        self.front = ClientFront(
            config,
            tokenizer,
            self.tenants,
            self.gateway_key,
            registry=self.registry,
            jobs=self.jobs,
            dispatcher=self.dispatcher,
            transport=self.transport,
            metrics=self.metrics,
        )
        self.status = RouterStatus(
            config, registry=self.registry, jobs=self.jobs, dispatcher=self.dispatcher, front=self.front, transport=self.transport, metrics=self.metrics
        )
        self.client_handlers: Handlers[bytes] = Handlers()  # the client socket
        self.client_handlers.add(P.Generate, self.front.on_generate)
        self.client_handlers.add(P.Choose, self.front.on_choose)
        self.client_handlers.add(P.Abort, self.front.on_abort)
        self.client_handlers.add(P.Health, self.status.on_health)
        self.client_handlers.add(P.Stats, self.status.on_stats)
        self.worker_handlers: Handlers[WorkerState] = Handlers()  # the worker socket, from registered workers
        self.worker_handlers.add(P.Heartbeat, self.registry.on_heartbeat)
        self.worker_handlers.add(P.Goodbye, self.registry.on_goodbye)
        self.worker_handlers.add(P.CacheEvents, self.registry.index.on_cache_events)
        self.worker_handlers.add(P.Chunk, self.dispatcher.on_chunk)
        self.worker_handlers.add(P.Final, self.dispatcher.on_final)
        self.worker_handlers.add(P.ChoiceFinal, self.dispatcher.on_choice_final)
        self.worker_handlers.add(P.Error, self.dispatcher.on_worker_error)
        self.worker_handlers.add(P.Leave, self.dispatcher.on_leave)
        self.fatal: str | None = None  # why serve must exit non-zero (e.g. every worker failed at start-up)
        self.forced = False  # a second interrupt: stopped without draining
        self._stopped: asyncio.Event | None = None
        self._last_tick = time.monotonic()

    # -- what serve and the tests reach --------------------------------------------------------
    @property
    def address(self) -> str:
        return self.transport.address

    @property
    def worker_address(self) -> str:
        return self.transport.worker_address

    @property
    def admission(self) -> AdmissionView:
        """What a new job would get, as the loop last published it (the in-process gateway reads it)."""
        return self.dispatcher.admission

    @property
    def counters(self) -> dict[str, int]:
        return self.metrics.counters

    @property
    def shutting_down(self) -> bool:
        return self.dispatcher.shutting_down

    @property
    def supervisor(self) -> Supervisor | None:
        """serve's Supervisor of the local worker processes (None: no local workers)."""
        return self.registry.supervisor

    @supervisor.setter
    def supervisor(self, supervisor: Supervisor | None) -> None:
        self.registry.supervisor = supervisor

    @property
    def on_ready(self) -> Callable[[int], None] | None:
        """Called once with the number of live workers when every local one joined."""
        return self.registry.on_ready

    @on_ready.setter
    def on_ready(self, fn: Callable[[int], None] | None) -> None:
        self.registry.on_ready = fn

    def bind(self) -> str:
        """Bind the sockets (:meth:`Transport.bind`); returns the client address."""
        return self.transport.bind(keyless=not self.tenants.required)

    def close(self, linger: int = 500) -> None:
        self.transport.close(linger)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self.front.set_tokenizer(tokenizer)

    def prompt_char_limit(self) -> int:
        return self.front.prompt_char_limit()

    # -- messages ------------------------------------------------------------------------------
    def on_client_frames(self, parts: list[bytes]) -> None:
        """A message on the client socket: only client requests are accepted here."""
        identity = parts[0]
        msg = self.transport.client_message(parts)
        if msg is None:
            return
        handler = self.client_handlers.get(type(msg))
        if handler is None:
            worker_msg = type(msg) in self.worker_handlers or isinstance(msg, P.Register)
            hint = " (workers connect to the worker socket, with the secret)" if worker_msg else ""
            self.transport.reply_error(identity, getattr(msg, "id", ""), P.BAD_REQUEST, f"type: {type(msg).__name__} is not a request a router accepts{hint}")
            return
        try:
            handler(identity, msg)
        except Exception as exc:  # a bug must not leave a client call without any reply (a hang with timeout=None)
            log.exception("router failed handling a %s", type(msg).__name__)
            self.transport.reply_error(
                identity, getattr(msg, "id", ""), P.INTERNAL, f"router error handling the request ({type(exc).__name__}); it was not run"
            )
        finally:
            self.dispatcher.publish()

    def on_worker_frames(self, parts: list[bytes]) -> None:
        """A message on the worker socket: the peer holds the secret (CURVE let it in)."""
        try:
            self._on_worker_frames(parts)
        finally:
            self.dispatcher.publish()

    def _on_worker_frames(self, parts: list[bytes]) -> None:
        identity = parts[0]
        worker = self.registry.of(identity)
        msg = self.transport.worker_message(parts)
        if msg is None:
            return
        if isinstance(msg, P.Register):
            if worker is not None:
                worker.last_seen = time.monotonic()
            self.dispatcher.on_register(identity, worker, msg)
            return
        handler = self.worker_handlers.get(type(msg))
        if handler is None:
            log.warning("worker %r sent a %s, which is not a worker message", identity, type(msg).__name__)
            return
        if worker is None:  # not (or no longer) registered, e.g. declared dead during a link cut
            if not isinstance(msg, (P.Leave, P.Goodbye)) and not self.shutting_down:
                self.registry.ask_rejoin(identity)
            return
        worker.last_seen = time.monotonic()
        handler(worker, msg)

    # -- the loop ------------------------------------------------------------------------------
    async def serve(self) -> None:
        if not self.transport.bound:
            self.bind()
        # What the process holds by now (torch, transformers, the tokenizer: ~300k objects) lives
        # as long as it does: frozen, a full collection no longer walks it, which took 0.15-0.3 s
        # with both loops (router and gateway) stopped, in the tail of every kind of answer.
        gc.collect()
        gc.freeze()
        self._stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_shutdown)
            except (NotImplementedError, RuntimeError):
                pass
        tasks = [
            asyncio.ensure_future(self.transport.receive_clients(self.on_client_frames)),
            asyncio.ensure_future(self.transport.receive_workers(self.on_worker_frames)),
            asyncio.ensure_future(self._ticker()),
            asyncio.ensure_future(self.transport.count_clients()),
        ]
        if self.config.metrics_log:
            tasks.append(asyncio.ensure_future(self._metrics_logger(self.config.metrics_log)))
        await self._stopped.wait()
        for t in tasks:
            t.cancel()
        self.front.close()
        self.close()

    async def _metrics_logger(self, path: str) -> None:
        out = MetricsLog(path)
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                out.write(self.stats())
            except Exception:
                self.metrics.task_failed("metrics log")

    async def _ticker(self) -> None:
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # one error must not end the liveness checks and restarts for good
                self.metrics.task_failed("ticker")
            finally:
                self.dispatcher.publish()

    def tick(self, now: float) -> None:
        """Every ``heartbeat_s``: restart local workers that are due, declare silent or exited
        workers dead, ping the others, forget long-dead remote ones, fail what waited too long
        for any worker."""
        late = now - self._last_tick - self.config.heartbeat_s
        self._last_tick = now
        if late > self.config.heartbeat_s:
            log.warning("router loop stalled for %.1f s; not counting it against workers", late)
            self.registry.excuse_stall(now)
        supervisor = self.registry.supervisor
        if supervisor is not None:
            supervisor.tick(now, shutting_down=self.shutting_down)
            if supervisor.fatal and not self.registry.any_alive():
                self.fatal = supervisor.fatal
                log.error("%s", self.fatal)
                self.request_shutdown()
        for worker, why in self.registry.check(now):
            self.dispatcher.worker_lost(worker, why)
        self.registry.forget_dead(now)
        self.dispatcher.expire_queue(now)

    # -- stopping ------------------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """First call (Ctrl-C, SIGTERM): drain. A second one: stop now, without draining."""
        if not self.shutting_down:
            asyncio.ensure_future(self.shutdown())
        elif not self.forced:
            self.forced = True
            log.warning("second interrupt: stopping now without draining")
            self.dispatcher.fail_all(P.SHUTTING_DOWN, "the router was stopped")
            for proc in self.registry.local_procs:
                if proc.poll() is None:
                    proc.kill()
            if self._stopped is not None:
                self._stopped.set()

    async def shutdown(self) -> None:
        """Refuse new work, fail the queue, let requests in flight finish for ``drain_s``, fail
        what is left with ``shutting_down``, stop the workers."""
        if self.shutting_down:
            return
        self.dispatcher.shutting_down = True
        self.dispatcher.publish()  # the gateway passes everything on: the router answers shutting_down
        log.info("shutting down: %d queued, %d in flight", len(self.jobs.queue), len(self.jobs.works))
        self.dispatcher.fail_queue(P.SHUTTING_DOWN, "the router is shutting down")
        for w in self.registry.workers.values():
            if w.alive:
                self.transport.send_worker(w.identity, P.Shutdown(grace_s=self.config.drain_s))
        deadline = time.monotonic() + self.config.drain_s + 2.0
        while self.jobs.works and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.dispatcher.fail_in_flight(P.SHUTTING_DOWN, "the router shut down before the request finished")
        self.dispatcher.fail_all(P.SHUTTING_DOWN, "the router shut down")
        await asyncio.sleep(0.2)  # let the replies leave
        for proc in self.registry.local_procs:
            try:
                proc.wait(timeout=5.0)
            except Exception:
                proc.kill()
        if self._stopped is not None:
            self._stopped.set()

    def stats(self, probe: dict[str, int] | None = None) -> dict[str, Any]:
        return self.status.document(probe)


def load_tokenizer(model: str | None):
    """The HF fast tokenizer of the model directory or .gguf file (the default model's when None)."""
    from transformers import AutoTokenizer

    from radixserve.model.default import resolve_model

    model = str(resolve_model(model))
    return shareable(AutoTokenizer.from_pretrained(model, local_files_only=True))


def shareable(tokenizer):
    """``tokenizer``, ready to be called from several threads at once. A HF fast tokenizer is
    thread-safe to encode and decode with, but its Rust backend also holds truncation, padding and
    special-token settings, which each call first sets to its own when they differ: a mutable
    borrow, and one while another thread encodes raises ``RuntimeError: Already borrowed``
    (huggingface/tokenizers#537; what a global lock guarded against). radixserve calls tokenizers
    only with the defaults: one call here sets them, and later calls only read them."""
    if getattr(tokenizer, "is_fast", False):
        tokenizer("x")
    return tokenizer
