"""The life of a job on a worker: admission (dispatched, queued, or refused ``overloaded``),
routing by the policy under the in-flight cap, its results coming back, and restarting or failing
it when its worker dies, leaves or loses it."""

from __future__ import annotations

import logging
import time

from radixserve import protocol as P
from radixserve.serve.router.admission import AdmissionView
from radixserve.serve.router.jobs import JobTable
from radixserve.serve.router.registry import WorkerRegistry
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Job, Metrics, RouterConfig, WorkerState
from radixserve.serve.routing import Candidate, Policy

log = logging.getLogger("radixserve.router")


class Dispatcher:
    """Moves jobs between the job table's queue and the workers. The only component that
    changes the job table; answers clients through the transport."""

    def __init__(self, config: RouterConfig, jobs: JobTable, registry: WorkerRegistry, policy: Policy, transport: Transport, metrics: Metrics) -> None:
        self.config = config
        self.jobs = jobs
        self.registry = registry
        self.policy = policy
        self.transport = transport
        self.metrics = metrics
        self.shutting_down = False  # no new jobs, no restarts (Router.shutdown)
        # what a new job would get, for the in-process gateway; two ticks without a publication: stale
        self.admission = AdmissionView(max_age_s=2 * config.heartbeat_s)

    def publish(self) -> None:
        """Publish the admission state (:mod:`~radixserve.serve.router.admission`). The router
        calls it after each message, tick and admission after tokenizing: whatever could open room."""
        queue = self.jobs.queue
        full = len(queue) >= self.config.max_queue and not self.shutting_down and not self.registry.candidates()
        self.admission.publish(full, queue)

    # -- admission and routing -----------------------------------------------------------------
    def admit(self, job: Job) -> None:
        """A new job: to a worker with room, else into the queue while it has room (or a
        tenant holding more of it gives some up), else answered ``overloaded``."""
        queue = self.jobs.queue
        self.metrics.hist["queue_depth_at_arrival"].observe(len(queue))
        candidates = self.registry.candidates()
        if candidates:
            self.jobs.add(job)
            self._dispatch(job, candidates)
        elif len(queue) < self.config.max_queue or self._push_out(job.tenant):
            self.jobs.add(job)
            job.queued_at = job.arrival
            queue.append(job)
        else:
            self.metrics.count("overloaded")
            self.transport.reply_error(
                job.client,
                job.cid,
                P.OVERLOADED,
                f"all {len(self.registry.alive())} workers are at their in-flight cap and the "
                f"router queue is full ({self.config.max_queue}); retry later or add workers",
            )

    def _push_out(self, tenant: str) -> bool:
        """Room in the full queue for a job of ``tenant``, by refusing the newest job of the tenant
        holding the most of it (if that holds at least two more than ``tenant``)."""
        out = self.jobs.queue.push_out(tenant)
        if out is None:
            return False
        self.metrics.count("overloaded")
        self.metrics.count("queue_pushed_out")
        self.jobs.forget(out)
        self.transport.reply_error(
            out.client, out.cid, P.OVERLOADED, f"the router queue is full ({self.config.max_queue}) and your requests hold the most of it; retry later"
        )
        return True

    def _dispatch(self, job: Job, candidates: list[WorkerState]) -> None:
        cands = [Candidate(w.name, len(w.inflight), w.index) for w in candidates]
        decision = self.policy.choose(cands, job.token_ids, job.namespace)
        w = self.registry.workers[decision.worker]
        self.metrics.count(f"routed_{decision.reason}")
        job.attempt += 1
        job.work_id = f"{job.n}.{job.attempt}"
        job.worker = w
        job.dispatched_at = time.monotonic()
        if job.queued_at:
            self.metrics.hist["router_queue_s"].observe(job.dispatched_at - job.queued_at)
        w.inflight[job.work_id] = job
        w.routed += 1
        self.jobs.on_worker(job)
        if self.policy.name == "cache_aware":
            w.index.add_pending(job.work_id, job.namespace, job.token_ids)
        if job.choose is not None:
            self.transport.send_worker(w.identity, P.ChooseWork(id=job.work_id, token_ids=job.token_ids, namespace=job.namespace, **job.choose))
        else:
            self.transport.send_worker(
                w.identity, P.Work(id=job.work_id, token_ids=job.token_ids, params=job.params, namespace=job.namespace, stream=job.stream)
            )

    def pump(self) -> None:
        """Dispatch queued jobs while some worker has room."""
        queue = self.jobs.queue
        while queue:
            candidates = self.registry.candidates()
            if not candidates:
                return
            self._dispatch(queue.popleft(), candidates)

    def _finish(self, job: Job, worker: WorkerState | None, *, keep_job: bool = False) -> None:
        """End ``job``'s current attempt (and, unless ``keep_job``, the job)."""
        self.jobs.off_worker(job)
        if worker is not None:
            worker.inflight.pop(job.work_id, None)
            worker.index.drop_pending(job.work_id)
        job.worker = None
        if not keep_job:
            self.jobs.forget(job)

    def _answer(self, job: Job, code: str, message: str) -> None:
        self.jobs.forget(job)
        self.transport.reply_error(job.client, job.cid, code, message)

    def _restart(self, job: Job) -> bool:
        """Queue ``job`` first in line for a new attempt, if it may have one (it streamed
        nothing, has attempts left, and we are not shutting down); True if it was."""
        if job.streamed or job.attempt >= self.config.max_attempts or self.shutting_down:
            return False
        self.metrics.count("retries")
        job.queued_at = time.monotonic()
        self.jobs.queue.appendleft(job)
        return True

    # -- workers coming and going --------------------------------------------------------------
    def on_register(self, identity: bytes, worker: WorkerState | None, msg: P.Register) -> None:
        registry = self.registry
        if registry.refuse(identity, worker, msg):
            return
        again = registry.registering_again(identity, msg)
        if again is not None:
            self._reclaim(again, registry.registered_again(again, msg))
            return
        old = registry.workers.get(msg.worker)
        if old is not None and old.alive:  # its process exited (refuse() let this one in)
            self.worker_lost(old, f"its process exited, and pid {msg.pid} registered under its name")
        registry.join(identity, msg)
        self.pump()

    def on_leave(self, worker: WorkerState, msg: P.Leave) -> None:
        self.metrics.count("workers_left")
        self.worker_lost(worker, "it left", left=True)

    def worker_lost(self, worker: WorkerState, why: str, *, left: bool = False) -> None:
        """``worker`` died (or ``left``): restart each of its jobs that streamed nothing on
        another worker under a new work id, answer the others ``worker_lost``."""
        if not worker.alive:
            return
        orphans = self.registry.declare_dead(worker, why, left=left)
        restarted = 0
        for job in orphans:
            self._finish(job, worker, keep_job=True)
            if self._restart(job):
                restarted += 1
            else:
                what = f"after streaming {job.streamed} tokens" if job.streamed else f"after {job.attempt} attempts"
                self._answer(job, P.WORKER_LOST, f"worker {worker.name} died ({why}) {what}; retry the request")
        fate = (
            f"{len(orphans)} request{'s' if len(orphans) > 1 else ''} in flight there: {restarted} restarted, "
            f"{len(orphans) - restarted} answered with an error (streaming already, out of attempts or shutting down)"
            if orphans
            else "no requests in flight there"
        )
        if left:
            log.info("worker %s left; %s", worker.name, fate)
        else:
            log.warning("worker %s is dead: %s; %s", worker.name, why, fate)
        if not self.registry.any_alive():
            self.fail_queue(P.WORKER_LOST, "no worker is left; retry later")
        self.pump()

    def _reclaim(self, worker: WorkerState, lost: list[Job]) -> None:
        """Jobs ``worker`` lost with its connection (it registered again without them): restart
        them elsewhere under a new work id, or fail those that streamed."""
        for job in lost:
            self._finish(job, worker, keep_job=True)
            if not self._restart(job):
                self._answer(job, P.WORKER_LOST, f"worker {worker.name} lost the request with its connection; retry the request")
        if lost:
            log.warning("worker %s re-registered without %d of its requests; restarted them", worker.name, len(lost))
            self.pump()

    def fail_queue(self, code: str, message: str) -> None:
        for job in self.jobs.take_queue():
            self.transport.reply_error(job.client, job.cid, code, message)

    def expire_queue(self, now: float) -> None:
        """With no live worker, answer the jobs that waited ``no_worker_wait_s`` for one."""
        wait = self.config.no_worker_wait_s
        if not self.jobs.queue or self.registry.any_alive():
            return
        for job in [j for j in self.jobs.queue if now - j.queued_at > wait]:
            self.jobs.queue.remove(job)
            self._answer(job, P.WORKER_LOST, f"no worker joined within {wait:.0f} s")

    # -- a job's messages ----------------------------------------------------------------------
    def abort(self, job: Job) -> None:
        """The client aborted ``job``: a queued one ends here (a generate with an empty Final,
        a choose with an error), one on a worker is aborted there (its Final follows)."""
        if job.worker is not None:
            self.transport.send_worker(job.worker.identity, P.Abort(id=job.work_id))
            return
        try:
            self.jobs.queue.remove(job)
        except ValueError:
            pass
        self._finish(job, None)
        if job.choose is not None:
            self.transport.reply_error(job.client, job.cid, P.BAD_REQUEST, "aborted by the client")
            return
        self.transport.send(
            job.client,
            P.Final(
                id=job.cid,
                token_ids=[],
                text="",
                finish_reason="abort",
                usage=P.Usage(prompt_tokens=len(job.token_ids), cached_tokens=0, completion_tokens=0),
                timings=P.Timings(queue_s=time.monotonic() - job.arrival, ttft_s=0.0, e2e_s=time.monotonic() - job.arrival),
            ),
        )
        self.metrics.count("aborted")

    def on_chunk(self, worker: WorkerState, msg: P.Chunk) -> None:
        job = self.jobs.of_attempt(worker, msg.id)
        if job is None or not job.stream:
            return
        if job.first_chunk_at is None:
            job.first_chunk_at = time.monotonic()
        job.streamed += len(msg.token_ids)
        self.metrics.count("streamed_tokens", len(msg.token_ids))
        self.transport.send(job.client, P.Chunk(id=job.cid, token_ids=msg.token_ids, text=msg.text, logprobs=msg.logprobs))

    def on_final(self, worker: WorkerState, msg: P.Final) -> None:
        job = self.jobs.of_attempt(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        ttft = (job.first_chunk_at - job.arrival) if job.first_chunk_at else waited + msg.timings.ttft_s
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=ttft, e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        count = self.metrics.count
        count("completed")
        count("aborted", msg.finish_reason == "abort")
        count("prompt_tokens", msg.usage.prompt_tokens)
        count("cached_tokens", msg.usage.cached_tokens)
        count("completion_tokens", msg.usage.completion_tokens)
        self._observe(worker, ttft, timings.e2e_s)
        self.transport.send(
            job.client,
            P.Final(
                id=job.cid,
                token_ids=msg.token_ids,
                text=msg.text,
                finish_reason=msg.finish_reason,
                usage=msg.usage,
                timings=timings,
                worker=worker.name,
                logprobs=msg.logprobs,
            ),
        )
        self.pump()

    def on_choice_final(self, worker: WorkerState, msg: P.ChoiceFinal) -> None:
        job = self.jobs.of_attempt(worker, msg.id)
        if job is None:
            return
        now = time.monotonic()
        waited = job.dispatched_at - job.arrival
        timings = P.Timings(queue_s=waited + msg.timings.queue_s, ttft_s=waited + msg.timings.ttft_s, e2e_s=now - job.arrival)
        self._finish(job, worker)
        worker.completed += 1
        self.metrics.count("completed")
        self.metrics.count("prompt_tokens", msg.usage.query_tokens)
        self.metrics.count("cached_tokens", msg.usage.cached_tokens)
        self._observe(worker, timings.ttft_s, timings.e2e_s)
        self.transport.send(
            job.client, P.ChoiceFinal(id=job.cid, best=msg.best, index=msg.index, ranked=msg.ranked, usage=msg.usage, timings=timings, worker=worker.name)
        )
        self.pump()

    def _observe(self, worker: WorkerState, ttft_s: float, e2e_s: float) -> None:
        hist = self.metrics.hist
        hist["ttft_s"].observe(ttft_s)
        hist["e2e_s"].observe(e2e_s)
        worker.ttft.observe(ttft_s)

    def on_worker_error(self, worker: WorkerState, msg: P.Error) -> None:
        job = self.jobs.of_attempt(worker, msg.id)
        if job is None:
            return
        self._finish(job, worker, keep_job=True)
        if not (msg.code == P.SHUTTING_DOWN and self._restart(job)):
            self._answer(job, msg.code, msg.message)
        self.pump()

    # -- shutting down -------------------------------------------------------------------------
    def fail_in_flight(self, code: str, message: str) -> None:
        """Answer every job on a worker with an error and forget it."""
        for job in list(self.jobs.works.values()):
            self._finish(job, job.worker)
            self.transport.reply_error(job.client, job.cid, code, message)

    def fail_all(self, code: str, message: str) -> None:
        """Answer every job the router holds (on a worker or queued) with an error, once each."""
        for job in self.jobs.take_all():
            self.transport.reply_error(job.client, job.cid, code, message)
