"""The per-worker cache index mirror: numbered CacheEvents applied in order, a snapshot after each
registration, and a resync (empty mirror + Rejoin) when events were lost."""

from __future__ import annotations

import logging

from radixserve import protocol as P
from radixserve.serve.router.base import RouterBase
from radixserve.serve.router.state import WorkerState

log = logging.getLogger("radixserve.router")


class IndexSync(RouterBase):
    """Keeping each worker's cache-index mirror exact."""

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
