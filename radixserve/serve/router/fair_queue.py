"""The router's bounded queue, fair between tenants.

One FIFO per tenant (a job's ``tenant``: its API key's tenant, an HTTP tenant's namespace, or its
connection on a keyless server), taken in turn: :meth:`FairQueue.popleft` serves the tenant served
the longest ago, so a tenant that queued 200 requests delays another's one by at most one request
per tenant. When the queue is full, a newcomer from a tenant holding less of it than the largest
holder pushes that holder's newest job out (:meth:`FairQueue.push_out`): one tenant can no longer
fill the queue and make everyone else's requests ``overloaded`` (a ZMQ client flooding it turned
every HTTP tenant's request into a 503).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from radixserve.serve.router.state import Job


class FairQueue:
    """Jobs waiting for a worker: per-tenant FIFOs; ``len`` counts them all. The next job is the
    head of the tenant served the longest ago (a tenant that had nothing queued counts as never
    served), so a tenant that just arrived goes before one that was just served."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, collections.deque[Job]] = {}
        self._served: dict[str, int] = {}  # tenant -> when it was last served (while it has jobs queued)
        self._clock = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[Job]:
        for jobs in list(self._by_tenant.values()):
            yield from list(jobs)

    def count(self, tenant: str) -> int:
        jobs = self._by_tenant.get(tenant)
        return len(jobs) if jobs else 0

    def holdings(self) -> dict[str, int]:
        """Queued jobs per tenant (a copy; tenants with none are absent)."""
        return {tenant: len(jobs) for tenant, jobs in self._by_tenant.items()}

    @staticmethod
    def gives_way(most: int, held: int) -> bool:
        """The rule of :meth:`push_out`: whether the largest holder of a full queue (holding
        ``most``) gives up its newest job to a newcomer whose tenant holds ``held``."""
        return most >= held + 2

    def append(self, job: Job) -> None:
        if job.tenant not in self._by_tenant:
            self._by_tenant[job.tenant] = collections.deque()
            self._served[job.tenant] = -1
        self._by_tenant[job.tenant].append(job)
        self._n += 1

    def appendleft(self, job: Job) -> None:
        """First in line (a retried job): its tenant is served next, and this job first."""
        self.append(job)
        jobs = self._by_tenant[job.tenant]
        jobs.pop()
        jobs.appendleft(job)
        self._served[job.tenant] = min(self._served.values()) - 1

    def popleft(self) -> Job:
        """The head of the FIFO of the tenant served the longest ago."""
        if not self._n:
            raise IndexError("pop from an empty FairQueue")
        tenant = min(self._served, key=self._served.__getitem__)
        jobs = self._by_tenant[tenant]
        job = jobs.popleft()
        self._clock += 1
        self._served[tenant] = self._clock
        self._drop_if_empty(tenant)
        self._n -= 1
        return job

    def remove(self, job: Job) -> None:
        """Take ``job`` out (raises ValueError when it is not queued)."""
        jobs = self._by_tenant.get(job.tenant)
        if jobs is None:
            raise ValueError("job is not queued")
        jobs.remove(job)
        self._drop_if_empty(job.tenant)
        self._n -= 1

    def push_out(self, tenant: str) -> Job | None:
        """Make room for a job of ``tenant`` in a full queue: take out and return the newest job
        of the tenant holding the most, if it holds at least two more than ``tenant`` does
        (otherwise the newcomer is the one refused: None)."""
        if not self._by_tenant:
            return None
        holder, jobs = max(self._by_tenant.items(), key=lambda kv: len(kv[1]))
        if not self.gives_way(len(jobs), self.count(tenant)):
            return None
        job = jobs.pop()
        self._drop_if_empty(holder)
        self._n -= 1
        return job

    def _drop_if_empty(self, tenant: str) -> None:
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant]
            del self._served[tenant]
