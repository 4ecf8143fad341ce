"""Refusing at the gateway what the router has just refused: overload answered without a round trip.

A burst of HTTP requests past the router's capacity was answered 503 at p99 220 ms (bench
reliability, RESULTS section 43): each refusal cost the gateway a full request's work and a
round trip to the router, one after another. After the router refuses a tenant's job as
``overloaded``, while the gateway still holds that many of the tenant's jobs, nothing has made room
for it: the tenant's next requests are refused here at once. A mark lapses when any job ends
(room somewhere), or after ``hold_s`` (room the gateway cannot see: a worker joined, another client's
jobs ended). Per tenant, so one tenant's flood never sheds another's requests, which the router's
fair queue may still take.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable

HOLD_S = 0.5


class Shedder:
    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self.jobs: collections.Counter[Hashable] = collections.Counter()  # the gateway's jobs at the router, per namespace
        self._marks: dict[Hashable, tuple[int, float]] = {}  # namespace -> (its jobs when the router refused one, when)
        self.shed = 0  # requests refused here

    def refuses(self, namespace: Hashable) -> bool:
        """Whether a new request of ``namespace`` would meet a full router (and is refused here)."""
        mark = self._marks.get(namespace)
        if mark is None:
            return False
        held, since = mark
        if self.jobs[namespace] >= held and self.clock() - since < self.hold_s:
            self.shed += 1
            return True
        del self._marks[namespace]
        return False

    def start(self, namespace: Hashable, jobs: int = 1) -> None:
        self.jobs[namespace] += jobs

    def end(self, namespace: Hashable, *, overloaded: bool = False) -> None:
        """One job of ``namespace`` ended: refused as overloaded (marks the namespace), or otherwise
        (which makes room: every mark lapses)."""
        self.jobs[namespace] -= 1
        if self.jobs[namespace] <= 0:
            del self.jobs[namespace]
        if overloaded:
            self._marks[namespace] = (self.jobs[namespace], self.clock())
        elif self._marks:
            self._marks.clear()
