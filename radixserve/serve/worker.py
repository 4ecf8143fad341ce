"""A worker process: one Engine behind a DEALER socket connected to the router's worker socket.

The connection is CURVE-authenticated with the shared worker secret (:mod:`radixserve.serve.auth`);
the Register message carries the model fingerprint, and a :class:`~radixserve.protocol.Refused`
answer (another model) makes the worker exit with status 3.

Threads: the asyncio loop (uvloop) owns the socket; the Engine's scheduler runs in its own
thread. Everything the engine thread produces (token chunks, finals, cache events) is handed
to the loop with ``call_soon_threadsafe`` into ONE ordered outbox, so the router always sees a
request's cache insert events before its final message. Cache events are batched
(:class:`~radixserve.serve.cache_events.CacheEventOutbox`): about one message per step.

Across hosts (:doc:`README`, "Deployment"): every CacheEvents message carries a sequence number,
so the router notices lost events and asks for a :class:`~radixserve.protocol.Rejoin`; every
registration is followed by a snapshot of the radix tree (``reset``), taken on the engine thread
so it is consistent with the events before and after it. The router's mirror of this worker's
cache is therefore exact again after any link cut. On SIGTERM the worker drains, then sends
:class:`~radixserve.protocol.Leave` so the router reroutes at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.cache_events import CacheEventOutbox
from radixserve.serve.grammar_pool import CompileAborted, WorkerGrammars
from radixserve.serve.metrics import Histogram

log = logging.getLogger("radixserve.worker")

HEARTBEAT_S = 0.5  # the router declares a worker dead after --heartbeat-timeout (3 s) of silence
# No word from the router this long: register again. Longer than the router's heartbeat timeout,
# so after a link cut the router has already given up the old session when the new one arrives.
ROUTER_TIMEOUT_S = 5.0
GRAMMAR_TIMEOUT_S = 10.0  # a grammar compile longer than this is stopped; its request gets bad_request


class Worker:
    def __init__(
        self,
        engine,
        router: str,
        name: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        router_timeout_s: float = ROUTER_TIMEOUT_S,
        parent_pid: int | None = None,
        secret: str,
        grammar_timeout_s: float | None = GRAMMAR_TIMEOUT_S,
    ):
        self.parent = parent_pid  # exit once this process is gone (None: never)
        self.engine = engine
        self.router = router
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.router_timeout_s = router_timeout_s
        self.session = secrets.token_hex(8)
        self.events = CacheEventOutbox(name, self._send)
        self.secret = secret
        self.refused: str | None = None
        from radixserve.serve.auth import model_fingerprint

        self.fingerprint = model_fingerprint(engine.info()["model"], len(engine.tokenizer))
        self.active: dict[str, Any] = {}  # work id -> Request
        # Grammars compile in a child process, killed past grammar_timeout_s (None: in a thread, unbounded)
        self.grammars = WorkerGrammars(getattr(engine, "grammars", None), grammar_timeout_s)
        self.stopping = False
        self._last_router = time.monotonic()
        self._registered_in_silence = False
        self.ttft = Histogram()
        self.e2e = Histogram()

    # -- engine thread -> loop -----------------------------------------------------------------
    def _snapshot(self) -> None:  # engine thread, between steps
        self.events.snapshot(self.engine.cache_leaves())

    def _on_chunk(self, work: P.Work, chunk) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self._forward_chunk, work, chunk)

    def _forward_chunk(self, work: P.Work, chunk) -> None:  # loop
        self.events.flush()  # keep order: cache events produced before this chunk go first
        out = chunk.output
        if work.stream and (chunk.token_ids or chunk.text) and (out is None or out.finish_reason in ("stop", "length")):
            self._send(P.Chunk(id=work.id, token_ids=chunk.token_ids, text=chunk.text, logprobs=chunk.logprobs))
        if out is None:
            return
        self.active.pop(work.id, None)
        if out.finish_reason == "abort" and self.stopping:
            self._send(P.Error(id=work.id, code=P.SHUTTING_DOWN, message=f"worker {self.name} is shutting down"))
            return
        if out.finish_reason == "error":
            self._send(P.Error(id=work.id, code=P.INTERNAL, message=f"worker {self.name}: the request failed in the engine (see the worker log)"))
            return
        self.ttft.observe(out.ttft_s)
        self.e2e.observe(out.e2e_s)
        self._send(
            P.Final(
                id=work.id,
                token_ids=out.token_ids,
                text=out.text,
                finish_reason=out.finish_reason,
                usage=P.Usage(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, completion_tokens=len(out.token_ids)),
                timings=P.Timings(queue_s=out.queue_s, ttft_s=out.ttft_s, e2e_s=out.e2e_s),
                worker=self.name,
                logprobs=out.logprobs,
            )
        )

    # -- socket --------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._outq.put_nowait(P.encode(msg))

    async def _sender(self) -> None:
        while True:
            frame = await self._outq.get()
            await self.sock.send(frame)

    def _register(self) -> None:
        e = self.engine
        self._send(
            P.Register(
                worker=self.name,
                pid=os.getpid(),
                host=socket.gethostname(),
                max_model_len=e.max_model_len,
                kv_total_tokens=e.pool.capacity_tokens,
                page_size=e.pool.page_size,
                active=list(self.active),
                fingerprint=self.fingerprint,
                session=self.session,
            )
        )
        # The router starts this worker's cache mirror from scratch: send it the whole tree,
        # taken on the engine thread so no event is lost or counted twice around it.
        self.engine.call_soon(self._snapshot)

    def _abort(self, work_id: str) -> None:
        if self.grammars.abort(work_id):
            return
        item = self.active.get(work_id)
        if item is None:
            return
        if hasattr(item, "abort"):  # a choose call: its sub-requests
            item.abort()
        else:
            self.engine.abort(work_id)

    def _handle(self, msg) -> None:
        self._last_router = time.monotonic()
        self._registered_in_silence = False
        if isinstance(msg, P.Work):
            self._start(msg)
        elif isinstance(msg, P.ChooseWork):
            self._start_choose(msg)
        elif isinstance(msg, P.Abort):
            self._abort(msg.id)
        elif isinstance(msg, P.Shutdown):
            asyncio.ensure_future(self.drain(msg.grace_s))
        elif isinstance(msg, P.Ping):
            pass
        elif isinstance(msg, P.Rejoin):
            if self.stopping:
                pass
            elif msg.register:
                log.info("the router asks this worker to register again (%s)", msg.reason or "no reason given")
                self._register()
            else:
                log.info("the router asks for a cache snapshot (%s)", msg.reason or "no reason given")
                self.engine.call_soon(self._snapshot)
        elif isinstance(msg, P.Refused):
            log.error("the router refused this worker: %s", msg.reason)
            self.refused = msg.reason
            asyncio.ensure_future(self.drain(0.0))

    def _start(self, work: P.Work) -> None:
        if self.stopping:
            self._send(P.Error(id=work.id, code=P.SHUTTING_DOWN, message=f"worker {self.name} is shutting down"))
            return
        if work.params.structured is not None:
            # Compiling a grammar can take seconds (a large schema or choice list): off the loop,
            # so heartbeats keep going and the router does not declare this worker dead.
            self.grammars.begin(work.id)
            asyncio.ensure_future(self._start_structured(work))
            return
        try:
            req = self._make_request(work)
        except Exception as exc:
            self._refuse(work, exc)
            return
        self._launch(work, req)

    async def _start_structured(self, work: P.Work) -> None:
        try:
            await self.grammars.compile(work.params.structured, work.namespace, work.id)
            req = await asyncio.get_running_loop().run_in_executor(None, self._make_request, work)
        except CompileAborted:  # aborted while its grammar compiled: never started, so answered here
            self.grammars.end(work.id)
            self._send(
                P.Final(
                    id=work.id,
                    token_ids=[],
                    text="",
                    finish_reason="abort",
                    usage=P.Usage(prompt_tokens=len(work.token_ids), cached_tokens=0, completion_tokens=0),
                    timings=P.Timings(queue_s=0.0, ttft_s=0.0, e2e_s=0.0),
                    worker=self.name,
                )
            )
            return
        except Exception as exc:
            req = None
            self._refuse(work, exc)
        aborted = self.grammars.end(work.id)
        if req is not None:
            self._launch(work, req)
            if aborted:  # the abort came while its grammar compiled: the engine answers it in order
                self.engine.abort(work.id)

    def _make_request(self, work: P.Work):
        return self.engine.make_request(work.token_ids, work.params, request_id=work.id, namespace=work.namespace)

    def _refuse(self, work: P.Work, exc: Exception) -> None:
        """The error reply for a request the engine would not take: never leave one without a final."""
        if isinstance(exc, RadixServeError):
            self._send(P.Error(id=work.id, code=exc.code, message=str(exc)))
        else:
            log.error("make_request failed", exc_info=exc)
            self._send(P.Error(id=work.id, code=P.INTERNAL, message=f"{type(exc).__name__}: {exc}"))

    def _launch(self, work: P.Work, req) -> None:
        self.active[work.id] = req
        self.engine.add_request(req, lambda chunk: self._on_chunk(work, chunk), stream=work.stream)

    def _start_choose(self, work: P.ChooseWork) -> None:
        if self.stopping:
            self._send(P.Error(id=work.id, code=P.SHUTTING_DOWN, message=f"worker {self.name} is shutting down"))
            return

        def on_done(result, error) -> None:  # engine thread
            self.loop.call_soon_threadsafe(self._forward_choice, work, result, error)

        try:
            job = self.engine.submit_choose(
                work.token_ids,
                work.choices,
                on_done,
                normalize=work.normalize,
                temperature=work.temperature,
                seed=work.seed,
                namespace=work.namespace,
                request_id=work.id,
                choice_ids=work.choice_ids,
            )
        except RadixServeError as exc:
            self._send(P.Error(id=work.id, code=exc.code, message=str(exc)))
            return
        except Exception as exc:  # never leave a request without a final message
            log.exception("choose failed to start")
            self._send(P.Error(id=work.id, code=P.INTERNAL, message=f"{type(exc).__name__}: {exc}"))
            return
        self.active[work.id] = job

    def _forward_choice(self, work: P.ChooseWork, result, error) -> None:  # loop
        self.events.flush()
        self.active.pop(work.id, None)
        if result is None:
            code = P.SHUTTING_DOWN if self.stopping else P.INTERNAL
            self._send(P.Error(id=work.id, code=code, message=f"worker {self.name}: choose ended ({error})"))
            return
        self.ttft.observe(result.ttft_s)
        self.e2e.observe(result.e2e_s)
        self._send(
            P.ChoiceFinal(
                id=work.id,
                best=result.best,
                index=result.index,
                ranked=result.ranked,
                usage=result.usage,
                timings=P.Timings(queue_s=0.0, ttft_s=result.ttft_s, e2e_s=result.e2e_s),
                worker=self.name,
            )
        )

    def _heartbeat(self) -> P.Heartbeat:
        try:
            stats = dict(self.engine.stats())
        except RuntimeError:  # a dict changed size under us (engine thread): next time
            stats = {}
        stats["ttft_s"] = self.ttft.to_dict()
        stats["e2e_s"] = self.e2e.to_dict()
        return P.Heartbeat(
            worker=self.name,
            running=stats.get("running", 0),
            waiting=stats.get("waiting", 0),
            stats=stats,
            events_seq=self.events.seq,
            reset_seq=self.events.reset_seq,
        )

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._send(self._heartbeat())
            if self.parent is not None and os.getppid() != self.parent and not self.stopping:
                log.warning("the serve process that started this worker is gone; exiting")
                asyncio.ensure_future(self.drain(0.0))
            silent = time.monotonic() - self._last_router > self.router_timeout_s
            if silent and not self.stopping and not self._registered_in_silence:
                # The router may be stalled, restarted or unreachable. Register again and tell it
                # what is running: it keeps what it still knows and aborts the rest. Once per
                # silence: a long cut must not queue a Register every few seconds (the router
                # answers a connection it does not know with Rejoin if this one is lost).
                log.warning("no word from the router for %.1f s; registering again", self.router_timeout_s)
                self._register()
                self._registered_in_silence = True

    async def drain(self, grace_s: float) -> None:
        """Stop taking work, let requests in flight finish for ``grace_s``, fail the rest."""
        if self.stopping:
            return
        self.stopping = True
        self._send(P.Goodbye(worker=self.name))
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.active):
            self._abort(rid)  # ends with finish 'abort' -> shutting_down error
        while self.active and time.monotonic() < deadline + 2.0:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        self._send(P.Leave(worker=self.name))  # after every final: the router forgets us at once
        flush_by = time.monotonic() + 1.0  # the router may be gone: do not wait forever
        while not self._outq.empty() and time.monotonic() < flush_by:
            await asyncio.sleep(0.01)
        self._done.set()

    async def run(self) -> None:
        self.loop = self.events.loop = asyncio.get_running_loop()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        # One identity per process: a reconnect of this process takes its connection over
        # (ROUTER_HANDOVER), another process under the same name cannot (the router refuses it).
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode()[:200] + b"/" + self.session.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        # Real networks: ZMTP heartbeats drop a connection that has been silent for the router
        # timeout (a cut link), and reconnects are retried every 0.1-1 s with a 2 s connect
        # timeout, so a restored link is used again within about a second, not after TCP's
        # retransmission back-off (which grows to minutes).
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.router_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(self.router_timeout_s * 1000))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, 2000)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        from radixserve.serve.auth import make_client

        make_client(self.sock, self.secret)
        self.sock.connect(self.router)
        self._outq: asyncio.Queue[bytes] = asyncio.Queue()
        self._done = asyncio.Event()
        self.engine.on_cache_event(self.events.on_event)
        self.engine.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain(5.0)))
            except (NotImplementedError, RuntimeError):
                pass
        self.grammars.prepare()  # the grammars' tokenizer table, before this worker registers
        self._register()
        tasks = [asyncio.ensure_future(self._sender()), asyncio.ensure_future(self._heartbeats())]
        receiver = asyncio.ensure_future(self._receiver())
        log.info("worker %s (pid %d) connected to %s", self.name, os.getpid(), self.router)
        await self._done.wait()
        for t in tasks + [receiver]:
            t.cancel()
        await self.grammars.aclose()
        self.engine.shutdown()
        self.sock.close(linger=500)
        self.ctx.term()

    async def _receiver(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = P.decode(frame, max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
            except P.DecodeError as exc:
                log.warning("bad frame from the router: %s", exc)
                continue
            try:
                self._handle(msg)
            except Exception:
                log.exception("worker failed handling %s", type(msg).__name__)


def run_worker(
    engine,
    router: str,
    name: str | None = None,
    *,
    parent_pid: int | None = None,
    secret: str,
    heartbeat_s: float = HEARTBEAT_S,
    router_timeout_s: float = ROUTER_TIMEOUT_S,
    grammar_timeout_s: float | None = GRAMMAR_TIMEOUT_S,
) -> int:
    """Serve until told to stop; returns the exit status (3: the router refused this worker).
    ``parent_pid``: the process that started this one (read at process start, before the model
    loads: by the time the engine exists it may already be gone); the worker exits when it is."""
    name = name or f"{socket.gethostname()}-{os.getpid()}"
    worker = Worker(
        engine,
        router,
        name,
        parent_pid=parent_pid,
        secret=secret,
        heartbeat_s=heartbeat_s,
        router_timeout_s=router_timeout_s,
        grammar_timeout_s=grammar_timeout_s,
    )
    try:
        import uvloop

        uvloop.run(worker.run())
    except ImportError:
        asyncio.run(worker.run())
    if worker.refused:
        print(f"radixserve: error: the router refused worker {name}: {worker.refused}", file=sys.stderr, flush=True)
        return 3
    return 0
