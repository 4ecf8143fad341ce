"""The worker registry and its health: registration (fingerprint check, same-process re-register,
restarts), heartbeats, draining and leaving, and the ticker that pings workers and declares the
silent ones dead."""

from __future__ import annotations

import asyncio
import logging
import time

from radixserve import protocol as P
from radixserve.serve.router.base import RouterBase
from radixserve.serve.router.state import WorkerState

log = logging.getLogger("radixserve.router")


class WorkerRegistry(RouterBase):
    """Worker registration, heartbeats and liveness."""

    def _refuse(self, identity: bytes, worker, msg: P.Register) -> bool:
        """Refuse a worker of another model, a connection renaming itself, or a newcomer under the
        name of a live worker; True if refused."""
        want = self.config.model_fingerprint
        if want and msg.fingerprint != want:
            self.counters["refused_workers"] = self.counters.get("refused_workers", 0) + 1
            why = (f"its model fingerprint {msg.fingerprint or '(none)'} differs from the router's {want} "
                   f"(config.json hash:vocabulary size); start it with the router's --model")
            log.error("refused worker %s (pid %d on %s): %s", msg.worker, msg.pid, msg.host, why)
            self._wsend(identity, P.Refused(reason=why))
            return True
        if worker is not None and worker.name != msg.worker:
            self._wsend(identity, P.Refused(reason=f"this connection is worker {worker.name}; it cannot rename itself"))
            return True
        old = self.workers.get(msg.worker)
        if old is not None and old.alive and old.identity != identity and (old.proc is None or old.proc.poll() is None):
            # Another live process holds the name: handing it over would make the two take it from
            # each other for good (each declared dead in turn).
            self.counters["refused_workers"] = self.counters.get("refused_workers", 0) + 1
            why = (f"the name {msg.worker} belongs to a live worker (pid {old.pid} on {old.host or '?'}); start this one "
                   f"with another --worker-id (if that worker has just died, retry after --heartbeat-timeout, "
                   f"{self.config.heartbeat_timeout_s:g} s)")
            log.error("refused worker %s (pid %d on %s): %s", msg.worker, msg.pid, msg.host, why)
            self._wsend(identity, P.Refused(reason=why))
            return True
        return False

    def _registered_again(self, old: WorkerState, identity: bytes, msg: P.Register) -> None:
        """The same live process registering again: it heard nothing from us for a while (we
        were stalled, or the network was). Not a restart: keep its state and its requests.
        Its snapshot follows: the index starts again from it (events may have been lost)."""
        old.last_seen = time.monotonic()
        self._reset_index(old)
        self._abort_unknown(old, msg.active)
        self._reclaim_lost(old, msg.active)
        log.info("worker %s registered again (pid %d, same process); keeping its %d requests",
                 old.name, old.pid, len(old.inflight))
        self._wsend(identity, P.Ping())

    def _announce_if_ready(self) -> None:
        """Call ``on_ready`` once, when every local worker has joined."""
        if not self._announced and self.supervisor is not None and self.on_ready is not None:
            local = self.supervisor.workers
            if all(n in self.workers and self.workers[n].alive for n in local):
                self._announced = True
                self.on_ready(len(self._alive()))

    def _on_register(self, identity: bytes, worker, msg: P.Register) -> None:
        if self._refuse(identity, worker, msg):
            return
        old = self.workers.get(msg.worker)
        same = old is not None and (old.session == msg.session if msg.session else old.pid == msg.pid)
        if old is not None and old.alive and same and old.identity == identity:
            self._registered_again(old, identity, msg)
            return
        if old is not None and old.alive:  # its process exited (_refuse let this one in)
            self._declare_dead(old, f"its process exited, and pid {msg.pid} registered under its name")
        self._rejoin_asked.pop(identity, None)
        state = WorkerState(name=msg.worker, identity=identity, pid=msg.pid, host=msg.host, session=msg.session,
                            info=dict(max_model_len=msg.max_model_len, kv_total_tokens=msg.kv_total_tokens,
                                      page_size=msg.page_size))
        for proc in self.local_procs:  # only the process itself: not a remote worker that took a dead one's name
            if getattr(proc, "worker_name", None) == msg.worker and proc.pid == msg.pid:
                state.proc = proc
        if self.supervisor is not None:
            self.supervisor.on_registered(msg.worker, msg.pid)
        self.workers[msg.worker] = state
        self.by_identity[identity] = state
        self._abort_unknown(state, msg.active)
        self._announce_if_ready()
        log.info("worker %s joined (pid %d on %s, KV %d tokens)", msg.worker, msg.pid, msg.host, msg.kv_total_tokens)
        self._wsend(identity, P.Ping())
        self._pump()

    def _reclaim_lost(self, worker: WorkerState, active: list[str]) -> None:
        """Requests we think run on ``worker`` but it does not: their Work or their Final was
        lost with a dropped connection (messages it sent before this Register arrived before
        it). Restart them elsewhere under a new work id (or fail those that streamed), and
        abort the old attempt in case its Work is still on its way (its answer would be
        ignored anyway: the work id is no longer ours)."""
        running = set(active)
        lost = sorted((j for wid, j in worker.inflight.items() if wid not in running), key=lambda j: j.n, reverse=True)
        for job in lost:
            self._wsend(worker.identity, P.Abort(id=job.work_id))
            self._finish(job, worker, keep_job=True)
            if self._retryable(job) and not self.shutting_down:
                self._requeue(job)
            else:
                self.jobs.pop((job.client, job.cid), None)
                self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                  f"worker {worker.name} lost the request with its connection; retry the request")
        if lost:
            log.warning("worker %s re-registered without %d of its requests; restarted them", worker.name, len(lost))
            self._pump()

    def _abort_unknown(self, worker: WorkerState, active: list[str]) -> None:
        """Abort the worker's requests that we gave up (e.g. restarted elsewhere)."""
        for wid in active[:4096]:
            if wid not in worker.inflight:
                self._wsend(worker.identity, P.Abort(id=wid))

    def _on_heartbeat(self, identity: bytes, worker, msg: P.Heartbeat) -> None:
        if worker is None:  # e.g. declared dead, or the router restarted: ask it to register
            return
        worker.engine = msg.stats
        # Heartbeats follow the worker's cache events on the same ordered stream: they tell us
        # whether the last batch, or the snapshot we wait for, was lost on the way.
        if worker.synced and msg.events_seq and msg.events_seq != worker.next_seq - 1:
            self._resync(worker, f"cache events up to {msg.events_seq} sent, {worker.next_seq - 1} received")
        elif not worker.synced and msg.reset_seq > worker.resync_from:
            self._resync(worker, f"the cache snapshot {msg.reset_seq} was lost", known=msg.reset_seq)

    def _on_goodbye(self, identity: bytes, worker, msg: P.Goodbye) -> None:
        if worker is not None:
            worker.draining = True
            log.info("worker %s is draining", worker.name)

    def _on_leave(self, identity: bytes, worker, msg: P.Leave) -> None:
        if worker is None:
            return
        self.counters["workers_left"] += 1
        self._declare_dead(worker, "it left", left=True)

    async def _ticker(self) -> None:
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                self._tick(time.monotonic())
            except Exception:  # one error must not end the liveness checks and restarts for good
                self._task_failed("ticker")

    def _tick(self, now: float) -> None:
        """Every ``heartbeat_s``: restart local workers that are due, declare silent or exited
        workers dead, ping the others, forget long-dead remote ones, fail what waited too long
        for any worker."""
        cfg = self.config
        late = now - self._last_tick - cfg.heartbeat_s
        self._last_tick = now
        if late > cfg.heartbeat_s:
            # Our own loop was stalled: the silence is ours, not the workers'. Give every
            # worker a fresh window; what they sent meanwhile is still queued for us.
            log.warning("router loop stalled for %.1f s; not counting it against workers", late)
            for w in self.workers.values():
                w.last_seen = max(w.last_seen, now)
        if self.supervisor is not None:
            self.supervisor.tick(now, shutting_down=self.shutting_down)
            if self.supervisor.fatal and not any(w.alive for w in self.workers.values()):
                self.fatal = self.supervisor.fatal
                log.error("%s", self.fatal)
                self.request_shutdown()
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                self._declare_dead(w, f"its process exited with status {w.proc.returncode}")
            elif now - w.last_seen > cfg.heartbeat_timeout_s:
                self._declare_dead(w, f"no heartbeat for {now - w.last_seen:.1f} s")
            else:
                self._wsend(w.identity, P.Ping())
        for w in [w for w in self.workers.values() if not w.alive and w.proc is None]:
            if now - w.last_seen > cfg.forget_dead_s:  # remote and gone: forget it
                del self.workers[w.name]
        if self.queue and not any(w.alive for w in self.workers.values()):
            for job in [j for j in self.queue if now - j.queued_at > cfg.no_worker_wait_s]:
                self.queue.remove(job)
                self.jobs.pop((job.client, job.cid), None)
                self._reply_error(job.client, job.cid, P.WORKER_LOST,
                                  f"no worker joined within {cfg.no_worker_wait_s:.0f} s")
