"""The worker registry: who the workers are and whether they live. Registration (fingerprint
check, same-process re-register, restarts), heartbeats, draining, the liveness check that pings
workers and finds the silent ones, and declaring a worker dead, which hands back the jobs it held.
What becomes of those jobs is the dispatcher's business."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve import protocol as P
from radixserve.serve.router.index_sync import IndexSync
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Job, Metrics, RouterConfig, WorkerState

if TYPE_CHECKING:
    from radixserve.serve.supervisor import Supervisor

log = logging.getLogger("radixserve.router")


class WorkerRegistry:
    """The workers by name and by connection, their liveness and their cache-index mirrors
    (kept by :attr:`index`). Owns the local workers' :class:`Supervisor` (set by ``serve``)."""

    def __init__(self, config: RouterConfig, transport: Transport, index: IndexSync, metrics: Metrics) -> None:
        self.config = config
        self.transport = transport
        self.index = index
        self.metrics = metrics
        self.workers: dict[str, WorkerState] = {}  # name -> worker, alive or dead until forgotten
        self._by_identity: dict[bytes, WorkerState] = {}  # connection -> live worker
        self._rejoin_asked: dict[bytes, float] = {}  # unregistered connection -> when it was asked to rejoin
        self.supervisor: Supervisor | None = None  # serve's Supervisor of local worker processes (restarts them)
        self.on_ready: Callable[[int], None] | None = None  # called once with the live workers when every local one joined
        self._announced = False

    @property
    def local_procs(self) -> list[Any]:
        return self.supervisor.procs if self.supervisor is not None else []

    def of(self, identity: bytes) -> WorkerState | None:
        """The live worker on connection ``identity`` (None: not, or no longer, registered)."""
        return self._by_identity.get(identity)

    def alive(self) -> list[WorkerState]:
        """Live workers that take new requests (not draining)."""
        return [w for w in self.workers.values() if w.alive and not w.draining]

    def any_alive(self) -> bool:
        return any(w.alive for w in self.workers.values())

    def candidates(self) -> list[WorkerState]:
        """Live workers with room under ``max_inflight_per_worker``."""
        cap = self.config.max_inflight_per_worker
        return [w for w in self.alive() if len(w.inflight) < cap]

    def context(self) -> int:
        """The model's context in tokens (0 while no worker has told it)."""
        return self.config.max_model_len or max((w.info.get("max_model_len", 0) for w in self.workers.values()), default=0)

    # -- registration --------------------------------------------------------------------------
    def refuse(self, identity: bytes, worker: WorkerState | None, msg: P.Register) -> bool:
        """Refuse a worker of another model, a connection renaming itself, or a newcomer under the
        name of a live worker; True if refused."""
        want = self.config.model_fingerprint
        if want and msg.fingerprint != want:
            self.metrics.count("refused_workers")
            why = (
                f"its model fingerprint {msg.fingerprint or '(none)'} differs from the router's {want} "
                f"(config.json hash:vocabulary size); start it with the router's --model"
            )
            log.error("refused worker %s (pid %d on %s): %s", msg.worker, msg.pid, msg.host, why)
            self.transport.send_worker(identity, P.Refused(reason=why))
            return True
        if worker is not None and worker.name != msg.worker:
            self.transport.send_worker(identity, P.Refused(reason=f"this connection is worker {worker.name}; it cannot rename itself"))
            return True
        old = self.workers.get(msg.worker)
        if old is not None and old.alive and old.identity != identity and (old.proc is None or old.proc.poll() is None):
            # Another live process holds the name: handing it over would make the two take it from
            # each other for good (each declared dead in turn).
            self.metrics.count("refused_workers")
            why = (
                f"the name {msg.worker} belongs to a live worker (pid {old.pid} on {old.host or '?'}); start this one "
                f"with another --worker-id (if that worker has just died, retry after --heartbeat-timeout, "
                f"{self.config.heartbeat_timeout_s:g} s)"
            )
            log.error("refused worker %s (pid %d on %s): %s", msg.worker, msg.pid, msg.host, why)
            self.transport.send_worker(identity, P.Refused(reason=why))
            return True
        return False

    def registering_again(self, identity: bytes, msg: P.Register) -> WorkerState | None:
        """The live worker this Register comes from when it is the same process on the same
        connection registering again (it heard nothing from us for a while), else None."""
        old = self.workers.get(msg.worker)
        if old is None or not old.alive or old.identity != identity:
            return None
        return old if (old.session == msg.session if msg.session else old.pid == msg.pid) else None

    def registered_again(self, old: WorkerState, msg: P.Register) -> list[Job]:
        """The same live process registered again: we were stalled, or the network was. Not a
        restart: it keeps its state and its requests. Its snapshot follows: the index starts
        again from it (events may have been lost). Returns the jobs we think run there but it
        does not (their Work or their Final was lost with a dropped connection), each taken off
        it and its attempt aborted in case its Work is still on the way."""
        old.last_seen = time.monotonic()
        self.index.reset(old)
        self._abort_unknown(old, msg.active)
        running = set(msg.active)
        lost = sorted((j for wid, j in old.inflight.items() if wid not in running), key=lambda j: j.n, reverse=True)
        for job in lost:
            self.transport.send_worker(old.identity, P.Abort(id=job.work_id))
            del old.inflight[job.work_id]
            old.index.drop_pending(job.work_id)
        log.info("worker %s registered again (pid %d, same process); keeping its %d requests", old.name, old.pid, len(old.inflight))
        self.transport.send_worker(old.identity, P.Ping())
        return lost

    def join(self, identity: bytes, msg: P.Register) -> WorkerState:
        """A new worker (or a new process under a dead one's name): register it."""
        self._rejoin_asked.pop(identity, None)
        state = WorkerState(
            name=msg.worker,
            identity=identity,
            pid=msg.pid,
            host=msg.host,
            session=msg.session,
            info=dict(max_model_len=msg.max_model_len, kv_total_tokens=msg.kv_total_tokens, page_size=msg.page_size),
        )
        for proc in self.local_procs:  # only the process itself: not a remote worker that took a dead one's name
            if getattr(proc, "worker_name", None) == msg.worker and proc.pid == msg.pid:
                state.proc = proc
        if self.supervisor is not None:
            self.supervisor.on_registered(msg.worker, msg.pid)
        self.workers[msg.worker] = state
        self._by_identity[identity] = state
        self._abort_unknown(state, msg.active)
        self._announce_if_ready()
        log.info("worker %s joined (pid %d on %s, KV %d tokens)", msg.worker, msg.pid, msg.host, msg.kv_total_tokens)
        self.transport.send_worker(identity, P.Ping())
        return state

    def _abort_unknown(self, worker: WorkerState, active: list[str]) -> None:
        """Abort the worker's requests that we gave up (e.g. restarted elsewhere)."""
        for wid in active[:4096]:
            if wid not in worker.inflight:
                self.transport.send_worker(worker.identity, P.Abort(id=wid))

    def _announce_if_ready(self) -> None:
        """Call ``on_ready`` once, when every local worker has joined."""
        if not self._announced and self.supervisor is not None and self.on_ready is not None:
            local = self.supervisor.workers
            if all(n in self.workers and self.workers[n].alive for n in local):
                self._announced = True
                self.on_ready(len(self.alive()))

    def ask_rejoin(self, identity: bytes) -> None:
        """A message from a connection that is not (or no longer) registered, e.g. declared dead
        during a link cut: ask it to register again (at most once per heartbeat timeout per
        connection)."""
        now = time.monotonic()
        if now - self._rejoin_asked.get(identity, 0.0) > self.config.heartbeat_timeout_s:
            if len(self._rejoin_asked) > 4096:
                self._rejoin_asked.clear()
            self._rejoin_asked[identity] = now
            self.metrics.count("rejoins_asked")
            self.transport.send_worker(identity, P.Rejoin(reason="this connection is not registered"))

    # -- liveness ------------------------------------------------------------------------------
    def on_heartbeat(self, worker: WorkerState, msg: P.Heartbeat) -> None:
        worker.engine = msg.stats
        self.index.check(worker, msg)

    def on_goodbye(self, worker: WorkerState, msg: P.Goodbye) -> None:
        worker.draining = True
        log.info("worker %s is draining", worker.name)

    def declare_dead(self, worker: WorkerState, why: str, *, left: bool = False) -> list[Job]:
        """Mark a live ``worker`` dead (``left``: it said so itself, draining done): forget its
        connection and its cache mirror, kill its process if it is ours and hung. Returns the
        jobs it held, newest first, taken off it: each must be restarted or answered."""
        assert worker.alive, worker.name
        if not left:
            self.metrics.count("worker_deaths")
        worker.alive = False
        self._by_identity.pop(worker.identity, None)
        orphans = sorted(worker.inflight.values(), key=lambda j: j.n, reverse=True)
        worker.inflight.clear()
        worker.index.clear()
        worker.synced = False
        if worker.proc is not None and worker.proc.poll() is None and not left:
            worker.proc.kill()  # hung: make sure it is gone
        return orphans

    def excuse_stall(self, now: float) -> None:
        """Our own loop was stalled: the silence is ours, not the workers'. Give every worker a
        fresh window; what they sent meanwhile is still queued for us."""
        for w in self.workers.values():
            w.last_seen = max(w.last_seen, now)

    def check(self, now: float) -> list[tuple[WorkerState, str]]:
        """Ping every live worker that is fine; returns those to declare dead (silent, or their
        process exited), with why."""
        dead = []
        for w in self.workers.values():
            if not w.alive:
                continue
            if w.proc is not None and w.proc.poll() is not None:
                dead.append((w, f"its process exited with status {w.proc.returncode}"))
            elif now - w.last_seen > self.config.heartbeat_timeout_s:
                dead.append((w, f"no heartbeat for {now - w.last_seen:.1f} s"))
            else:
                self.transport.send_worker(w.identity, P.Ping())
        return dead

    def forget_dead(self, now: float) -> None:
        """Forget remote workers dead for longer than ``forget_dead_s`` (local ones are restarted)."""
        for w in [w for w in self.workers.values() if not w.alive and w.proc is None]:
            if now - w.last_seen > self.config.forget_dead_s:
                del self.workers[w.name]
