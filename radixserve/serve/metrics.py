"""Counters and histograms for the router and workers, as JSON and Prometheus text."""

from __future__ import annotations

import bisect
import json
import math
import time
from typing import Any

# Seconds: 1 ms .. 60 s, roughly x2 per bucket.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEPTH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    """Fixed-bucket histogram (Prometheus-style cumulative ``le`` buckets on export)."""

    def __init__(self, buckets=LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (NaN when empty)."""
        if not self.count:
            return math.nan
        rank, seen = q * self.count, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return self.buckets[i] if i < len(self.buckets) else math.inf
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count, "sum": round(self.sum, 6),
            "p50": _num(self.quantile(0.5)), "p99": _num(self.quantile(0.99)),
            "buckets": {str(b): c for b, c in zip(self.buckets, self.counts)} | {"+Inf": self.counts[-1]},
        }


def _num(x: float) -> float | None:
    return None if math.isnan(x) else (x if math.isfinite(x) else 1e308)


def prometheus_text(stats: dict[str, Any]) -> str:
    """Prometheus text exposition of a ``radixserve stats`` document (router + workers).

    Uses prometheus-client's exposition when it is installed, else writes the same format here.
    """
    families: list[tuple[str, str, list[tuple[dict, float]], dict | None]] = []  # name, type, samples, hist

    def add(name, kind, value, labels=None):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        families.append((name, kind, [(labels or {}, float(value))], None))

    router = stats.get("router", {})
    for key, value in router.get("counters", {}).items():
        add(f"radixserve_router_{key}_total", "counter", value)
    for key, value in router.get("gauges", {}).items():
        add(f"radixserve_router_{key}", "gauge", value)
    for key, h in router.get("histograms", {}).items():
        families.append((f"radixserve_router_{key}", "histogram", [], h))
    for wid, w in stats.get("workers", {}).items():
        labels = {"worker": wid}
        for key, value in w.get("engine", {}).items():
            kind = "gauge" if key in _ENGINE_GAUGES else "counter"
            add(f"radixserve_worker_{key}" + ("_total" if kind == "counter" else ""), kind, value, labels)
        for key in ("inflight", "alive"):
            add(f"radixserve_worker_{key}", "gauge", w.get(key), labels)
        add("radixserve_worker_index_tokens", "gauge", w.get("index_tokens"), labels)
        for key, h in w.get("histograms", {}).items():
            families.append((f"radixserve_worker_{key}", "histogram", [], h | {"_labels": labels}))

    try:
        return _with_prometheus_client(families)
    except ImportError:
        pass
    lines: list[str] = []
    declared: set[str] = set()
    for name, kind, samples, hist in families:
        if name not in declared:
            lines.append(f"# TYPE {name} {kind}")
            declared.add(name)
        if hist is None:
            for labels, value in samples:
                lines.append(f"{name}{_labels(labels)} {value!r}")
            continue
        labels = hist.get("_labels", {})
        cum = 0
        for le, c in hist["buckets"].items():
            cum += c
            lines.append(f"{name}_bucket{_labels(labels | {'le': le})} {cum}")
        lines.append(f"{name}_count{_labels(labels)} {hist['count']}")
        lines.append(f"{name}_sum{_labels(labels)} {hist['sum']}")
    return "\n".join(lines) + "\n"


_ENGINE_GAUGES = {"running", "waiting", "kv_total_tokens", "kv_used_tokens", "kv_evictable_tokens",
                  "kv_locked_tokens", "kv_pinned_tokens"}


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _with_prometheus_client(families) -> str:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class _Collector:
        def collect(self):
            merged: dict[str, Any] = {}
            kinds: dict[str, str] = {}
            for name, kind, samples, hist in families:
                if kinds.setdefault(name, kind) != kind:
                    continue  # one name, one type (Prometheus rule): keep the first
                if hist is not None:
                    labels = hist.get("_labels", {})
                    fam = merged.get(name) or HistogramMetricFamily(name, name, labels=list(labels))
                    cum, buckets = 0, []
                    for le, c in hist["buckets"].items():
                        cum += c
                        buckets.append((le, cum))
                    fam.add_metric(list(labels.values()), buckets, hist["sum"])
                    merged[name] = fam
                    continue
                for labels, value in samples:
                    base = name.removesuffix("_total") if kind == "counter" else name
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    fam = merged.get(name) or cls(base, base, labels=list(labels))
                    fam.add_metric(list(labels.values()), value)
                    merged[name] = fam
            yield from merged.values()

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry).decode()


class MetricsLog:
    """Appends one JSON line per interval to a file (``--metrics-log``)."""

    def __init__(self, path: str):
        self.path = path

    def write(self, stats: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), **stats}, default=str) + "\n")
