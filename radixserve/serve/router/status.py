"""The router's health answer and its stats document (counters, gauges, histograms, and every
worker's state), also written to the metrics log and served to ``/metrics``."""

from __future__ import annotations

import os
import time
from typing import Any

from radixserve import protocol as P
from radixserve.errors import RadixServeError
from radixserve.serve.router.dispatch import Dispatcher
from radixserve.serve.router.front import ClientFront
from radixserve.serve.router.jobs import JobTable
from radixserve.serve.router.registry import WorkerRegistry
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Metrics, RouterConfig


class RouterStatus:
    """Reads the other components (changes none of them) to answer Health and Stats."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        registry: WorkerRegistry,
        jobs: JobTable,
        dispatcher: Dispatcher,
        front: ClientFront,
        transport: Transport,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.jobs = jobs
        self.dispatcher = dispatcher
        self.front = front
        self.transport = transport
        self.metrics = metrics
        self.started = time.monotonic()

    def on_health(self, identity: bytes, msg: P.Health) -> None:
        alive = len(self.registry.alive())
        status = "shutting_down" if self.dispatcher.shutting_down else ("ok" if alive else "degraded")
        self.transport.send(identity, P.HealthReply(id=msg.id, status=status, workers=len(self.registry.workers), workers_alive=alive))

    def on_stats(self, identity: bytes, msg: P.Stats) -> None:
        try:
            _, namespace = self.front.authorize(identity, msg)
            if msg.namespace is not None and len(msg.namespace) > self.config.limits.max_namespace_chars:
                raise P.BadRequestError("namespace", f"must be at most {self.config.limits.max_namespace_chars} characters")
        except RadixServeError as exc:
            self.transport.reply_error(identity, msg.id, exc.code, str(exc))
            return
        probe = None
        if msg.probe is not None:
            # a text probe is tokenized on the loop: only its first 65536 characters (milliseconds)
            tok = self.front.tokenizer
            text = msg.probe[: min(self.front.prompt_char_limit(), 65536)] if isinstance(msg.probe, str) else ""
            ids = msg.probe if isinstance(msg.probe, list) else (tok.encode(text) if tok else [])
            ids = ids[: self.config.limits.max_probe_tokens]
            probe = {w.name: w.index.tree.peek(ids, namespace) for w in self.registry.workers.values()}
        self.transport.send(identity, P.StatsReply(id=msg.id, stats=self.document(probe)))

    def document(self, probe: dict[str, int] | None = None) -> dict[str, Any]:
        now = time.monotonic()
        supervised = self.registry.supervisor.workers if self.registry.supervisor is not None else {}
        workers = {}
        for w in self.registry.workers.values():
            engine = {k: v for k, v in w.engine.items() if not isinstance(v, dict)}
            hists = {k: v for k, v in w.engine.items() if isinstance(v, dict)}
            hists["router_ttft_s"] = w.ttft.to_dict()
            workers[w.name] = {
                "alive": w.alive,
                "draining": w.draining,
                "pid": w.pid,
                "host": w.host,
                "inflight": len(w.inflight),
                "routed": w.routed,
                "completed": w.completed,
                "index_tokens": w.index.tokens,
                "index_synced": w.synced,
                "last_seen_s": round(now - w.last_seen, 3),
                **w.info,
                "engine": engine,
                "histograms": hists,
                **({"restarts": supervised[w.name].restarts} if w.name in supervised else {}),
            }
        cfg, transport = self.config, self.transport
        out = {
            "router": {
                "address": transport.address,
                "worker_address": transport.worker_address,
                "policy": self.dispatcher.policy.name,
                "uptime_s": round(now - self.started, 3),
                "pid": os.getpid(),
                "counters": dict(self.metrics.counters),
                "gauges": {
                    "queue_depth": len(self.jobs.queue),
                    "inflight": len(self.jobs.works),
                    "workers": len(self.registry.workers),
                    "workers_alive": len(self.registry.alive()),
                    "clients": transport.clients,
                    "max_clients": transport.max_clients,
                    "max_queue": cfg.max_queue,
                    "max_inflight_per_worker": cfg.max_inflight_per_worker,
                    "shutting_down": int(self.dispatcher.shutting_down),
                },
                "histograms": {k: h.to_dict() for k, h in self.metrics.hist.items()},
                "max_prompt_chars": self.front.prompt_char_limit(),  # longer prompts are refused untokenized
            },
            "workers": workers,
        }
        if probe is not None:
            out["probe"] = probe
        return out
