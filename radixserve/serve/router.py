"""The router: one asyncio (uvloop) process in front of N worker processes.

One ROUTER socket (bound, 127.0.0.1 by default) serves clients and workers alike: a peer is a
worker once it sent :class:`~radixserve.protocol.Register`. Each message is handled to the end
synchronously on the loop (no awaits in handlers), so the router's state never races.

Admission: a request goes to a worker only while that worker has fewer than
``max_inflight_per_worker`` requests in flight; otherwise it waits in one router queue of at most
``max_queue`` requests; when that is full too, it is answered ``overloaded`` at once.

Failure handling: a worker that sends nothing for ``heartbeat_timeout_s`` (it heartbeats every
0.5 s), or whose local process exited, is declared dead. Each of its requests that has not yet
streamed a token to the client (all non-streaming ones) is restarted from scratch on a live
worker, under a new work id, so late messages of the dead attempt are ignored; a request that
already streamed tokens fails with ``worker_lost`` (no duplicated tokens, no duplicated final).
With no live worker left they all fail with ``worker_lost``. Every request ends with exactly
one Final or Error.
"""

from __future__ import annotations

import asyncio
import collections
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
    policy: str = "cache_aware"
    max_queue: int = 256
    max_inflight_per_worker: int = 64
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
        self.local_procs: list[Any] = []
        self._stopped: asyncio.Event | None = None
        self._bound = None

    # ------------------------------------------------------------------ socket
    def bind(self) -> str:
        """Bind the ROUTER socket; returns the address (with the real port when port is 0)."""
        self.ctx = zmq.asyncio.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop a client's stream on a slow reader
        sock.setsockopt(zmq.MAXMSGSIZE, P.WORKER_MAX_FRAME_BYTES)  # hard cap; soft per-peer below
        cfg = self.config
        if cfg.address:
            sock.bind(cfg.address)
            self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        elif cfg.port == 0:
            port = sock.bind_to_random_port(f"tcp://{cfg.host}")
            self.address = f"tcp://{cfg.host}:{port}"
        else:
            sock.bind(f"tcp://{cfg.host}:{cfg.port}")
            self.address = f"tcp://{cfg.host}:{cfg.port}"
        self.sock = sock
        return self.address

    def _send(self, identity: bytes, msg) -> None:
        try:
            self.sock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # unreachable peer: ROUTER drops; never let it kill the loop
            log.debug("send to %r failed: %s", identity, exc)

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
        tasks = [asyncio.ensure_future(self._receiver()), asyncio.ensure_future(self._ticker())]
        if self.config.metrics_log:
            tasks.append(asyncio.ensure_future(self._metrics_logger()))
        await self._stopped.wait()
        for t in tasks:
            t.cancel()
        self.sock.close(linger=500)
        self.ctx.term()

    async def _receiver(self) -> None:
        while True:
            parts = await self.sock.recv_multipart(copy=True)
            try:
                self._on_frames(parts)
            except Exception:  # a bug handling one message must not take the router down
                log.exception("router failed handling a message")

    def _on_frames(self, parts: list[bytes]) -> None:
        identity = parts[0]
        worker = self.by_identity.get(identity)
        if len(parts) != 2:
            self.counters["bad_frames"] += 1
            self._reply_error(identity, "", P.BAD_REQUEST, f"frame: expected one frame per message, got {len(parts) - 1}")
            return
        limit = P.WORKER_MAX_FRAME_BYTES if worker is not None else self.config.limits.max_frame_bytes
        try:
            msg = P.decode(parts[1], max_frame_bytes=limit)
        except P.DecodeError as exc:
            self.counters["bad_frames"] += 1
            self._reply_error(identity, exc.request_id, P.BAD_REQUEST, str(exc))
            return
        if worker is not None:
            worker.last_seen = time.monotonic()
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            self._reply_error(identity, getattr(msg, "id", ""), P.BAD_REQUEST,
                              f"type: {type(msg).__name__} is not a request a router accepts")
            return
        handler(self, identity, worker, msg)

    # ------------------------------------------------------------------ client requests
    def _accepting(self, identity: bytes, msg) -> tuple | None:
        """The job key for a new client call, or None after replying why it can't be taken."""
        if self.shutting_down:
            self._reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            return None
        key = (identity, msg.id)
        if key in self.jobs:
            self._reply_error(identity, msg.id, P.BAD_REQUEST, f"id: {msg.id!r} is already in flight on this connection")
            return None
        return key

    def _on_generate(self, identity: bytes, worker, msg: P.Generate) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            P.validate_generate(msg, self.config.limits)
            ids = msg.token_ids
            if ids is None:
                if self.tokenizer is None:
                    raise P.DecodeError("this router has no tokenizer; send token_ids", msg.id)
                ids = self.tokenizer.encode(msg.prompt)
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
            ids = msg.token_ids if msg.token_ids is not None else self.tokenizer.encode(msg.prompt)
            if len(ids) > self.config.limits.max_prompt_tokens:
                raise P._too_long(len(ids), self.config.limits)
            choice_ids = [self.tokenizer.encode(c, add_special_tokens=False) for c in msg.choices]
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
            self._send(job.worker.identity, P.Abort(id=job.work_id))

    def _on_health(self, identity: bytes, worker, msg: P.Health) -> None:
        alive = len(self._alive())
        status = "shutting_down" if self.shutting_down else ("ok" if alive else "degraded")
        self._send(identity, P.HealthReply(id=msg.id, status=status, workers=len(self.workers), workers_alive=alive))

    def _on_stats(self, identity: bytes, worker, msg: P.Stats) -> None:
        probe = None
        if msg.probe is not None:
            ids = msg.probe if isinstance(msg.probe, list) else (self.tokenizer.encode(msg.probe) if self.tokenizer else [])
            ids = ids[: self.config.limits.max_probe_tokens]
            probe = {w.name: w.index.tree.peek(ids, msg.namespace) for w in self.workers.values()}
        self._send(identity, P.StatsReply(id=msg.id, stats=self.stats(probe)))

    # ------------------------------------------------------------------ worker messages
    def _on_register(self, identity: bytes, worker, msg: P.Register) -> None:
        old = self.workers.get(msg.worker)
        if old is not None and old.alive:
            self._declare_dead(old, "it registered again (restarted)")
        state = WorkerState(name=msg.worker, identity=identity, pid=msg.pid, host=msg.host,
                            info=dict(max_model_len=msg.max_model_len, kv_total_tokens=msg.kv_total_tokens,
                                      page_size=msg.page_size))
        if old is not None:
            state.proc = old.proc
        for proc in self.local_procs:
            if getattr(proc, "worker_name", None) == msg.worker:
                state.proc = proc
        self.workers[msg.worker] = state
        self.by_identity[identity] = state
        log.info("worker %s joined (pid %d on %s, KV %d tokens)", msg.worker, msg.pid, msg.host, msg.kv_total_tokens)
        self._send(identity, P.Ping())
        self._pump()

    def _on_heartbeat(self, identity: bytes, worker, msg: P.Heartbeat) -> None:
        if worker is None:  # e.g. declared dead, or the router restarted: ask it to register
            return
        worker.engine = msg.stats

    def _on_cache_events(self, identity: bytes, worker, msg: P.CacheEvents) -> None:
        if worker is None or not worker.alive:
            return
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
            self._send(w.identity, P.ChooseWork(id=job.work_id, token_ids=job.token_ids, namespace=job.namespace,
                                                **job.choose))
        else:
            self._send(w.identity, P.Work(id=job.work_id, token_ids=job.token_ids, params=job.params,
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

    def _declare_dead(self, worker: WorkerState, why: str) -> None:
        if not worker.alive:
            return
        log.warning("worker %s is dead: %s; restarting its %d requests", worker.name, why, len(worker.inflight))
        worker.alive = False
        self.counters["worker_deaths"] += 1
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
        if worker.proc is not None and worker.proc.poll() is None:
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
        while True:
            await asyncio.sleep(cfg.heartbeat_s)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if not w.alive:
                    continue
                if w.proc is not None and w.proc.poll() is not None:
                    self._declare_dead(w, f"its process exited with status {w.proc.returncode}")
                elif now - w.last_seen > cfg.heartbeat_timeout_s:
                    self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f} s")
                else:
                    self._send(w.identity, P.Ping())
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
        if not self.shutting_down:
            asyncio.ensure_future(self.shutdown())

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
                self._send(w.identity, P.Shutdown(grace_s=self.config.drain_s))
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
                "index_tokens": w.index.tokens, "last_seen_s": round(now - w.last_seen, 3),
                **w.info, "engine": engine, "histograms": hists,
            }
        out = {
            "router": {
                "address": self.address, "policy": self.policy.name, "uptime_s": round(now - self.started, 3),
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


_HANDLERS = {
    P.Generate: Router._on_generate, P.Abort: Router._on_abort, P.Health: Router._on_health,
    P.Stats: Router._on_stats, P.Register: Router._on_register, P.Heartbeat: Router._on_heartbeat,
    P.CacheEvents: Router._on_cache_events, P.Goodbye: Router._on_goodbye,
    P.Chunk: Router._on_chunk, P.Final: Router._on_final, P.Error: Router._on_worker_error,
    P.Choose: Router._on_choose, P.ChoiceFinal: Router._on_choice_final,
}


def load_tokenizer(model: str | None):
    """The HF fast tokenizer of the model directory or .gguf file (the default model's when None)."""
    from transformers import AutoTokenizer

    from radixserve.model.default import resolve_model

    model = str(resolve_model(model))
    return AutoTokenizer.from_pretrained(model, local_files_only=True)
