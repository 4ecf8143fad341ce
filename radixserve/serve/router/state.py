"""The router's configuration, the state it keeps per request (:class:`Job`) and per worker
(:class:`WorkerState`), and the counters and histograms every component counts into (:class:`Metrics`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from prometheus_client import CollectorRegistry

from radixserve import protocol as P
from radixserve.serve.metrics import DEPTH_BUCKETS, LATENCY_BUCKETS_S, Histogram
from radixserve.serve.routing import CacheIndex
from radixserve.validation import check

log = logging.getLogger("radixserve.router")

TASK_ERROR_LOG_S = 60.0  # a periodic task that keeps failing logs its traceback once per this

_Count = Annotated[int, Meta(ge=1)]
_Seconds = Annotated[float, Meta(gt=0)]


class RouterConfig(msgspec.Struct, kw_only=True):
    """The router's settings (``serve`` builds them from its validated
    :class:`~radixserve.config.ServeConfig`; :meth:`check` runs the field constraints, which the
    keyword constructor does not)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 7700
    address: str | None = None  # full ZMQ address to bind (overrides host/port), e.g. ipc:///tmp/rs
    # the worker socket's port (default: port + 1; random when port is 0)
    worker_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    worker_address: str | None = None  # full ZMQ address of the worker socket (overrides worker_port)
    secret: str | None = None  # the shared worker secret (64 hex); None: a fresh one (Router.secret)
    model_fingerprint: str | None = None  # refuse workers of another model (None: accept any)
    forget_dead_s: _Seconds = 60.0  # a dead worker that is not ours to restart is dropped after this
    policy: str = "cache_aware"
    max_queue: Annotated[int, Meta(ge=0)] = 256
    max_inflight_per_worker: _Count = 64
    # Pings to workers every heartbeat_s; a worker silent for heartbeat_timeout_s is dead. 3 s is
    # 6 missed heartbeats: on a LAN, a false alarm needs one segment lost 4 times in a row (TCP
    # retransmits after 0.2, 0.4, 0.8, 1.6 s); raise it for a lossy or long-haul link (README).
    heartbeat_s: _Seconds = 0.5
    heartbeat_timeout_s: _Seconds = 3.0
    max_attempts: _Count = 3
    no_worker_wait_s: _Seconds = 30.0  # a request queued with no live worker fails after this long
    drain_s: Annotated[float, Meta(ge=0)] = 5.0  # on shutdown, how long requests in flight may take to finish
    limits: P.Limits = msgspec.field(default_factory=P.Limits)
    metrics_log: str | None = None
    metrics_interval_s: _Seconds = 10.0
    balance_abs: Annotated[int, Meta(ge=0)] = 16
    balance_rel: Annotated[float, Meta(ge=0)] = 1.5
    cache_threshold: Annotated[float, Meta(ge=0)] = 0.3
    # Tokenizing a long prompt takes seconds: it runs in a bounded thread pool, never on the loop
    # (a stalled loop sends no pings, and workers would take the router for dead).
    tokenize_threads: _Count = 2
    max_tokenizing: _Count = 32  # prompts being tokenized at once; beyond: overloaded
    inline_tokenize_chars: Annotated[int, Meta(ge=0)] = 8192  # shorter prompts are tokenized on the loop (microseconds)
    # The longest prompt (characters) worth tokenizing: the context in tokens times the longest
    # token in characters. None: derived from max_model_len and the tokenizer's vocabulary.
    max_prompt_chars: _Count | None = None
    max_model_len: _Count | None = None  # the model's context (tokens); None: from registered workers
    # Client connections at most (each holds a file descriptor); None: half the open-file limit, at most 16384.
    max_clients: _Count | None = None
    # API key -> tenant (serve's --api-key / --api-keys-file). When set, every Generate, Choose and
    # Stats must carry a known key, and runs in its tenant's cache namespace; when empty, the
    # client socket may only be bound to loopback (or ipc://).
    api_keys: dict[str, str] = msgspec.field(default_factory=dict)
    # Frames libzmq queues per client connection; past it the router holds them (Transport.send).
    client_sndhwm: _Count = 1000

    def check(self) -> None:
        """Raise :class:`~radixserve.errors.BadRequestError` naming the first field out of range."""
        check(self)


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
    worker: WorkerState | None = None
    streamed: int = 0
    first_chunk_at: float | None = None
    dispatched_at: float = 0.0
    queued_at: float = 0.0
    choose: Any = None  # a choose call: the ChooseWork fields other than id/token_ids/namespace
    tenant: str = ""  # whose share of the queue it takes (FairQueue): its key's tenant, or its connection


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
    "requests",
    "choose_requests",
    "completed",
    "aborted",
    "overloaded",
    "retries",
    "worker_deaths",
    "bad_frames",
    "refused_workers",
    "workers_left",
    "index_resyncs",
    "rejoins_asked",
    "refused_clients",
    "task_errors",
    "queue_pushed_out",
    "dropped_replies",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "streamed_tokens",
    "routed_cache_hit",
    "routed_load_balance",
    "routed_least_load",
    "routed_round_robin",
) + tuple(f"errors_{c}" for c in P.ERROR_CODES)


class Metrics:
    """The router's counters (:data:`COUNTERS`, and ``routed_*`` / ``errors_*`` ones as they
    come) and histograms, in its own prometheus-client registry. Every component is handed this
    one object and only adds to it; the stats document reads it."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.registry = CollectorRegistry()
        self.hist = {
            key: Histogram(buckets, name=f"radixserve_router_{key}", registry=self.registry)
            for key, buckets in (
                ("ttft_s", LATENCY_BUCKETS_S),
                ("e2e_s", LATENCY_BUCKETS_S),
                ("router_queue_s", LATENCY_BUCKETS_S),
                ("queue_depth_at_arrival", DEPTH_BUCKETS),
            )
        }
        self._task_error_logged: dict[str, float] = {}  # periodic task -> when its last traceback was logged

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def task_failed(self, task: str) -> None:
        """A periodic task's step raised (call it from the ``except``): count it and log it (the
        traceback at most once a minute per task); the task goes on."""
        self.count("task_errors")
        now = time.monotonic()
        if now - self._task_error_logged.get(task, -TASK_ERROR_LOG_S) >= TASK_ERROR_LOG_S:
            self._task_error_logged[task] = now
            log.exception("router %s failed (it goes on; %d such errors so far)", task, self.counters["task_errors"])
