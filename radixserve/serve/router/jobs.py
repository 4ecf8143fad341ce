"""The job table: every client call the router holds, from its admission to its one Final or Error.

A job is found three ways: by the client's key ``(connection, id)`` (for aborts and duplicate
ids), by the work id of its current attempt on a worker (for that worker's answers; a late
answer of an attempt given up finds nothing), and, while it waits for a worker, in the fair
queue. Only the :class:`~radixserve.serve.router.dispatch.Dispatcher` changes it.
"""

from __future__ import annotations

import itertools

from radixserve.serve.router.fair_queue import FairQueue
from radixserve.serve.router.state import Job, WorkerState

JobKey = tuple[bytes, str]  # (client connection, the client's request id)


class JobTable:
    """Jobs by client key and by work id, and the queue of those waiting for a worker."""

    def __init__(self) -> None:
        self._by_key: dict[JobKey, Job] = {}
        self.works: dict[str, Job] = {}  # work id of the current attempt -> job on a worker (read-only outside)
        self.queue = FairQueue()  # jobs waiting for a worker (each is also in the table by key)
        self._numbers = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: JobKey) -> bool:
        return key in self._by_key

    def get(self, key: JobKey) -> Job | None:
        return self._by_key.get(key)

    def number(self) -> int:
        """The next job's number (jobs restarted after a worker's death go oldest first)."""
        return next(self._numbers)

    def add(self, job: Job) -> None:
        self._by_key[(job.client, job.cid)] = job

    def forget(self, job: Job) -> None:
        """The job got its answer (or is about to): drop it."""
        self._by_key.pop((job.client, job.cid), None)

    def on_worker(self, job: Job) -> None:
        """``job``'s attempt ``job.work_id`` now runs on a worker."""
        self.works[job.work_id] = job

    def off_worker(self, job: Job) -> None:
        self.works.pop(job.work_id, None)

    def of_attempt(self, worker: WorkerState, work_id: str) -> Job | None:
        """The job whose current attempt is ``work_id`` on ``worker``; None for a late message of
        an attempt that was given up."""
        job = self.works.get(work_id)
        return job if job is not None and job.worker is worker else None

    def take_queue(self) -> list[Job]:
        """Empty the queue and forget its jobs; returns them in queue order."""
        out = []
        while self.queue:
            job = self.queue.popleft()
            self.forget(job)
            out.append(job)
        return out

    def take_all(self) -> list[Job]:
        """Forget every job (on a worker or queued); returns them, each once."""
        out = list(self._by_key.values())
        self._by_key.clear()
        self.works.clear()
        while self.queue:
            self.queue.popleft()
        return out
