"""What the router's mixins share: the state :class:`~radixserve.serve.router.core.Router` sets up
and the methods one mixin calls on another. Each mixin derives from :class:`RouterBase`, so mypy
checks every ``self.x`` of a mixin against one declaration. Only annotations live here: no
values, no behaviour (the methods are declared for the type checker alone)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq.asyncio
    from prometheus_client import CollectorRegistry

    from radixserve.serve.metrics import Histogram
    from radixserve.serve.router.fair_queue import FairQueue
    from radixserve.serve.tenants import TenantKeys
    from radixserve.serve.router.state import Job, RouterConfig, WorkerState
    from radixserve.serve.routing import Policy
    from radixserve.serve.supervisor import Supervisor


class RouterBase:
    """The router's state (set in ``Router.__init__`` and ``Sockets.bind``)."""

    config: RouterConfig
    tokenizer: Any  # a Hugging Face tokenizer, or None: clients must send token ids
    policy: Policy
    workers: dict[str, WorkerState]
    by_identity: dict[bytes, WorkerState]
    jobs: dict[tuple[bytes, str], Job]  # (client identity, client's id) -> job
    works: dict[str, Job]  # work id -> job on a worker
    queue: FairQueue
    tenants: TenantKeys  # API keys -> tenants -> cache namespaces (empty: a keyless server)
    gateway_key: str  # what the in-process HTTP gateway authenticates with (it authenticated its tenants)
    _tokenizing_by: collections.Counter[str]  # tenant -> its prompts being tokenized
    _backlog: dict[bytes, Any]  # client identity -> frames waiting for its connection (Sockets._send)
    _flush_scheduled: bool
    _trusted: set[bytes]  # connections that authenticated as the gateway (their replies are never dropped)
    counters: dict[str, int]
    registry: CollectorRegistry
    hist: dict[str, Histogram]
    shutting_down: bool
    started: float
    _n: itertools.count[int]
    address: str
    worker_address: str
    secret: str
    local_procs: list[Any]
    supervisor: Supervisor | None
    fatal: str | None
    forced: bool
    on_ready: Callable[[int], None] | None
    _stopped: asyncio.Event | None
    _announced: bool
    _tok_pool: concurrent.futures.ThreadPoolExecutor | None
    _tokenizing: dict[tuple[bytes, str], bool]  # key -> aborted while tokenizing
    _last_tick: float
    _token_chars: int
    _rejoin_asked: dict[bytes, float]
    _task_error_logged: dict[str, float]  # periodic task -> when its last traceback was logged
    clients: int  # open client connections
    max_clients: int  # beyond: new client connections are refused (Sockets._admit_client)
    _clients_full_logged: float
    # bound sockets (Sockets.bind)
    ctx: zmq.asyncio.Context
    sock: zmq.asyncio.Socket
    wsock: zmq.asyncio.Socket
    _auth: Any  # zmq.auth.thread.ThreadAuthenticator
    _client_monitor: zmq.asyncio.Socket  # the client socket's connection events

    if TYPE_CHECKING:
        # Sockets
        def _send(self, identity: bytes, msg: Any) -> None: ...
        def _wsend(self, identity: bytes, msg: Any) -> None: ...
        def _reply_error(self, identity: bytes, rid: str, code: str, message: str) -> None: ...

        # Dispatch
        def _alive(self) -> list[WorkerState]: ...
        def _candidates(self) -> list[WorkerState]: ...
        def _dispatch(self, job: Job, candidates: list[WorkerState]) -> None: ...
        def _pump(self) -> None: ...
        def _finish(self, job: Job, worker: WorkerState | None, *, keep_job: bool = False) -> None: ...
        def _retryable(self, job: Job) -> bool: ...
        def _requeue(self, job: Job) -> None: ...
        def _declare_dead(self, worker: WorkerState, why: str, *, left: bool = False) -> None: ...
        def _fail_queue(self, code: str, message: str) -> None: ...

        # IndexSync
        def _resync(self, worker: WorkerState, why: str, known: int = 0) -> None: ...
        def _reset_index(self, worker: WorkerState) -> None: ...

        # Router (core)
        def request_shutdown(self) -> None: ...
        def _task_failed(self, task: str) -> None: ...
        def stats(self, probe: dict[str, int] | None = None) -> dict[str, Any]: ...
