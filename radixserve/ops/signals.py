"""Saturation signals and their remedies, from windows of the router's stats (pure functions).

A :class:`Window` is what happened between two ``radixserve stats`` documents (a live poll in
``radixserve top`` or two lines of ``--metrics-log`` in ``radixserve report``): TTFT quantiles of
the requests that finished in it (from the difference of the cumulative histograms), queue depth,
running requests, tokens per second overall and per stream, KV occupancy, prefix hit rate and
preemptions, for the fleet and for each worker.

:func:`saturation_signals` names the four signs that a fleet is running out of capacity, and
:func:`remedies` lists what to do about them, cheapest first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Window:
    """Fleet (or one worker's) figures over ``dt_s`` seconds ending at ``t`` (unix seconds).

    ``None`` means "not measurable in this window" (no request finished, nothing ran)."""

    t: float
    dt_s: float
    completed: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    queue_depth: int = 0  # requests queued in the router, at the end of the window
    waiting: int = 0  # requests admitted to an engine but not yet running
    inflight: int = 0
    running: int = 0
    tokens: int = 0  # tokens generated in the window
    tokens_per_s: float = 0.0
    per_stream_tok_s: float | None = None  # tokens_per_s / mean running requests
    kv_total_tokens: int = 0
    kv_used_tokens: int = 0
    kv_evictable_tokens: int = 0
    kv_locked_tokens: int = 0
    hit_rate: float | None = None  # prefix hit tokens / query tokens in the window
    preemptions: int = 0
    workers_alive: int = 0
    inflight_cap: int = 0  # the router's --max-inflight x live workers (0: unknown)
    workers: dict[str, Window] = field(default_factory=dict)

    @property
    def kv_pressure(self) -> float | None:
        """Share of the KV pool that cannot be evicted (running requests' and locked prefixes')."""
        if not self.kv_total_tokens:
            return None
        return (self.kv_used_tokens - self.kv_evictable_tokens) / self.kv_total_tokens

    @property
    def queued(self) -> int:
        """Requests waiting anywhere: the router's queue plus the engines' waiting lists."""
        return self.queue_depth + self.waiting

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["queued"] = self.queued
        d["kv_pressure"] = self.kv_pressure
        d["workers"] = {k: w.to_dict() for k, w in self.workers.items()}
        return d


def hist_delta_quantile(cur: dict | None, prev: dict | None, q: float) -> float | None:
    """The q-quantile of the observations added between two histogram dicts (``to_dict`` form),
    interpolated linearly inside the bucket (as Prometheus' ``histogram_quantile``); None if none."""
    if not cur or "buckets" not in cur:
        return None
    prev_b = (prev or {}).get("buckets", {})
    bounds, counts = [], []
    for le, c in cur["buckets"].items():
        bounds.append(math.inf if le == "+Inf" else float(le))
        counts.append(max(0, c - prev_b.get(le, 0)))
    if sum(counts) == 0 and prev_b and sum(cur["buckets"].values()) < sum(prev_b.values()):
        counts = list(cur["buckets"].values())  # the source restarted: its counts began again
    total = sum(counts)
    if total == 0:
        return None
    rank, seen, lower = q * total, 0, 0.0
    for bound, c in zip(bounds, counts):
        if c and seen + c >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: report its bound
            return lower + (bound - lower) * (rank - seen) / c
        seen += c
        if not math.isinf(bound):
            lower = bound
    return lower


def _delta(cur: dict, prev: dict, key: str) -> int:
    a, b = cur.get(key, 0) or 0, prev.get(key, 0) or 0
    return a - b if a >= b else a  # a counter that went down was reset (worker restart)


def _engine_window(t: float, dt: float, eng: dict, prev_eng: dict, ttft: dict | None, prev_ttft: dict | None, inflight: int, queue_depth: int = 0) -> Window:
    tokens = _delta(eng, prev_eng, "generated_tokens")
    running = eng.get("running", 0)
    mean_running = (running + prev_eng.get("running", running)) / 2
    q, h = _delta(eng, prev_eng, "prefix_query_tokens"), _delta(eng, prev_eng, "prefix_hit_tokens")
    tps = tokens / dt if dt > 0 else 0.0
    completed = 0
    if ttft and "count" in ttft:
        completed = max(0, ttft["count"] - (prev_ttft or {}).get("count", 0))
    return Window(
        t=t,
        dt_s=dt,
        completed=completed,
        ttft_p50_s=hist_delta_quantile(ttft, prev_ttft, 0.5),
        ttft_p99_s=hist_delta_quantile(ttft, prev_ttft, 0.99),
        queue_depth=queue_depth,
        waiting=eng.get("waiting", 0),
        inflight=inflight,
        running=running,
        tokens=tokens,
        tokens_per_s=tps,
        per_stream_tok_s=(tps / mean_running) if mean_running > 0 and tokens > 0 else None,
        kv_total_tokens=eng.get("kv_total_tokens", 0),
        kv_used_tokens=eng.get("kv_used_tokens", 0),
        kv_evictable_tokens=eng.get("kv_evictable_tokens", 0),
        kv_locked_tokens=eng.get("kv_locked_tokens", 0),
        hit_rate=(h / q) if q > 0 else None,
        preemptions=_delta(eng, prev_eng, "preemptions"),
    )


def window_of(cur: dict, prev: dict | None, t: float, dt: float) -> Window:
    """The :class:`Window` between two ``stats`` documents taken ``dt`` seconds apart.

    With ``prev`` None the counters count from the server's start (``dt`` should then be its uptime)."""
    prev = prev or {}
    router, prev_router = cur.get("router", {}), prev.get("router", {})
    workers: dict[str, Window] = {}
    fleet_eng: dict[str, int] = {}
    fleet_prev: dict[str, int] = {}
    for name, w in sorted(cur.get("workers", {}).items()):
        if not w.get("alive", True):
            continue
        pw = prev.get("workers", {}).get(name, {})
        eng, peng = w.get("engine", {}), pw.get("engine", {})
        workers[name] = _engine_window(
            t, dt, eng, peng, w.get("histograms", {}).get("router_ttft_s"), pw.get("histograms", {}).get("router_ttft_s"), w.get("inflight", 0)
        )
        for key in ("generated_tokens", "prefix_query_tokens", "prefix_hit_tokens", "preemptions"):
            # per worker first, so one worker's restart does not make the fleet's delta negative
            fleet_prev[key] = fleet_prev.get(key, 0)
            fleet_eng[key] = fleet_eng.get(key, 0) + _delta(eng, peng, key)
        for key in ("running", "waiting", "kv_total_tokens", "kv_used_tokens", "kv_evictable_tokens", "kv_locked_tokens"):
            fleet_eng[key] = fleet_eng.get(key, 0) + eng.get(key, 0)
            fleet_prev[key] = fleet_prev.get(key, 0) + peng.get(key, eng.get(key, 0))
    hists, prev_hists = router.get("histograms", {}), prev_router.get("histograms", {})
    gauges = router.get("gauges", {})
    fleet = _engine_window(t, dt, fleet_eng, fleet_prev, hists.get("ttft_s"), prev_hists.get("ttft_s"), gauges.get("inflight", 0), gauges.get("queue_depth", 0))
    return Window(
        **{**asdict(fleet), "workers": workers, "workers_alive": len(workers), "inflight_cap": gauges.get("max_inflight_per_worker", 0) * len(workers)}
    )


# ---------------------------------------------------------------------------------- signals
@dataclass(frozen=True)
class Thresholds:
    ttft_slow_s: float = 1.0  # p50 TTFT at or above this is "seconds": users notice
    ttft_rise_factor: float = 5.0  # ... or half of it, and this many times the best window
    queue_windows: int = 3  # the queue must stay above 0 this many windows in a row
    sag_fraction: float = 0.5  # per-stream tok/s at or below this fraction of its best ...
    recent_windows: int = 3  # windows that count as "now"


@dataclass(frozen=True)
class Signal:
    name: str  # ttft_rising | queue_persistent | per_stream_sagging | preemption
    on: bool
    title: str
    evidence: str


@dataclass(frozen=True)
class Remedy:
    rank: int  # 1 is the cheapest
    action: str
    how: str
    addresses: tuple[str, ...]


def _ms(x: float | None) -> str:
    return "n/a" if x is None else (f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s")


def saturation_signals(windows: Sequence[Window], th: Thresholds = Thresholds()) -> list[Signal]:
    """The four saturation signals over ``windows`` (oldest first), each on or off with evidence."""
    recent = list(windows[-th.recent_windows :])
    out = []

    ttfts = [w.ttft_p50_s for w in windows if w.ttft_p50_s is not None]
    now_ttft = statistics.median([w.ttft_p50_s for w in recent if w.ttft_p50_s is not None] or [math.nan])
    best = min(ttfts) if ttfts else None
    on = not math.isnan(now_ttft) and (
        now_ttft >= th.ttft_slow_s or (now_ttft >= th.ttft_slow_s / 2 and best is not None and now_ttft >= th.ttft_rise_factor * best)
    )
    out.append(
        Signal(
            "ttft_rising",
            on,
            "TTFT rising from milliseconds to seconds",
            f"p50 TTFT {_ms(None if math.isnan(now_ttft) else now_ttft)} now, best window {_ms(best)} (on at >= {_ms(th.ttft_slow_s)})",
        )
    )

    tail = list(windows[-th.queue_windows :])
    above = sum(w.queued > 0 for w in tail)
    out.append(
        Signal(
            "queue_persistent",
            bool(tail) and above == len(tail),
            "queue depth staying above 0",
            f"requests queued (router + engines) above 0 in {above} of the last {len(tail)} windows; now {tail[-1].queued if tail else 0}",
        )
    )

    streams = [(s, w.running) for w in windows if (s := w.per_stream_tok_s) is not None]
    now = [(s, w.running) for w in recent if (s := w.per_stream_tok_s) is not None]
    on, evidence = False, "not enough windows with decoding to compare"
    if streams and now:
        peak, peak_running = max(streams)
        rate, running = now[-1]
        on = rate <= th.sag_fraction * peak and running > peak_running
        evidence = (
            f"{rate:.1f} tok/s per stream at {running} running, best "
            f"{peak:.1f} tok/s at {peak_running} running (on at <= {th.sag_fraction:.0%} of best with a fuller batch)"
        )
    out.append(Signal("per_stream_sagging", on, "per-stream tok/s sagging as the batch fills", evidence))

    pre = sum(w.preemptions for w in recent)
    out.append(Signal("preemption", pre > 0, "preemption / recompute (KV ran out)", f"{pre} preemptions in the last {len(recent)} windows"))
    return out


KV_FULL = 0.8  # KV pressure at which quantizing the cache is worth it
KV_IDLE = 0.5  # ... and below which a full in-flight cap, not memory, is what queues requests

RAISE_CAP = Remedy(
    0,
    "use the idle KV first",
    "every worker is at the router's --max-inflight while most of the KV "
    "pool is free: raise --max-inflight (and the engine's --max-running) before buying anything",
    ("queue_persistent", "ttft_rising"),
)
REMEDIES = (
    Remedy(
        1,
        "bound context",
        "cap max_tokens and prompt length (max_model_len, shorter histories, summarised old turns): each token of context costs KV and attention time",
        ("ttft_rising", "queue_persistent", "per_stream_sagging", "preemption"),
    ),
    Remedy(
        2,
        "quantize the KV cache",
        "--kv-dtype int8: int8 K/V plus a float32 scale per token and head, "
        "about half the bytes per token of bf16, so about twice the tokens fit (see radixserve plan); check "
        "quality first: it changes greedy text on real models (python -m bench kv_quant)",
        ("queue_persistent", "preemption"),
    ),
    Remedy(
        3,
        "add workers / GPUs",
        "radixserve worker --router ADDR on another GPU or host; the router spreads load and keeps prefixes together",
        ("ttft_rising", "queue_persistent", "per_stream_sagging", "preemption"),
    ),
)


def remedies(signals: Sequence[Signal], latest: Window | None = None) -> list[Remedy]:
    """Remedies for the signals that are on, cheapest first (empty when none is on).

    With the ``latest`` window the KV state refines the list: quantizing the cache is offered only
    when KV is short (preemptions, or pressure >= ``KV_FULL``), and a queue in front of a full
    in-flight cap with mostly free KV first gets "raise the cap"."""
    on = {s.name for s in signals if s.on}
    out = [r for r in REMEDIES if on & set(r.addresses)]
    pressure = latest.kv_pressure if latest is not None else None
    if pressure is not None and "preemption" not in on and pressure < KV_FULL:
        out = [r for r in out if r.rank != 2]
    if (
        latest is not None
        and on & set(RAISE_CAP.addresses)
        and pressure is not None
        and pressure < KV_IDLE
        and latest.inflight_cap
        and latest.inflight >= latest.inflight_cap
    ):
        out.insert(0, RAISE_CAP)
    return out
