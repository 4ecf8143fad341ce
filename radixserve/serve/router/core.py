"""The :class:`Router`: its state, the main loop, shutdown and the stats document; the message
handlers live in the mixins it is made of."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import itertools
import logging
import os
import signal
import time
from typing import Any

from prometheus_client import CollectorRegistry

from radixserve import protocol as P
from radixserve.serve.metrics import DEPTH_BUCKETS, LATENCY_BUCKETS_S, Histogram, MetricsLog
from radixserve.serve.routing import make_policy
from radixserve.serve.tenants import TenantKeys
from radixserve.serve.router.state import COUNTERS, Job, RouterConfig, WorkerState
from radixserve.serve.router.dispatch import Dispatch
from radixserve.serve.router.fair_queue import FairQueue
from radixserve.serve.router.front import ClientFront, longest_token_chars
from radixserve.serve.router.index_sync import IndexSync
from radixserve.serve.router.registry import WorkerRegistry
from radixserve.serve.router.sockets import Sockets

log = logging.getLogger("radixserve.router")

TASK_ERROR_LOG_S = 60.0  # a periodic task that keeps failing logs its traceback once per this


class Router(Sockets, ClientFront, Dispatch, WorkerRegistry, IndexSync):
    """The router process's state. Its message handlers come from the mixins: :class:`Sockets`
    (frames in and out), :class:`ClientFront` (client requests), :class:`Dispatch` (jobs on
    workers), :class:`WorkerRegistry` (registration, liveness), :class:`IndexSync` (cache-index
    mirrors). Each handler runs to the end on the loop, so the state never races."""

    def __init__(self, config: RouterConfig, tokenizer=None):
        config.check()
        self.config = config
        self.tokenizer = tokenizer
        self.policy = make_policy(config.policy, **(
            dict(balance_abs=config.balance_abs, balance_rel=config.balance_rel,
                 cache_threshold=config.cache_threshold) if config.policy == "cache_aware" else {}))
        self.workers: dict[str, WorkerState] = {}
        self.by_identity: dict[bytes, WorkerState] = {}
        self.jobs: dict[tuple[bytes, str], Job] = {}
        self.works: dict[str, Job] = {}
        self.queue = FairQueue()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.registry = CollectorRegistry()  # the router's own prometheus-client metrics
        self.hist = {key: Histogram(buckets, name=f"radixserve_router_{key}", registry=self.registry)
                     for key, buckets in (("ttft_s", LATENCY_BUCKETS_S), ("e2e_s", LATENCY_BUCKETS_S),
                                          ("router_queue_s", LATENCY_BUCKETS_S),
                                          ("queue_depth_at_arrival", DEPTH_BUCKETS))}
        self.shutting_down = False
        self.started = time.monotonic()
        self._n = itertools.count(1)
        self.address = ""
        self.worker_address = ""
        from radixserve.serve import auth

        self.secret = auth.check_secret(config.secret) if config.secret else auth.new_secret()
        self.tenants = TenantKeys(config.api_keys)
        self.gateway_key = auth.gateway_key(self.secret)
        self._tokenizing_by = collections.Counter()
        self._backlog = {}
        self._flush_scheduled = False
        self._trusted = set()
        self.local_procs: list[Any] = []
        self._stopped: asyncio.Event | None = None
        self.supervisor = None  # serve's Supervisor of local worker processes (restarts them)
        self.fatal: str | None = None  # why serve must exit non-zero (e.g. every worker failed at start-up)
        self.forced = False  # a second interrupt: stopped without draining
        self.on_ready = None  # called once with the number of live workers when every local one joined
        self._announced = False
        self._tok_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._tokenizing: dict[tuple, bool] = {}  # key -> aborted while tokenizing
        self._last_tick = time.monotonic()
        self._token_chars = longest_token_chars(tokenizer)
        self._rejoin_asked: dict[bytes, float] = {}
        self._task_error_logged: dict[str, float] = {}
        self.clients = 0  # open client connections (Sockets._count_clients)
        self.max_clients = config.max_clients or 0  # set by bind() when None
        self._clients_full_logged = -60.0

    @property
    def local_procs(self) -> list[Any]:
        return self.supervisor.procs if self.supervisor is not None else self._local_procs

    @local_procs.setter
    def local_procs(self, procs: list[Any]) -> None:
        self._local_procs = procs

    async def serve(self) -> None:
        if not getattr(self, "sock", None):
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
        tasks = [asyncio.ensure_future(self._receiver()), asyncio.ensure_future(self._worker_receiver()),
                 asyncio.ensure_future(self._ticker()), asyncio.ensure_future(self._count_clients())]
        if self.config.metrics_log:
            tasks.append(asyncio.ensure_future(self._metrics_logger(self.config.metrics_log)))
        await self._stopped.wait()
        for t in tasks:
            t.cancel()
        if self._tok_pool is not None:
            self._tok_pool.shutdown(wait=False, cancel_futures=True)
        self.close()

    async def _metrics_logger(self, path: str) -> None:
        out = MetricsLog(path)
        while True:
            await asyncio.sleep(self.config.metrics_interval_s)
            try:
                out.write(self.stats())
            except Exception:
                self._task_failed("metrics log")

    def _task_failed(self, task: str) -> None:
        """A periodic task's step raised: count it and log it (the traceback at most once a
        minute per task), and let the task go on."""
        self.counters["task_errors"] += 1
        now = time.monotonic()
        if now - self._task_error_logged.get(task, -TASK_ERROR_LOG_S) >= TASK_ERROR_LOG_S:
            self._task_error_logged[task] = now
            log.exception("router %s failed (it goes on; %d such errors so far)", task, self.counters["task_errors"])

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
                    "clients": self.clients, "max_clients": self.max_clients,
                    "max_queue": self.config.max_queue,
                    "max_inflight_per_worker": self.config.max_inflight_per_worker,
                    "shutting_down": int(self.shutting_down),
                },
                "histograms": {k: h.to_dict() for k, h in self.hist.items()},
                "max_prompt_chars": self.prompt_char_limit(),  # longer prompts are refused untokenized
            },
            "workers": workers,
        }
        if probe is not None:
            out["probe"] = probe
        return out


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
