"""Metrics of the router, workers and HTTP gateway, all through prometheus-client.

- :class:`Histogram`: a prometheus-client histogram in a server's CollectorRegistry, with the dict
  view the stats document carries (``count``, ``sum``, ``p50``, ``p99`` and per-bucket counts;
  what ``--metrics-log`` writes and :mod:`radixserve.ops` reads).
- :func:`prometheus_text`: Prometheus text of a ``radixserve stats`` document (router + workers,
  as received over ZMQ), through a collector of metric families and ``generate_latest``.
- :class:`GatewayMetrics`: the HTTP gateway's own counter and gauge, in its own registry.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# No *_created series: the exposition before prometheus-client had none, and dashboards do not need them.
prometheus_client.disable_created_metrics()

# Seconds: 1 ms .. 60 s, roughly x2 per bucket.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEPTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    """Fixed-bucket histogram (a ``value <= le`` bucket per bound, then ``+Inf``), registered as
    ``name`` in ``registry`` (a fresh one when None)."""

    def __init__(self, buckets=LATENCY_BUCKETS_S, *, name: str = "histogram", registry: CollectorRegistry | None = None):
        self.buckets = tuple(buckets)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._h = prometheus_client.Histogram(name, name, buckets=self.buckets, registry=self.registry)

    def observe(self, value: float) -> None:
        self._h.observe(value)

    def _snapshot(self) -> tuple[list[int], int, float]:
        """Per-bucket counts (last: +Inf), the count and the sum."""
        cumulative, total = [], 0.0
        for s in next(iter(self._h.collect())).samples:
            if s.name.endswith("_bucket"):
                cumulative.append(int(s.value))
            elif s.name.endswith("_sum"):
                total = s.value
        counts = [c - p for c, p in zip(cumulative, [0] + cumulative[:-1])]
        return counts, (cumulative[-1] if cumulative else 0), total

    @property
    def count(self) -> int:
        return self._snapshot()[1]

    @property
    def sum(self) -> float:
        return self._snapshot()[2]

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (NaN when empty)."""
        return _quantile(self.buckets, *self._snapshot()[:2], q)

    def to_dict(self) -> dict[str, Any]:
        counts, count, total = self._snapshot()
        return {
            "count": count,
            "sum": round(total, 6),
            "p50": _num(_quantile(self.buckets, counts, count, 0.5)),
            "p99": _num(_quantile(self.buckets, counts, count, 0.99)),
            "buckets": {str(b): c for b, c in zip(self.buckets, counts)} | {"+Inf": counts[-1]},
        }


def _quantile(buckets: tuple, counts: list[int], count: int, q: float) -> float:
    if not count:
        return math.nan
    rank, seen = q * count, 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank and c:
            return buckets[i] if i < len(buckets) else math.inf
    return math.inf


def _num(x: float) -> float | None:
    return None if math.isnan(x) else (x if math.isfinite(x) else 1e308)


# ------------------------------------------------------------------ a stats document as Prometheus text
_ENGINE_GAUGES = {"running", "waiting", "kv_total_tokens", "kv_used_tokens", "kv_evictable_tokens", "kv_locked_tokens", "kv_pinned_tokens"}


def _families(stats: dict[str, Any]) -> list[tuple[str, str, dict, Any]]:
    """(name, kind, labels, value or histogram dict) of every metric in a stats document."""
    out: list[tuple[str, str, dict, Any]] = []

    def add(name, kind, value, labels=None):
        if kind == "histogram" or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out.append((name, kind, labels or {}, value))

    router = stats.get("router", {})
    for key, value in router.get("counters", {}).items():
        add(f"radixserve_router_{key}", "counter", value)
    for key, value in router.get("gauges", {}).items():
        add(f"radixserve_router_{key}", "gauge", value)
    for key, h in router.get("histograms", {}).items():
        add(f"radixserve_router_{key}", "histogram", h)
    for wid, w in stats.get("workers", {}).items():
        labels = {"worker": wid}
        for key, value in w.get("engine", {}).items():
            add(f"radixserve_worker_{key}", "gauge" if key in _ENGINE_GAUGES else "counter", value, labels)
        for key in ("inflight", "alive", "index_tokens"):
            add(f"radixserve_worker_{key}", "gauge", w.get(key), labels)
        for key, h in w.get("histograms", {}).items():
            add(f"radixserve_worker_{key}", "histogram", h, labels)
    return out


_FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


class _StatsCollector:
    """A prometheus-client collector of one stats document's metric families."""

    def __init__(self, stats: dict[str, Any]):
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        merged: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for name, kind, labels, value in _families(self.stats):
            key = name + "_total" if kind == "counter" else name  # the name as exposed
            if kinds.setdefault(key, kind) != kind:
                continue  # one name, one type (Prometheus rule): keep the first
            fam = merged.get(key) or _FAMILY[kind](name, name, labels=list(labels))
            merged[key] = fam
            if kind != "histogram":
                fam.add_metric(list(labels.values()), float(value))
                continue
            cum, buckets = 0, []
            for le, c in value["buckets"].items():
                cum += c
                buckets.append((le, cum))
            fam.add_metric(list(labels.values()), buckets, value["sum"])
        yield from merged.values()


def prometheus_text(stats: dict[str, Any]) -> str:
    """Prometheus text exposition of a ``radixserve stats`` document (router + workers)."""
    registry = CollectorRegistry()
    registry.register(_StatsCollector(stats))
    return generate_latest(registry).decode()


# ------------------------------------------------------------------ the HTTP gateway's own
class GatewayMetrics:
    """``radixserve_http_requests_total{route,status}`` and ``radixserve_http_inflight`` (read
    from ``inflight()`` at each scrape), in the gateway's own registry."""

    def __init__(self, inflight: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "radixserve_http_requests", "HTTP requests answered by the gateway", ["route", "status"], registry=self.registry
        )
        gauge = prometheus_client.Gauge("radixserve_http_inflight", "HTTP completion requests in progress", registry=self.registry)
        gauge.set_function(lambda: float(inflight()))

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def snapshot(self) -> dict[tuple[str, int], float]:
        """Requests answered so far by (route, status)."""
        return {(s.labels["route"], int(s.labels["status"])): s.value for s in next(iter(self.requests.collect())).samples if s.name.endswith("_total")}

    def by_route(self) -> Mapping[tuple[str, int], float]:
        """A live read-only view of :meth:`snapshot` (each lookup reads the counter)."""
        return _LiveCounts(self)

    def text(self) -> str:
        """Prometheus text of the gateway's own metrics."""
        return generate_latest(self.registry).decode()


class _LiveCounts(Mapping):
    def __init__(self, metrics: GatewayMetrics):
        self._metrics = metrics

    def __getitem__(self, key):
        return self._metrics.snapshot()[key]

    def __iter__(self):
        return iter(self._metrics.snapshot())

    def __len__(self) -> int:
        return len(self._metrics.snapshot())

    def __repr__(self) -> str:
        return repr(self._metrics.snapshot())


class MetricsLog:
    """Appends one JSON line per interval to a file (``--metrics-log``)."""

    def __init__(self, path: str):
        self.path = path

    def write(self, stats: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), **stats}, default=str) + "\n")
