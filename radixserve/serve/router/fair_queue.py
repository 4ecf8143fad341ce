"""The router's bounded queue, fair between tenants.

One FIFO per tenant (a job's ``tenant``: its API key's tenant, an HTTP tenant's namespace, or its
connection on a keyless server), taken in turn: :meth:`FairQueue.popleft` serves the tenants round
robin, so a tenant that queued 200 requests delays another's one by at most one request per
tenant. When the queue is full, a newcomer from a tenant holding less of it than the largest
holder pushes that holder's newest job out (:meth:`FairQueue.push_out`): one tenant can no longer
fill the queue and make everyone else's requests ``overloaded`` (a ZMQ client flooding it turned
every HTTP tenant's request into a 503).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from radixserve.serve.router.state import Job


class FairQueue:
    """Jobs waiting for a worker: per-tenant FIFOs served round robin; ``len`` counts them all."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, collections.deque[Job]] = {}  # in serving order: the next one first
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

    def append(self, job: Job) -> None:
        self._by_tenant.setdefault(job.tenant, collections.deque()).append(job)
        self._n += 1

    def appendleft(self, job: Job) -> None:
        """First in line (a retried job): its tenant is served next, and this job first."""
        jobs = self._by_tenant.pop(job.tenant, None) or collections.deque()
        jobs.appendleft(job)
        self._by_tenant = {job.tenant: jobs, **self._by_tenant}
        self._n += 1

    def popleft(self) -> Job:
        """The next job: the head of the next tenant's FIFO; that tenant goes to the back."""
        if not self._n:
            raise IndexError("pop from an empty FairQueue")
        tenant, jobs = next(iter(self._by_tenant.items()))
        job = jobs.popleft()
        del self._by_tenant[tenant]
        if jobs:
            self._by_tenant[tenant] = jobs
        self._n -= 1
        return job

    def remove(self, job: Job) -> None:
        """Take ``job`` out (raises ValueError when it is not queued)."""
        jobs = self._by_tenant.get(job.tenant)
        if jobs is None:
            raise ValueError("job is not queued")
        jobs.remove(job)
        if not jobs:
            del self._by_tenant[job.tenant]
        self._n -= 1

    def push_out(self, tenant: str) -> Job | None:
        """Make room for a job of ``tenant`` in a full queue: take out and return the newest job
        of the tenant holding the most, if it holds at least two more than ``tenant`` does
        (otherwise the newcomer is the one refused: None)."""
        if not self._by_tenant:
            return None
        holder, jobs = max(self._by_tenant.items(), key=lambda kv: len(kv[1]))
        if len(jobs) < self.count(tenant) + 2:
            return None
        job = jobs.pop()
        if not jobs:
            del self._by_tenant[holder]
        self._n -= 1
        return job
