"""The router: one asyncio (uvloop) process in front of N worker processes.

Two ROUTER sockets (bound, 127.0.0.1 by default): one for clients, one for workers. The worker
socket is a CURVE server that admits only peers holding the shared worker secret
(:mod:`radixserve.serve.auth`); a peer there is a worker once it sent a
:class:`~radixserve.protocol.Register` whose model fingerprint matches ours. Worker messages on
the client socket are refused, so no client can pose as a worker. Each message is handled to the
end synchronously on the loop (no awaits in handlers), so the router's state never races; long
prompts are tokenized in a bounded thread pool, off the loop.

Admission: a request goes to a worker only while that worker has fewer than
``max_inflight_per_worker`` requests in flight; otherwise it waits in one router queue of at most
``max_queue`` requests; when that is full too, it is answered ``overloaded`` at once.

Failure handling: a worker that sends nothing for ``heartbeat_timeout_s`` (it heartbeats every
0.5 s), or whose local process exited, is declared dead. Each of its requests that has not yet
streamed a token to the client (all non-streaming ones) is restarted from scratch on a live
worker, under a new work id, so late messages of the dead attempt are ignored; a request that
already streamed tokens fails with ``worker_lost`` (no duplicated tokens, no duplicated final).
With no live worker left they all fail with ``worker_lost``. Every request ends with exactly
one Final or Error. A worker that stops (SIGTERM) drains, then sends ``Leave``: it is forgotten at
once, without waiting for the heartbeat timeout.

The per-worker cache index stays exact across hosts: every registration is followed by the
worker's snapshot of its tree (a ``reset`` CacheEvents), which replaces the mirror; until it
arrives the mirror is empty and other events are ignored. CacheEvents are numbered; a gap (lost
messages, e.g. a dropped connection) empties the mirror and asks the worker to ``Rejoin``, which
sends a new snapshot. A message from a connection the router does not know (a worker declared
dead after a link cut, or a router restart) is answered with ``Rejoin`` too, so the worker comes
back as soon as the link does.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.metrics import DEPTH_BUCKETS, Histogram, MetricsLog
from radixserve.serve.routing import CacheIndex, Candidate, make_policy

log = logging.getLogger("radixserve.router")


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 7700
    address: str | None = None  # full ZMQ address to bind (overrides host/port), e.g. ipc:///tmp/rs
    worker_port: int | None = None  # the worker socket's port (default: port + 1; random when port is 0)
    worker_address: str | None = None  # full ZMQ address of the worker socket (overrides worker_port)
    secret: str | None = None  # the shared worker secret (64 hex); None: a fresh one (Router.secret)
    model_fingerprint: str | None = None  # refuse workers of another model (None: accept any)
    forget_dead_s: float = 60.0  # a dead worker that is not ours to restart is dropped after this
    policy: str = "cache_aware"
    max_queue: int = 256
    max_inflight_per_worker: int = 64
    # Pings to workers every heartbeat_s; a worker silent for heartbeat_timeout_s is dead. 3 s is
    # 6 missed heartbeats: on a LAN, a false alarm needs one segment lost 4 times in a row (TCP
    # retransmits after 0.2, 0.4, 0.8, 1.6 s); raise it for a lossy or long-haul link (README).
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    max_attempts: int = 3
    no_worker_wait_s: float = 30.0  # a request queued with no live worker fails after this long
    drain_s: float = 5.0  # on shutdown, how long requests in flight may take to finish
    limits: P.Limits = field(default_factory=P.Limits)
    metrics_log: str | None = None
    metrics_interval_s: float = 10.0
    balance_abs: int = 16
    balance_rel: float = 1.5
    cache_threshold: float = 0.3
    # Tokenizing a long prompt takes seconds: it runs in a bounded thread pool, never on the loop
    # (a stalled loop sends no pings, and workers would take the router for dead).
    tokenize_threads: int = 2
    max_tokenizing: int = 32  # prompts being tokenized at once; beyond: overloaded
    inline_tokenize_chars: int = 8192  # shorter prompts are tokenized on the loop (microseconds)
    # The longest prompt (characters) worth tokenizing: the context in tokens times the longest
    # token in characters. None: derived from max_model_len and the tokenizer's vocabulary.
    max_prompt_chars: int | None = None
    max_model_len: int | None = None  # the model's context (tokens); None: from registered workers


@dataclass(eq=False)
class Job:
    n: int
    client: bytes
    cid: str
    token_ids: list[int]
    params: Any
    namespace: str | None
    stream: bool
    arrival: float
    attempt: int = 0
    work_id: str = ""
    worker: "WorkerState | None" = None
    streamed: int = 0
    first_chunk_at: float | None = None
    dispatched_at: float = 0.0
    queued_at: float = 0.0
    choose: Any = None  # a choose call: the ChooseWork fields other than id/token_ids/namespace


@dataclass(eq=False)
class WorkerState:
    name: str
    identity: bytes
    pid: int = 0
    session: str = ""
    synced: bool = False  # the index holds the worker's snapshot and every event after it
    next_seq: int = 0  # the CacheEvents seq expected next
    seen_seq: int = 0  # the highest CacheEvents seq received
    resync_from: int = 0  # unsynced: a snapshot with a higher seq is the one we wait for
    rejoin_asked: float = 0.0
    host: str = ""
    proc: Any = None  # subprocess.Popen for workers this process started
    alive: bool = True
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    inflight: dict[str, Job] = field(default_factory=dict)
    index: CacheIndex = field(default_factory=CacheIndex)
    engine: dict[str, Any] = field(default_factory=dict)
    routed: int = 0
    completed: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    info: dict[str, Any] = field(default_factory=dict)


COUNTERS = (
    "requests", "choose_requests", "completed", "aborted", "overloaded", "retries", "worker_deaths", "bad_frames",
    "refused_workers", "workers_left", "index_resyncs", "rejoins_asked",
    "prompt_tokens", "cached_tokens", "completion_tokens", "streamed_tokens",
    "routed_cache_hit", "routed_load_balance", "routed_least_load", "routed_round_robin",
) + tuple(f"errors_{c}" for c in P.ERROR_CODES)


class Router:
    def __init__(self, config: RouterConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self.policy = make_policy(config.policy, **(
            dict(balance_abs=config.balance_abs, balance_rel=config.balance_rel,
                 cache_threshold=config.cache_threshold) if config.policy == "cache_aware" else {}))
        self.workers: dict[str, WorkerState] = {}
        self.by_identity: dict[bytes, WorkerState] = {}
        self.jobs: dict[tuple[bytes, str], Job] = {}
        self.works: dict[str, Job] = {}
        self.queue: collections.deque[Job] = collections.deque()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.hist = {"ttft_s": Histogram(), "e2e_s": Histogram(), "router_queue_s": Histogram(),
                     "queue_depth_at_arrival": Histogram(DEPTH_BUCKETS)}
        self.shutting_down = False
        self.started = time.monotonic()
        self._n = itertools.count(1)
        self.address = ""
        self.worker_address = ""
        from radixserve.serve import auth

        self.secret = auth.check_secret(config.secret) if config.secret else auth.new_secret()
        self.local_procs: list[Any] = []
        self._stopped: asyncio.Event | None = None
        self._bound = None
        self.supervisor = None  # serve's Supervisor of local worker processes (restarts them)
        self.fatal: str | None = None  # why serve must exit non-zero (e.g. every worker failed at start-up)
        self.forced = False  # a second interrupt: stopped without draining
        self.on_ready = None  # called once with the number of live workers when every local one joined
        self._announced = False
        self._tok_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._tokenizing: dict[tuple, bool] = {}  # key -> aborted while tokenizing
        self._last_tick = time.monotonic()
        self._token_chars = _longest_token_chars(tokenizer)
        self._rejoin_asked: dict[bytes, float] = {}

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_chars = _longest_token_chars(tokenizer)

    @property
    def local_procs(self) -> list[Any]:
        return self.supervisor.procs if self.supervisor is not None else self._local_procs

    @local_procs.setter
    def local_procs(self, procs: list[Any]) -> None:
        self._local_procs = procs

    def prompt_char_limit(self) -> int:
        """Prompts longer than this (characters) cannot fit the context: refused untokenized."""
        cfg = self.config
        limit = cfg.limits.max_prompt_chars
        if cfg.max_prompt_chars is not None:
            return min(limit, cfg.max_prompt_chars)
        context = cfg.max_model_len or max((w.info.get("max_model_len", 0) for w in self.workers.values()), default=0)
        if context:
            limit = min(limit, context * self._token_chars)
        return limit

    # ------------------------------------------------------------------ socket
    def bind(self) -> str:
        """Bind the client and worker sockets; returns the client address (with the real port
        when port is 0); the worker socket's is :attr:`worker_address`. A busy address raises
        :class:`~radixserve.errors.RadixServeError` naming it."""
        from radixserve.serve import auth

        self.ctx = zmq.asyncio.Context()
        cfg = self.config
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a client's stream on a slow reader
        # Hard cap (libzmq drops the peer): well above the soft limit, so a frame a bit too big
        # still gets an error reply naming the limit.
        sock.setsockopt(zmq.MAXMSGSIZE, max(4 * cfg.limits.max_frame_bytes, 16 * 2**20))
        self.address = _bind(sock, cfg.address, cfg.host, cfg.port, "client")
        self.sock = sock
        wsock = self.ctx.socket(zmq.ROUTER)
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
        self._auth = auth.start_authenticator(self.ctx, self.secret, self.counters)
        worker_address = cfg.worker_address
        if worker_address is None and cfg.address and cfg.address.startswith("ipc://"):
            worker_address = cfg.address + "-workers"
        port = cfg.worker_port if cfg.worker_port is not None else (cfg.port + 1 if cfg.port and not cfg.address else 0)
        host = cfg.host
        if cfg.address and cfg.address.startswith("tcp://"):
            host = cfg.address[len("tcp://"):].rsplit(":", 1)[0]
        self.worker_address = _bind(wsock, worker_address, host, port, "worker")
        self.wsock = wsock
        return self.address

    def _send(self, identity: bytes, msg) -> None:
        try:
            self.sock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unreachable peer: ROUTER drops; never let it kill the loop
            log.debug("send to %r failed: %s", identity, exc)

    def _wsend(self, identity: bytes, msg) -> None:
        """Send to a worker (on the worker socket)."""
        try:
            self.wsock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("send to worker %r failed: %s", identity, exc)

    def _reply_error(self, identity: bytes, rid: str, code: str, message: str) -> None:
        self.counters[f"errors_{code}"] = self.counters.get(f"errors_{code}", 0) + 1
        self._send(identity, P.Error(id=rid, code=code, message=message))

    # ------------------------------------------------------------------ main loop
    async def serve(self) -> None:
        if not getattr(self, "sock", None):
            self.bind()
        self._stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_shutdown)
            except (NotImplementedError, RuntimeError):
                pass
        tasks = [asyncio.ensure_future(self._receiver()), asyncio.ensure_future(self._worker_receiver()),
                 asyncio.ensure_future(self._ticker())]
        if self.config.metrics_log:
            tasks.append(asyncio.ensure_future(self._metrics_logger()))
        await self._stopped.wait()
        for t in tasks:
            t.cancel()
        if self._tok_pool is not None:
            self._tok_pool.shutdown(wait=False, cancel_futures=True)
        self._auth.stop()
        self.sock.close(linger=500)
        self.wsock.close(linger=500)
        self.ctx.term()

    async def _worker_receiver(self) -> None:
        while True:
            parts = await self.wsock.recv_multipart(copy=True)
            try:
                self._on_worker_frames(parts)
            except Exception:
                log.exception("router failed handling a worker message")

    def _on_worker_frames(self, parts: list[bytes]) -> None:
        """A message on the worker socket: the peer holds the secret (CURVE let it in)."""
        identity = parts[0]
        worker = self.by_identity.get(identity)
        if len(parts) != 2:
            self.counters["bad_frames"] += 1
            return
        try:
            msg = P.decode(parts[1], max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
        except P.DecodeError as exc:
            self.counters["bad_frames"] += 1
            log.warning("bad frame from worker %r: %s", identity, exc)
            return
        handler = _WORKER_HANDLERS.get(type(msg))
        if handler is None:
            log.warning("worker %r sent a %s, which is not a worker message", identity, type(msg).__name__)
            return
        if worker is None and not isinstance(msg, P.Register):
            # Not (or no longer) registered, e.g. declared dead during a link cut: ask it to
            # register again (at most once per heartbeat timeout per connection).
            if not isinstance(msg, (P.Leave, P.Goodbye)) and not self.shutting_down:
                now = time.monotonic()
                if now - self._rejoin_asked.get(identity, 0.0) > self.config.heartbeat_timeout_s:
                    if len(self._rejoin_asked) > 4096:
                        self._rejoin_asked.clear()
                    self._rejoin_asked[identity] = now
                    self.counters["rejoins_asked"] += 1
                    self._wsend(identity, P.Rejoin(reason="this connection is not registered"))
            return
        if worker is not None:
            worker.last_seen = time.monotonic()
        handler(self, identity, worker, msg)

    async def _receiver(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=True)
            try:
                self._on_frames(parts)
            except Exception:  # a bug handling one message must not take the router down
                log.exception("router failed handling a message")

    def _on_frames(self, parts: list[bytes]) -> None:
        """A message on the client socket: only client requests are accepted here."""
        identity = parts[0]
        if len(parts) != 2:
            self.counters["bad_frames"] += 1
            self._reply_error(identity, "", P.BAD_REQUEST, f"frame: expected one frame per message, got {len(parts) - 1}")
            return
        try:
            msg = P.decode(parts[1], max_frame_bytes=self.config.limits.max_frame_bytes)
        except P.DecodeError as exc:
            self.counters["bad_frames"] += 1
            self._reply_error(identity, exc.request_id, P.BAD_REQUEST, str(exc))
            return
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            hint = " (workers connect to the worker socket, with the secret)" if type(msg) in _WORKER_HANDLERS else ""
            self._reply_error(identity, getattr(msg, "id", ""), P.BAD_REQUEST,
                              f"type: {type(msg).__name__} is not a request a router accepts{hint}")
            return
        handler(self, identity, None, msg)

    # ------------------------------------------------------------------ client requests
    def _accepting(self, identity: bytes, msg) -> tuple | None:
        """The job key for a new client call, or None after replying why it can't be taken."""
        if self.shutting_down:
            self._reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            return None
        key = (identity, msg.id)
        if key in self.jobs or key in self._tokenizing:
            self._reply_error(identity, msg.id, P.BAD_REQUEST, f"id: {msg.id!r} is already in flight on this connection")
            return None
        return key

    def _on_generate(self, identity: bytes, worker, msg: P.Generate) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            P.validate_generate(msg, self.config.limits)
            if msg.token_ids is None:
                if self.tokenizer is None:
                    raise P.DecodeError("this router has no tokenizer; send token_ids", msg.id)
                self._check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        if msg.token_ids is not None:
            self._admit_generate(key, identity, msg, msg.token_ids)
        else:
            self._tokenize(key, identity, msg, lambda: (self.tokenizer.encode(msg.prompt),),
                           lambda ids: self._admit_generate(key, identity, msg, ids))

    def _check_prompt_chars(self, n: int) -> None:
        limit = self.prompt_char_limit()
        if n > limit:
            from radixserve.errors import TooLongError

            raise TooLongError("prompt", f"has {n} characters; no prompt longer than {limit} characters can fit "
                                         f"the model's context")

    def _tokenize(self, key, identity: bytes, msg, compute, then) -> None:
        """Run ``compute()`` (tokenizer calls) off the loop when the prompt is long, then
        ``then(*result)`` on the loop; answers overloaded when too many prompts are in the pool."""
        if len(msg.prompt) <= self.config.inline_tokenize_chars:
            then(*compute())
            return
        if len(self._tokenizing) >= self.config.max_tokenizing:
            self.counters["overloaded"] += 1
            self._reply_error(identity, msg.id, P.OVERLOADED,
                              f"{len(self._tokenizing)} long prompts are being tokenized; retry later")
            return
        if self._tok_pool is None:
            self._tok_pool = concurrent.futures.ThreadPoolExecutor(self.config.tokenize_threads,
                                                                   thread_name_prefix="tokenize")
        self._tokenizing[key] = False
        future = asyncio.get_running_loop().run_in_executor(self._tok_pool, compute)

        def done(fut) -> None:
            aborted = self._tokenizing.pop(key, False)
            try:
                if fut.cancelled():
                    raise RuntimeError("tokenizing was cancelled")
                result = fut.result()
            except Exception as exc:
                self._reply_error(identity, msg.id, P.INTERNAL, f"tokenizing failed: {type(exc).__name__}: {exc}")
                return
            if aborted:
                self._reply_error(identity, msg.id, P.BAD_REQUEST, "aborted by the client")
            elif self.shutting_down:
                self._reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            else:
                try:
                    then(*result)
                except Exception:  # a bug must not leave the call without a reply
                    log.exception("router failed admitting a tokenized request")
                    self._reply_error(identity, msg.id, P.INTERNAL, "router error admitting the request")

        future.add_done_callback(done)

    def _admit_generate(self, key, identity: bytes, msg: P.Generate, ids) -> None:
        try:
            if len(ids) > self.config.limits.max_prompt_tokens:
                raise P._too_long(len(ids), self.config.limits)
            if not ids:
                raise P.DecodeError("prompt tokenizes to nothing", msg.id)
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.counters["requests"] += 1
        now = time.monotonic()
        job = Job(n=next(self._n), client=identity, cid=msg.id, token_ids=list(ids), params=msg.params,
                  namespace=msg.namespace, stream=msg.stream, arrival=now)
        self._admit(key, job)

    def _on_choose(self, identity: bytes, worker, msg: P.Choose) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            P.validate_choose(msg, self.config.limits)
            if self.tokenizer is None:
                raise P.DecodeError("this router has no tokenizer; choose needs one", msg.id)
            if msg.prompt is not None:
                self._check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        tok = self.tokenizer

        def compute():
            ids = msg.token_ids if msg.token_ids is not None else tok.encode(msg.prompt)
            return ids, [tok.encode(c, add_special_tokens=False) for c in msg.choices]

        if msg.prompt is None:
            self._admit_choose(key, identity, msg, *compute())
        else:
            self._tokenize(key, identity, msg, compute, lambda ids, cids: self._admit_choose(key, identity, msg, ids, cids))

    def _admit_choose(self, key, identity: bytes, msg: P.Choose, ids, choice_ids) -> None:
        try:
            if len(ids) > self.config.limits.max_prompt_tokens:
                raise P._too_long(len(ids), self.config.limits)
            if not ids or not all(choice_ids):
                raise P.DecodeError("prompt or a choice tokenizes to nothing", msg.id)
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.counters["requests"] += 1
        self.counters["choose_requests"] += 1
        now = time.monotonic()
        job = Job(n=next(self._n), client=identity, cid=msg.id, token_ids=list(ids), params=None,
                  namespace=msg.namespace, stream=False, arrival=now,
                  choose=dict(choices=msg.choices, choice_ids=choice_ids, normalize=msg.normalize,
                              temperature=msg.temperature, seed=msg.seed))
        self._admit(key, job)

    def _admit(self, key, job: Job) -> None:
        identity = job.client
        self.hist["queue_depth_at_arrival"].observe(len(self.queue))
        candidates = self._candidates()
        if candidates:
            self.jobs[key] = job
            self._dispatch(job, candidates)
        elif len(self.queue) < self.config.max_queue:
            self.jobs[key] = job
            job.queued_at = job.arrival
            self.queue.append(job)
        else:
            self.counters["overloaded"] += 1
            self._reply_error(identity, job.cid, P.OVERLOADED,
                              f"all {len(self._alive())} workers are at their in-flight cap and the router queue "
                              f"is full ({self.config.max_queue}); retry later or add workers")

    def _on_abort(self, identity: bytes, worker, msg: P.Abort) -> None:
        if (identity, msg.id) in self._tokenizing:
            self._tokenizing[(identity, msg.id)] = True  # answered when tokenizing ends
            return
        job = self.jobs.get((identity, msg.id))
        if job is None:
            return
        if job.worker is None:  # still queued here
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            self._finish(job, None)
            if job.choose is not None:
                self._reply_error(job.client, job.cid, P.BAD_REQUEST, "aborted by the client")
                return
            self._send(job.client, P.Final(id=job.cid, token_ids=[], text="", finish_reason="abort",
                                           usage=P.Usage(prompt_tokens=len(job.token_ids), cached_tokens=0, completion_tokens=0),
                                           timings=P.Timings(queue_s=time.monotonic() - job.arrival, ttft_s=0.0,
                                                             e2e_s=time.monotonic() - job.arrival)))
            self.counters["aborted"] += 1
        else:
            self._wsend(job.worker.identity, P.Abort(id=job.work_id))

    def _on_health(self, identity: bytes, worker, msg: P.Health) -> None:
        alive = len(self._alive())
        status = "shutting_down" if self.shutting_down else ("ok" if alive else "degraded")
        self._send(identity, P.HealthReply(id=msg.id, status=status, workers=len(self.workers), workers_alive=alive))

    def _on_stats(self, identity: bytes, worker, msg: P.Stats) -> None:
        probe = None
        if msg.probe is not None:
            # a text probe is tokenized on the loop: only its first 65536 characters (milliseconds)
            text = msg.probe[: min(self.prompt_char_limit(), 65536)] if isinstance(msg.probe, str) else ""
            ids = msg.probe if isinstance(msg.probe, list) else (self.tokenizer.encode(text) if self.tokenizer else [])
            ids = ids[: self.config.limits.max_probe_tokens]
            probe = {w.name: w.index.tree.peek(ids, msg.namespace) for w in self.workers.values()}
        self._send(identity, P.StatsReply(id=msg.id, stats=self.stats(probe)))

    # ------------------------------------------------------------------ worker messages
    def _on_register(self, identity: bytes, worker, msg: P.Register) -> None:
        want = self.config.model_fingerprint
        if want and msg.fingerprint != want:
            self.counters["refused_workers"] = self.counters.get("refused_workers", 0) + 1
            why = (f"its model fingerprint {msg.fingerprint or '(none)'} differs from the router's {want} "
                   f"(config.json hash:vocabulary size); start it with the router's --model")
            log.error("refused worker %s (pid %d on %s): %s", msg.worker, msg.pid, msg.host, why)
            self._wsend(identity, P.Refused(reason=why))
            return
        if worker is not None and worker.name != msg.worker:
            self._wsend(identity, P.Refused(reason=f"this connection is worker {worker.name}; it cannot rename itself"))
            return
        old = self.workers.get(msg.worker)
        same = old is not None and (old.session == msg.session if msg.session else old.pid == msg.pid)
        if old is not None and old.alive and same and old.identity == identity:
            # The same live process registering again: it heard nothing from us for a while (we
            # were stalled, or the network was). Not a restart: keep its state and its requests.
            # Its snapshot follows: the index starts again from it (events may have been lost).
            old.last_seen = time.monotonic()
            self._reset_index(old)
            self._abort_unknown(old, msg.active)
            self._reclaim_lost(old, msg.active)
            log.info("worker %s registered again (pid %d, same process); keeping its %d requests",
                     old.name, old.pid, len(old.inflight))
            self._wsend(identity, P.Ping())
            return
        if old is not None and old.alive:
            self._declare_dead(old, "it registered again (restarted)")
        self._rejoin_asked.pop(identity, None)
        state = WorkerState(name=msg.worker, identity=identity, pid=msg.pid, host=msg.host, session=msg.session,
                            info=dict(max_model_len=msg.max_model_len, kv_total_tokens=msg.kv_total_tokens,
                                      page_size=msg.page_size))
        if old is not None:
            state.proc = old.proc
        for proc in self.local_procs:
            if getattr(proc, "worker_name", None) == msg.worker:
                state.proc = proc
        if self.supervisor is not None:
            self.supervisor.on_registered(msg.worker, msg.pid)
        self.workers[msg.worker] = state
        self.by_identity[identity] = state
        self._abort_unknown(state, msg.active)
        if not self._announced and self.supervisor is not None and self.on_ready is not None:
            local = self.supervisor.workers
            if all(n in self.workers and self.workers[n].alive for n in local):
                self._announced = True
                self.on_ready(len(self._alive()))
        log.info("worker %s joined (pid %d on %s, KV %d tokens)", msg.worker, msg.pid, msg.host, msg.kv_total_tokens)
        self._wsend(identity, P.Ping())
        self._pump()

    def _resync(self, worker: WorkerState, why: str, known: int = 0) -> None:
        """Events were lost (the connection dropped some): the mirror may hold stale prefixes or
        miss some. Empty it and ask the worker for a fresh snapshot (only that)."""
        log.warning("worker %s: %s; resyncing its cache index", worker.name, why)
        self.counters["index_resyncs"] += 1
        self._reset_index(worker)
        worker.resync_from = max(worker.resync_from, known)
        self._wsend(worker.identity, P.Rejoin(reason="cache events were lost", register=False))

    def _reset_index(self, worker: WorkerState) -> None:
        """Empty the worker's mirror (pending prefixes stay) until its next snapshot arrives."""
        pending = worker.index.pending
        worker.index.clear()
        worker.index.pending.update(pending)
        worker.synced = False
        worker.resync_from = worker.seen_seq

    def _reclaim_lost(self, worker: WorkerState, active: list[str]) -> None:
        """Requests we think run on ``worker`` but it does not: their Work or their Final was
        lost with a dropped connection (messages it sent before this Register arrived before
        it). Restart them elsewhere under a new work id (or fail those that streamed), and
        abort the old attempt in case its Work is still on its way (its answer would be
        ignored anyway: the work id is no longer ours)."""
        running = set(active)
        lost = sorted((j for wid, j in worker.inflight.items() if wid not in running), key=lambda j: j.n, reverse=True)
        for job in lost:
            self._wsend(worker.identity, P.Abort(id=job.work_id))
            self._finish(job, worker, keep_job=True)
            if self._retryable(job) and not self.shutting_down:
                self._requeue(job)
            else:
                self.jobs.pop((job.client, job.cid), None)
                self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                  f"worker {worker.name} lost the request with its connection; retry the request")
        if lost:
            log.warning("worker %s re-registered without %d of its requests; restarted them", worker.name, len(lost))
            self._pump()

    def _abort_unknown(self, worker: WorkerState, active: list[str]) -> None:
        """Abort the worker's requests that we gave up (e.g. restarted elsewhere)."""
        for wid in active[:4096]:
            if wid not in worker.inflight:
                self._wsend(worker.identity, P.Abort(id=wid))

    def _on_heartbeat(self, identity: bytes, worker, msg: P.Heartbeat) -> None:
        if worker is None:  # e.g. declared dead, or the router restarted: ask it to register
            return
        worker.engine = msg.stats
        # Heartbeats follow the worker's cache events on the same ordered stream: they tell us
        # whether the last batch, or the snapshot we wait for, was lost on the way.
        if worker.synced and msg.events_seq and msg.events_seq != worker.next_seq - 1:
            self._resync(worker, f"cache events up to {msg.events_seq} sent, {worker.next_seq - 1} received")
        elif not worker.synced and msg.reset_seq > worker.resync_from:
            self._resync(worker, f"the cache snapshot {msg.reset_seq} was lost", known=msg.reset_seq)

    def _on_cache_events(self, identity: bytes, worker, msg: P.CacheEvents) -> None:
        if worker is None or not worker.alive:
            return
        worker.seen_seq = max(worker.seen_seq, msg.seq)
        if msg.reset:  # a snapshot: the whole tree, then the events after it
            self._reset_index(worker)
            worker.synced = True
        elif not worker.synced:
            return  # before the snapshot: the snapshot includes it
        elif msg.seq != worker.next_seq:
            # Events were lost (the connection dropped some): the mirror may hold stale
            # prefixes or miss some. Start again from a fresh snapshot.
            self._resync(worker, f"cache events {worker.next_seq}..{msg.seq - 1} lost")
            return
        worker.next_seq = msg.seq + 1
        index = worker.index
        for ev in msg.events:
            if ev.kind == "insert":
                index.insert(ev.namespace, ev.tokens)
            elif ev.kind == "evict":
                index.evict(ev.namespace, ev.tokens, ev.length)

    def _on_goodbye(self, identity: bytes, worker, msg: P.Goodbye) -> None:
        if worker is not None:
            worker.draining = True
            log.info("worker %s is draining", worker.name)

    def _on_leave(self, identity: bytes, worker, msg: P.Leave) -> None:
        if worker is None:
            return
        self.counters["workers_left"] += 1
        self._declare_dead(worker, "it left", left=True)

    def _job_of(self, worker, work_id: str) -> Job | None:
        job = self.works.get(work_id)
        if job is None or worker is None or job.worker is not worker:
            return None  # a late message from an attempt that was given up
        return job

    def _on_chunk(self, identity: bytes, worker, msg: P.Chunk) -> None:
        job = self._job_of(worker, msg.id)
        if job is None or not job.stream:
            return
        if job.first_chunk_at is None:
            job.first_chunk_at = time.monotonic()
        job.streamed += len(msg.token_ids)
        self.counters["streamed_tokens"] += len(msg.token_ids)
        self._send(job.client, P.Chunk(id=job.cid, token_ids=msg.token_ids, text=msg.text, logprobs=msg.logprobs))

    def _on_final(self, identity: bytes, worker, msg: P.Final) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        ttft = (job.first_chunk_at - job.arrival) if job.first_chunk_at else waited + msg.timings.ttft_s
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=ttft, e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        c = self.counters
        c["completed"] += 1
        c["aborted"] += msg.finish_reason == "abort"
        c["prompt_tokens"] += msg.usage.prompt_tokens
        c["cached_tokens"] += msg.usage.cached_tokens
        c["completion_tokens"] += msg.usage.completion_tokens
        self.hist["ttft_s"].observe(ttft)
        self.hist["e2e_s"].observe(timings.e2e_s)
        worker.ttft.observe(ttft)
        self._send(job.client, P.Final(id=job.cid, token_ids=msg.token_ids, text=msg.text,
                                       finish_reason=msg.finish_reason, usage=msg.usage, timings=timings,
                                       worker=worker.name, logprobs=msg.logprobs))
        self._pump()

    def _on_choice_final(self, identity: bytes, worker, msg: P.ChoiceFinal) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=waited + msg.timings.ttft_s,
                            e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        c = self.counters
        c["completed"] += 1
        c["prompt_tokens"] += msg.usage.query_tokens
        c["cached_tokens"] += msg.usage.cached_tokens
        self.hist["ttft_s"].observe(timings.ttft_s)
        self.hist["e2e_s"].observe(timings.e2e_s)
        worker.ttft.observe(timings.ttft_s)
        self._send(job.client, P.ChoiceFinal(id=job.cid, best=msg.best, index=msg.index, ranked=msg.ranked,
                                             usage=msg.usage, timings=timings, worker=worker.name))
        self._pump()

    def _on_worker_error(self, identity: bytes, worker, msg: P.Error) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        self._finish(job, worker, keep_job=True)
        if msg.code == P.SHUTTING_DOWN and not self.shutting_down and self._retryable(job):
            self._requeue(job)
        else:
            self.jobs.pop((job.client, job.cid), None)
            self._reply_error(job.client, job.cid, msg.code, msg.message)
        self._pump()

    # ------------------------------------------------------------------ routing
    def _alive(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.alive and not w.draining]

    def _candidates(self) -> list[WorkerState]:
        cap = self.config.max_inflight_per_worker
        return [w for w in self._alive() if len(w.inflight) < cap]

    def _dispatch(self, job: Job, candidates: list[WorkerState]) -> None:
        cands = [Candidate(w.name, len(w.inflight), w.index) for w in candidates]
        decision = self.policy.choose(cands, job.token_ids, job.namespace)
        w = self.workers[decision.worker]
        self.counters[f"routed_{decision.reason}"] = self.counters.get(f"routed_{decision.reason}", 0) + 1
        job.attempt += 1
        job.work_id = f"{job.n}.{job.attempt}"
        job.worker = w
        job.dispatched_at = time.monotonic()
        if job.queued_at:
            self.hist["router_queue_s"].observe(job.dispatched_at - job.queued_at)
        w.inflight[job.work_id] = job
        w.routed += 1
        self.works[job.work_id] = job
        if self.policy.name == "cache_aware":
            w.index.add_pending(job.work_id, job.namespace, job.token_ids)
        if job.choose is not None:
            self._wsend(w.identity, P.ChooseWork(id=job.work_id, token_ids=job.token_ids, namespace=job.namespace,
                                                **job.choose))
        else:
            self._wsend(w.identity, P.Work(id=job.work_id, token_ids=job.token_ids, params=job.params,
                                          namespace=job.namespace, stream=job.stream))

    def _pump(self) -> None:
        """Dispatch queued requests while some worker has room."""
        while self.queue:
            candidates = self._candidates()
            if not candidates:
                return
            self._dispatch(self.queue.popleft(), candidates)

    def _finish(self, job: Job, worker: WorkerState | None, *, keep_job: bool = False) -> None:
        self.works.pop(job.work_id, None)
        if worker is not None:
            worker.inflight.pop(job.work_id, None)
            worker.index.drop_pending(job.work_id)
        job.worker = None
        if not keep_job:
            self.jobs.pop((job.client, job.cid), None)

    def _retryable(self, job: Job) -> bool:
        return job.streamed == 0 and job.attempt < self.config.max_attempts

    def _requeue(self, job: Job) -> None:
        self.counters["retries"] += 1
        job.queued_at = time.monotonic()
        self.queue.appendleft(job)

    def _declare_dead(self, worker: WorkerState, why: str, *, left: bool = False) -> None:
        if not worker.alive:
            return
        if left:
            log.info("worker %s left (%d requests still in flight there are restarted)", worker.name, len(worker.inflight))
        else:
            log.warning("worker %s is dead: %s; restarting its %d requests", worker.name, why, len(worker.inflight))
            self.counters["worker_deaths"] += 1
        worker.alive = False
        self.by_identity.pop(worker.identity, None)
        jobs = sorted(worker.inflight.values(), key=lambda j: j.n, reverse=True)
        for job in jobs:
            self._finish(job, worker, keep_job=True)
            if self._retryable(job) and not self.shutting_down:
                self._requeue(job)
            else:
                self.jobs.pop((job.client, job.cid), None)
                what = f"after streaming {job.streamed} tokens" if job.streamed else f"after {job.attempt} attempts"
                self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                  f"worker {worker.name} died ({why}) {what}; retry the request")
        worker.index.clear()
        worker.synced = False
        if worker.proc is not None and worker.proc.poll() is None and not left:
            worker.proc.kill()  # hung: make sure it is gone
        if not any(w.alive for w in self.workers.values()):
            self._fail_queue(P.WORKER_LOST, "no worker is left; retry later")
        self._pump()

    def _fail_queue(self, code: str, message: str) -> None:
        while self.queue:
            job = self.queue.popleft()
            self.jobs.pop((job.client, job.cid), None)
            self._reply_error(job.client, job.cid, code, message)

    # ------------------------------------------------------------------ timers
    async def _ticker(self) -> None:
        cfg = self.config
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(cfg.heartbeat_s)
            now = time.monotonic()
            late = now - self._last_tick - cfg.heartbeat_s
            self._last_tick = now
            if late > cfg.heartbeat_s:
                # Our own loop was stalled: the silence is ours, not the workers'. Give every
                # worker a fresh window; what they sent meanwhile is still queued for us.
                log.warning("router loop stalled for %.1f s; not counting it against workers", late)
                for w in self.workers.values():
                    w.last_seen = max(w.last_seen, now)
            if self.supervisor is not None:
                self.supervisor.tick(now, shutting_down=self.shutting_down)
                if self.supervisor.fatal and not any(w.alive for w in self.workers.values()):
                    self.fatal = self.supervisor.fatal
                    log.error("%s", self.fatal)
                    self.request_shutdown()
            for w in list(self.workers.values()):
                if not w.alive:
                    continue
                if w.proc is not None and w.proc.poll() is not None:
                    self._declare_dead(w, f"its process exited with status {w.proc.returncode}")
                elif now - w.last_seen > cfg.heartbeat_timeout_s:
                    self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f} s")
                else:
                    self._wsend(w.identity, P.Ping())
            for w in [w for w in self.workers.values() if not w.alive and w.proc is None]:
                if now - w.last_seen > cfg.forget_dead_s:  # remote and gone: forget it
                    del self.workers[w.name]
            if self.queue and not any(w.alive for w in self.workers.values()):
                while self.queue and now - self.queue[0].queued_at > cfg.no_worker_wait_s:
                    job = self.queue.popleft()
                    self.jobs.pop((job.client, job.cid), None)
                    self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                      f"no worker joined within {cfg.no_worker_wait_s:.0f} s")

    async def _metrics_logger(self) -> None:
        out = MetricsLog(self.config.metrics_log)
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                out.write(self.stats())
            except OSError as exc:
                log.warning("metrics log: %s", exc)

    # ------------------------------------------------------------------ shutdown
    def request_shutdown(self) -> None:
        """First call (Ctrl-C, SIGTERM): drain. A second one: stop now, without draining."""
        if not self.shutting_down:
            asyncio.ensure_future(self.shutdown())
        elif not self.forced:
            self.forced = True
            log.warning("second interrupt: stopping now without draining")
            for job in list(self.works.values()) + list(self.jobs.values()):
                self._reply_error(job.client, job.cid, P.SHUTTING_DOWN, "the router was stopped")
            self.works.clear()
            self.jobs.clear()
            for proc in self.local_procs:
                if proc.poll() is None:
                    proc.kill()
            if self._stopped is not None:
                self._stopped.set()

    async def shutdown(self) -> None:
        """Refuse new work, fail the queue, let requests in flight finish for ``drain_s``, fail
        what is left with ``shutting_down``, stop the workers."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: %d queued, %d in flight", len(self.queue), len(self.works))
        self._fail_queue(P.SHUTTING_DOWN, "the router is shutting down")
        for w in self.workers.values():
            if w.alive:
                self._wsend(w.identity, P.Shutdown(grace_s=self.config.drain_s))
        deadline = time.monotonic() + self.config.drain_s + 2.0
        while self.works and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.works.values()):
            self._finish(job, job.worker)
            self._reply_error(job.client, job.cid, P.SHUTTING_DOWN, "the router shut down before the request finished")
        for job in list(self.jobs.values()):
            self.jobs.pop((job.client, job.cid), None)
            self._reply_error(job.client, job.cid, P.SHUTTING_DOWN, "the router shut down")
        await asyncio.sleep(0.2)  # let the replies leave
        for proc in self.local_procs:
            try:
                proc.wait(timeout=5.0)
            except Exception:
                proc.kill()
        if self._stopped is not None:
            self._stopped.set()

    # ------------------------------------------------------------------ visibility
    def stats(self, probe: dict[str, int] | None = None) -> dict[str, Any]:
        now = time.monotonic()
        workers = {}
        for w in self.workers.values():
            engine = {k: v for k, v in w.engine.items() if not isinstance(v, dict)}
            hists = {k: v for k, v in w.engine.items() if isinstance(v, dict)}
            hists["router_ttft_s"] = w.ttft.to_dict()
            workers[w.name] = {
                "alive": w.alive, "draining": w.draining, "pid": w.pid, "host": w.host,
                "inflight": len(w.inflight), "routed": w.routed, "completed": w.completed,
                "index_tokens": w.index.tokens, "index_synced": w.synced, "last_seen_s": round(now - w.last_seen, 3),
                **w.info, "engine": engine, "histograms": hists,
                **({"restarts": self.supervisor.workers[w.name].restarts}
                   if self.supervisor is not None and w.name in self.supervisor.workers else {}),
            }
        out = {
            "router": {
                "address": self.address, "worker_address": self.worker_address, "policy": self.policy.name, "uptime_s": round(now - self.started, 3),
                "pid": os.getpid(),
                "counters": dict(self.counters),
                "gauges": {
                    "queue_depth": len(self.queue), "inflight": len(self.works),
                    "workers": len(self.workers), "workers_alive": len(self._alive()),
                    "max_queue": self.config.max_queue,
                    "max_inflight_per_worker": self.config.max_inflight_per_worker,
                    "shutting_down": int(self.shutting_down),
                },
                "histograms": {k: h.to_dict() for k, h in self.hist.items()},
            },
            "workers": workers,
        }
        if probe is not None:
            out["probe"] = probe
        return out


_HANDLERS = {  # the client socket
    P.Generate: Router._on_generate, P.Abort: Router._on_abort, P.Health: Router._on_health,
    P.Stats: Router._on_stats, P.Choose: Router._on_choose,
}
_WORKER_HANDLERS = {  # the worker socket
    P.Register: Router._on_register, P.Heartbeat: Router._on_heartbeat,
    P.CacheEvents: Router._on_cache_events, P.Goodbye: Router._on_goodbye,
    P.Chunk: Router._on_chunk, P.Final: Router._on_final, P.Error: Router._on_worker_error,
    P.ChoiceFinal: Router._on_choice_final, P.Leave: Router._on_leave,
}


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


def _longest_token_chars(tokenizer, cap: int = 64) -> int:
    """Characters in the vocabulary's longest token (at least 4, at most ``cap``): a prompt of
    more than ``context x this`` characters cannot fit the context."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max(len(t) for t in vocab) if vocab else cap
    except Exception:
        longest = cap
    return max(4, min(cap, longest))


def load_tokenizer(model: str | None):
    """The HF fast tokenizer of the model directory or .gguf file (the default model's when None)."""
    from transformers import AutoTokenizer

    from radixserve.model.default import resolve_model

    model = str(resolve_model(model))
    return AutoTokenizer.from_pretrained(model, local_files_only=True)
