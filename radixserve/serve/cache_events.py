"""A worker's outbox of prefix-cache events for the router's mirror of its cache.

The engine thread reports every insert and eviction (:meth:`CacheEventOutbox.on_event`) and, on
request, a snapshot of the whole tree (:meth:`snapshot`); the loop sends them in order
(:meth:`flush`), batched about once per step. Every CacheEvents message carries a sequence number
so the router notices a lost message and asks for a snapshot; a snapshot (``reset``) replaces
what was pending, since it already holds it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from radixserve import protocol as P

SNAPSHOT_TOKENS = 1 << 20  # tokens per snapshot message (a few MB of msgpack)
_RESET = P.CacheEvent("reset", None, [])  # marks where a tree snapshot starts in the event list (by identity)


def _wire_namespace(namespace: Hashable) -> str | None:
    return namespace if isinstance(namespace, str) or namespace is None else str(namespace)


class CacheEventOutbox:
    """Cache events from the engine thread, sent in order on the loop by ``send``."""

    def __init__(self, worker: str, send: Callable[[P.CacheEvents], None]):
        self.worker = worker
        self.send = send
        self.seq = 0  # CacheEvents sent (the router checks they arrive without a gap)
        self.reset_seq = 0  # the seq of the last snapshot sent
        self.loop: Any = None  # the worker's event loop (or anything with call_soon_threadsafe), set when it runs
        self._events: list[P.CacheEvent] = []
        self._lock = threading.Lock()
        self._flush_scheduled = False

    def on_event(self, event: tuple) -> None:  # engine thread
        """One event of :class:`~radixserve.kv.radix.RadixCache` (its ``on_event`` callback)."""
        kind, namespace, tokens = event[0], event[1], event[2]
        length = event[3] if kind == "evict" else 0
        self._put([P.CacheEvent(kind, _wire_namespace(namespace), tokens, length)], replace=False)

    def snapshot(self, leaves: Iterable[tuple[Hashable, list[int]]]) -> None:  # engine thread, between steps
        """Replace the events not sent yet by the whole tree: its leaves' paths (a reset)."""
        events = [P.CacheEvent("insert", _wire_namespace(ns), tokens) for ns, tokens in leaves]
        self._put([_RESET, *events], replace=True)

    def _put(self, events: list[P.CacheEvent], *, replace: bool) -> None:
        with self._lock:
            if replace:
                self._events = events  # what was pending is in the snapshot already
            else:
                self._events.extend(events)
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:  # loop
        """Send what is pending (before a request's final, so its inserts arrive first)."""
        with self._lock:
            events, self._events = self._events, []
            self._flush_scheduled = False
        reset = False
        if events and events[0] is _RESET:
            reset, events = True, events[1:]
        if not events and not reset:
            return
        batch: list[P.CacheEvent] = []
        size = 0
        for ev in events:  # a big snapshot goes in several messages (the first one resets)
            batch.append(ev)
            size += len(ev.tokens)
            if size >= SNAPSHOT_TOKENS:
                self._send(batch, reset)
                batch, size, reset = [], 0, False
        if batch or reset:
            self._send(batch, reset)

    def _send(self, events: list[P.CacheEvent], reset: bool) -> None:
        self.seq += 1
        if reset:
            self.reset_seq = self.seq
        self.send(P.CacheEvents(worker=self.worker, events=events, seq=self.seq, reset=reset))
