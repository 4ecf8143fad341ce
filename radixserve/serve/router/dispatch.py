"""The life of a request on a worker: routing it (policy choice, in-flight cap), the bounded
queue, its results coming back, and restarting or failing it when its worker dies."""

from __future__ import annotations

import logging
import time

from radixserve import protocol as P
from radixserve.serve.routing import Candidate
from radixserve.serve.router.base import RouterBase
from radixserve.serve.router.state import Job, WorkerState

log = logging.getLogger("radixserve.router")


class Dispatch(RouterBase):
    """Dispatching jobs to workers, their results, and restarts after a worker's death."""

    def _alive(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.alive and not w.draining]

    def _candidates(self) -> list[WorkerState]:
        cap = self.config.max_inflight_per_worker
        return [w for w in self._alive() if len(w.inflight) < cap]

    def _dispatch(self, job: Job, candidates: list[WorkerState]) -> None:
        cands = [Candidate(w.name, len(w.inflight), w.index) for w in candidates]
        decision = self.policy.choose(cands, job.token_ids, job.namespace)
        w = self.workers[decision.worker]
        self.counters[f"routed_{decision.reason}"] = self.counters.get(f"routed_{decision.reason}", 0) + 1
        job.attempt += 1
        job.work_id = f"{job.n}.{job.attempt}"
        job.worker = w
        job.dispatched_at = time.monotonic()
        if job.queued_at:
            self.hist["router_queue_s"].observe(job.dispatched_at - job.queued_at)
        w.inflight[job.work_id] = job
        w.routed += 1
        self.works[job.work_id] = job
        if self.policy.name == "cache_aware":
            w.index.add_pending(job.work_id, job.namespace, job.token_ids)
        if job.choose is not None:
            self._wsend(w.identity, P.ChooseWork(id=job.work_id, token_ids=job.token_ids, namespace=job.namespace,
                                                **job.choose))
        else:
            self._wsend(w.identity, P.Work(id=job.work_id, token_ids=job.token_ids, params=job.params,
                                          namespace=job.namespace, stream=job.stream))

    def _pump(self) -> None:
        """Dispatch queued requests while some worker has room."""
        while self.queue:
            candidates = self._candidates()
            if not candidates:
                return
            self._dispatch(self.queue.popleft(), candidates)

    def _finish(self, job: Job, worker: WorkerState | None, *, keep_job: bool = False) -> None:
        self.works.pop(job.work_id, None)
        if worker is not None:
            worker.inflight.pop(job.work_id, None)
            worker.index.drop_pending(job.work_id)
        job.worker = None
        if not keep_job:
            self.jobs.pop((job.client, job.cid), None)

    def _retryable(self, job: Job) -> bool:
        return job.streamed == 0 and job.attempt < self.config.max_attempts

    def _requeue(self, job: Job) -> None:
        self.counters["retries"] += 1
        job.queued_at = time.monotonic()
        self.queue.appendleft(job)

    def _declare_dead(self, worker: WorkerState, why: str, *, left: bool = False) -> None:
        if not worker.alive:
            return
        if not left:
            self.counters["worker_deaths"] += 1
        worker.alive = False
        self.by_identity.pop(worker.identity, None)
        jobs = sorted(worker.inflight.values(), key=lambda j: j.n, reverse=True)
        restarted = 0
        for job in jobs:
            self._finish(job, worker, keep_job=True)
            if self._retryable(job) and not self.shutting_down:
                self._requeue(job)
                restarted += 1
            else:
                self.jobs.pop((job.client, job.cid), None)
                what = f"after streaming {job.streamed} tokens" if job.streamed else f"after {job.attempt} attempts"
                self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                  f"worker {worker.name} died ({why}) {what}; retry the request")
        fate = (f"{len(jobs)} request{'s' if len(jobs) > 1 else ''} in flight there: {restarted} restarted, "
                f"{len(jobs) - restarted} answered with an error (streaming already, out of attempts or shutting down)"
                if jobs else "no requests in flight there")
        if left:
            log.info("worker %s left; %s", worker.name, fate)
        else:
            log.warning("worker %s is dead: %s; %s", worker.name, why, fate)
        worker.index.clear()
        worker.synced = False
        if worker.proc is not None and worker.proc.poll() is None and not left:
            worker.proc.kill()  # hung: make sure it is gone
        if not any(w.alive for w in self.workers.values()):
            self._fail_queue(P.WORKER_LOST, "no worker is left; retry later")
        self._pump()

    def _fail_queue(self, code: str, message: str) -> None:
        while self.queue:
            job = self.queue.popleft()
            self.jobs.pop((job.client, job.cid), None)
            self._reply_error(job.client, job.cid, code, message)

    def _job_of(self, worker, work_id: str) -> Job | None:
        job = self.works.get(work_id)
        if job is None or worker is None or job.worker is not worker:
            return None  # a late message from an attempt that was given up
        return job

    def _on_chunk(self, identity: bytes, worker, msg: P.Chunk) -> None:
        job = self._job_of(worker, msg.id)
        if job is None or not job.stream:
            return
        if job.first_chunk_at is None:
            job.first_chunk_at = time.monotonic()
        job.streamed += len(msg.token_ids)
        self.counters["streamed_tokens"] += len(msg.token_ids)
        self._send(job.client, P.Chunk(id=job.cid, token_ids=msg.token_ids, text=msg.text, logprobs=msg.logprobs))

    def _on_final(self, identity: bytes, worker, msg: P.Final) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        ttft = (job.first_chunk_at - job.arrival) if job.first_chunk_at else waited + msg.timings.ttft_s
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=ttft, e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        c = self.counters
        c["completed"] += 1
        c["aborted"] += msg.finish_reason == "abort"
        c["prompt_tokens"] += msg.usage.prompt_tokens
        c["cached_tokens"] += msg.usage.cached_tokens
        c["completion_tokens"] += msg.usage.completion_tokens
        self.hist["ttft_s"].observe(ttft)
        self.hist["e2e_s"].observe(timings.e2e_s)
        worker.ttft.observe(ttft)
        self._send(job.client, P.Final(id=job.cid, token_ids=msg.token_ids, text=msg.text,
                                       finish_reason=msg.finish_reason, usage=msg.usage, timings=timings,
                                       worker=worker.name, logprobs=msg.logprobs))
        self._pump()

    def _on_choice_final(self, identity: bytes, worker, msg: P.ChoiceFinal) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=waited + msg.timings.ttft_s,
                            e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        c = self.counters
        c["completed"] += 1
        c["prompt_tokens"] += msg.usage.query_tokens
        c["cached_tokens"] += msg.usage.cached_tokens
        self.hist["ttft_s"].observe(timings.ttft_s)
        self.hist["e2e_s"].observe(timings.e2e_s)
        worker.ttft.observe(timings.ttft_s)
        self._send(job.client, P.ChoiceFinal(id=job.cid, best=msg.best, index=msg.index, ranked=msg.ranked,
                                             usage=msg.usage, timings=timings, worker=worker.name))
        self._pump()

    def _on_worker_error(self, identity: bytes, worker, msg: P.Error) -> None:
        job = self._job_of(worker, msg.id)
        if job is None:
            return
        self._finish(job, worker, keep_job=True)
        if msg.code == P.SHUTTING_DOWN and not self.shutting_down and self._retryable(job):
            self._requeue(job)
        else:
            self.jobs.pop((job.client, job.cid), None)
            self._reply_error(job.client, job.cid, msg.code, msg.message)
        self._pump()
