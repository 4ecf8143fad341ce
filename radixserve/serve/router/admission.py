"""What the router would answer a new job, for the in-process HTTP gateway to read from its own
thread: a refusal the router would certainly give is answered there at once (HTTP 503
``overloaded``), before the request is parsed and without a round trip to the router.

A burst of HTTP requests drains at the gateway's cost per request: with each one parsed, checked
and sent to the router before the router's refusals could come back, every 503 of a 300-request
burst left after the whole burst had been taken in (issue 49, RESULTS section 43).

The router's loop publishes the view after every message it handles, every tick and every
admission after tokenizing (:meth:`~radixserve.serve.router.dispatch.Dispatcher.publish`): one
immutable snapshot, replaced in one assignment, so a reader on another thread never sees half an
update. A snapshot says "refusing" only when no live worker has room, the queue is full and its
largest holder would not give way to the tenant (the router's rule, :meth:`FairQueue.gives_way`);
in any other state, while shutting down (the router answers that itself), or when the snapshot is
older than ``max_age_s`` (a publication missed: the router decides), the request passes through.
"""

from __future__ import annotations

import time

from radixserve.serve.router.fair_queue import FairQueue


def http_tenant(namespace: str | None) -> str:
    """The queue share of an HTTP request of the gateway, by the cache namespace it named."""
    return f"http:{namespace or ''}"


class AdmissionView:
    """The router's admission state as the gateway reads it (any thread)."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        # None: the router would admit (or answer otherwise); else (published at, the most any
        # tenant holds of the full queue, what each holds)
        self._full: tuple[float, int, dict[str, int]] | None = None

    def publish(self, full: bool, queue: FairQueue) -> None:
        """On the router's loop: ``full`` when no live worker has room and the queue is full."""
        if not full:
            self._full = None
            return
        holdings = queue.holdings()
        self._full = (time.monotonic(), max(holdings.values(), default=0), holdings)

    def refuses(self, tenant: str) -> bool:
        """True when the router, as last published, refuses a new job of ``tenant``
        ``overloaded``; False when it might take it (then the router decides)."""
        full = self._full  # one read: one consistent snapshot
        if full is None:
            return False
        at, most, holdings = full
        if time.monotonic() - at > self.max_age_s:
            return False
        return not FairQueue.gives_way(most, holdings.get(tenant, 0))
