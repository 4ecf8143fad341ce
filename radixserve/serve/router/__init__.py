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

from radixserve.serve.router.core import Router, load_tokenizer, shareable
from radixserve.serve.router.state import COUNTERS, Job, RouterConfig, WorkerState

__all__ = ["COUNTERS", "Job", "Router", "RouterConfig", "WorkerState", "load_tokenizer", "shareable"]
