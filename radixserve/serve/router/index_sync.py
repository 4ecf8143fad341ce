"""The per-worker cache index mirror: numbered CacheEvents applied in order, a snapshot after each
registration, and a resync (empty mirror + Rejoin) when events were lost."""

from __future__ import annotations

import logging

from radixserve import protocol as P
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Metrics, WorkerState

log = logging.getLogger("radixserve.router")


class IndexSync:
    """Keeps each worker's cache-index mirror exact. Its state is the mirror and the sequence
    numbers in each :class:`WorkerState`; it asks workers for snapshots through the transport."""

    def __init__(self, transport: Transport, metrics: Metrics) -> None:
        self.transport = transport
        self.metrics = metrics

    def resync(self, worker: WorkerState, why: str, known: int = 0) -> None:
        """Events were lost (the connection dropped some): the mirror may hold stale prefixes or
        miss some. Empty it and ask the worker for a fresh snapshot (only that)."""
        log.warning("worker %s: %s; resyncing its cache index", worker.name, why)
        self.metrics.count("index_resyncs")
        self.reset(worker)
        worker.resync_from = max(worker.resync_from, known)
        self.transport.send_worker(worker.identity, P.Rejoin(reason="cache events were lost", register=False))

    def reset(self, worker: WorkerState) -> None:
        """Empty the worker's mirror (pending prefixes stay) until its next snapshot arrives."""
        pending = worker.index.pending
        worker.index.clear()
        worker.index.pending.update(pending)
        worker.synced = False
        worker.resync_from = worker.seen_seq

    def check(self, worker: WorkerState, msg: P.Heartbeat) -> None:
        """Heartbeats follow the worker's cache events on the same ordered stream: they tell
        whether the last batch, or the snapshot we wait for, was lost on the way."""
        if worker.synced and msg.events_seq and msg.events_seq != worker.next_seq - 1:
            self.resync(worker, f"cache events up to {msg.events_seq} sent, {worker.next_seq - 1} received")
        elif not worker.synced and msg.reset_seq > worker.resync_from:
            self.resync(worker, f"the cache snapshot {msg.reset_seq} was lost", known=msg.reset_seq)

    def on_cache_events(self, worker: WorkerState, msg: P.CacheEvents) -> None:
        if not worker.alive:
            return
        worker.seen_seq = max(worker.seen_seq, msg.seq)
        if msg.reset:  # a snapshot: the whole tree, then the events after it
            self.reset(worker)
            worker.synced = True
        elif not worker.synced:
            return  # before the snapshot: the snapshot includes it
        elif msg.seq != worker.next_seq:
            # Events were lost (the connection dropped some): the mirror may hold stale
            # prefixes or miss some. Start again from a fresh snapshot.
            self.resync(worker, f"cache events {worker.next_seq}..{msg.seq - 1} lost")
            return
        worker.next_seq = msg.seq + 1
        index = worker.index
        for ev in msg.events:
            if ev.kind == "insert":
                index.insert(ev.namespace, ev.tokens)
            elif ev.kind == "evict":
                index.evict(ev.namespace, ev.tokens, ev.length)
