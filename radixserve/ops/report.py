"""The day in review from a ``--metrics-log`` (``radixserve report``).

Each log line is a ``radixserve stats`` document with its unix ``time``; consecutive lines give
one :class:`~radixserve.ops.signals.Window` each (TTFT of the requests that finished in it, queue
depth at its end, tokens generated). The verdict reads the shape of the curves:

* **capacity** (steady rise): the rolling median of p50 TTFT climbs along a good straight-line fit
  (end at least ``rise_factor`` x start, R^2 >= ``min_r2``) and the queue is sustained: still up
  at the end, or up for ``min_busy_share`` of the active period in one stretch, or rarely drained:
  demand is above what the fleet serves.
* **bursts** (sawtooth): the queue fills and drains back to 0 at least ``min_drains`` times: a
  queue absorbs them; capacity is enough on average.
* **fine** (flat): neither.

Generation hours are the summed length of the windows in which tokens were generated; the
rent-vs-buy break-even is ``buy_price / (rent_per_hour - own_cost_per_hour)`` hours of generation.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.errors import BadRequestError
from radixserve.ops.signals import Window, window_of
from radixserve.ops.stats import linear_fit

# Typical figures: a 24 GB-class GPU rents for about $0.50-2 an hour and a used one costs a few
# hundred dollars; break-even is then around 250-1,000 hours of real generation.
DEFAULT_RENT_PER_HOUR = 1.0
DEFAULT_BUY_PRICE = 500.0
TYPICAL_RENT_RANGE = (0.5, 2.0)  # $ per hour for a 24 GB-class GPU
_MAX_LINE = 16 * 2**20


def read_metrics_log(path: str | Path) -> list[dict[str, Any]]:
    """The stats documents of a ``--metrics-log`` file, in time order (bad lines are skipped and
    counted in ``skipped`` of the first document's ``_log``)."""
    docs, skipped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if len(line) > _MAX_LINE:
                skipped += 1
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # e.g. a line cut short when the server was killed
                continue
            if isinstance(doc, dict) and isinstance(doc.get("time"), (int, float)) and "router" in doc:
                docs.append(doc)
            else:
                skipped += 1
    docs.sort(key=lambda d: d["time"])
    if docs:
        docs[0]["_log"] = {"skipped": skipped}
    return docs


def windows_of(docs: Sequence[dict[str, Any]]) -> list[Window]:
    """One window per pair of consecutive log lines. A router restart (uptime going down) starts
    the counters again, so that pair counts from zero."""
    out = []
    for prev, cur in zip(docs, docs[1:]):
        restarted = cur["router"].get("uptime_s", 0) < prev["router"].get("uptime_s", 0)
        dt = cur["router"].get("uptime_s", 0) if restarted else cur["time"] - prev["time"]
        out.append(window_of(cur, None if restarted else prev, cur["time"], max(dt, 1e-9)))
    return out


@dataclass(frozen=True)
class VerdictRules:
    rolling: int = 5  # windows in the rolling median of p50 TTFT
    rise_factor: float = 2.0
    min_r2: float = 0.5
    min_drains: int = 2
    min_busy_share: float = 0.3  # a queue that stays up this share of the active period is not a burst


def drain_cycles(queued: Sequence[int]) -> int:
    """Times the queue went from above 0 back to 0."""
    return sum(1 for a, b in zip(queued, queued[1:]) if a > 0 and b == 0)


def _longest_run(queued: Sequence[int]) -> int:
    best = run = 0
    for q in queued:
        run = run + 1 if q > 0 else 0
        best = max(best, run)
    return best


def verdict(windows: Sequence[Window], rules: VerdictRules = VerdictRules()) -> dict[str, Any]:
    """``{"verdict": capacity|bursts|fine|no data, "reason": ..., "evidence": {...}}``."""
    points = [(w.t, w.ttft_p50_s) for w in windows if w.ttft_p50_s is not None]
    queued = [w.queued for w in windows]
    ev: dict[str, Any] = {
        "windows": len(windows),
        "windows_with_ttft": len(points),
        "drain_cycles": drain_cycles(queued),
        "max_queued": max(queued, default=0),
        "share_windows_queued": (sum(q > 0 for q in queued) / len(queued)) if queued else 0.0,
    }
    if len(points) < 3:
        return {"verdict": "no data", "reason": f"only {len(points)} windows with finished requests (need 3)", "evidence": ev}
    k = max(1, min(rules.rolling, len(points) // 3))
    ts = [t for t, _ in points]
    rolled = [statistics.median(y for _, y in points[max(0, i - k + 1) : i + 1]) for i in range(len(points))]
    hours = [(t - ts[0]) / 3600 for t in ts]
    slope, icpt, r2 = linear_fit(hours, rolled)
    start, end = icpt, icpt + slope * hours[-1]
    ev.update(
        {
            "rolling_windows": k,
            "fit_t0": ts[0],
            "fit_t1": ts[-1],
            "ttft_p50_slope_s_per_hour": slope,
            "ttft_fit_r2": r2,
            "ttft_fit_start_s": start,
            "ttft_fit_end_s": end,
            "ttft_p50_first_s": rolled[0],
            "ttft_p50_last_s": rolled[-1],
            "queued_at_end": queued[-1] if queued else 0,
        }
    )
    # the active part: from the first to the last window that generated tokens (idle hours don't dilute it)
    active = [i for i, w in enumerate(windows) if w.tokens > 0] or [0, len(windows) - 1]
    span = queued[active[0] : active[-1] + 1]
    longest = _longest_run(span)
    peak = max(y for _, y in points)
    ev.update({"ttft_p50_peak_s": peak, "longest_queued_windows": longest, "longest_queued_share_of_active": longest / len(span)})
    rising = slope > 0 and r2 >= rules.min_r2 and end >= rules.rise_factor * max(start, 1e-3) and rolled[-1] >= rules.rise_factor * max(rolled[0], 1e-3)
    sustained = queued[-1] > 0 or ev["drain_cycles"] < rules.min_drains or ev["longest_queued_share_of_active"] >= rules.min_busy_share
    if rising and sustained:
        return {
            "verdict": "capacity",
            "evidence": ev,
            "reason": (
                f"steady rise: rolling p50 TTFT {rolled[0]:.3f} s -> {rolled[-1]:.3f} s, fit "
                f"{slope:+.3f} s/hour (R^2 {r2:.2f}); the queue stayed above 0 for {longest} windows in a row "
                f"({ev['longest_queued_share_of_active']:.0%} of the active period) and drained "
                f"{ev['drain_cycles']} times: demand is above capacity; bound context, quantize the KV "
                "cache, or add workers"
            ),
        }
    if ev["drain_cycles"] >= rules.min_drains:
        return {
            "verdict": "bursts",
            "evidence": ev,
            "reason": (
                f"sawtooth: the queue filled and drained to 0 {ev['drain_cycles']} times "
                f"(peak {ev['max_queued']} queued) with no sustained TTFT rise (R^2 {r2:.2f}): "
                "bursts that the queue absorbs; capacity is enough on average"
                + (
                    f"; but p50 TTFT peaks at {peak:.1f} s in them: if users cannot wait that long, size for the peaks (bound context, add workers)"
                    if peak >= 1.0
                    else ""
                )
            ),
        }
    return {
        "verdict": "fine",
        "evidence": ev,
        # the measured medians, not the fit's ends: a poor fit's intercept can be below 0 s
        "reason": (
            f"flat: rolling p50 TTFT {rolled[0]:.3f} s -> {rolled[-1]:.3f} s, fit {slope:+.3f} s/hour "
            f"(R^2 {r2:.2f}), queue drained "
            f"{ev['drain_cycles']} times, peak {ev['max_queued']} queued"
        ),
    }


def rent_vs_buy(generation_hours: float, period_hours: float, rent_per_hour: float, buy_price: float, own_cost_per_hour: float = 0.0) -> dict[str, Any]:
    """Break-even hours of generation, and how long that takes at the observed rate."""
    if rent_per_hour <= 0 or buy_price <= 0 or own_cost_per_hour < 0:
        raise BadRequestError("rent_per_hour" if rent_per_hour <= 0 else "buy_price" if buy_price <= 0 else "own_cost_per_hour", "must be > 0 (own cost >= 0)")
    saving = rent_per_hour - own_cost_per_hour
    breakeven = buy_price / saving if saving > 0 else None
    per_week = generation_hours / period_hours * 168 if period_hours > 0 else 0.0
    lo, hi = (buy_price / (r - own_cost_per_hour) if r > own_cost_per_hour else None for r in TYPICAL_RENT_RANGE[::-1])
    return {
        "rent_per_hour": rent_per_hour,
        "buy_price": buy_price,
        "own_cost_per_hour": own_cost_per_hour,
        "breakeven_generation_hours": breakeven,
        "breakeven_range_hours_at_typical_rents": [lo, hi],
        "typical_rent_range_per_hour": list(TYPICAL_RENT_RANGE),
        "generation_hours_per_week": per_week,
        "weeks_to_breakeven": (breakeven / per_week) if breakeven and per_week > 0 else None,
        "rent_cost_of_period": generation_hours * rent_per_hour,
    }


def report(
    docs: Sequence[dict[str, Any]],
    *,
    rent_per_hour: float = DEFAULT_RENT_PER_HOUR,
    buy_price: float = DEFAULT_BUY_PRICE,
    own_cost_per_hour: float = 0.0,
    rules: VerdictRules = VerdictRules(),
) -> dict[str, Any]:
    if len(docs) < 2:
        raise BadRequestError("metrics log", f"has {len(docs)} usable lines; need at least 2 (one window)")
    ws = windows_of(docs)
    gen_s = sum(w.dt_s for w in ws if w.tokens > 0)
    period_s = docs[-1]["time"] - docs[0]["time"]
    tokens = sum(w.tokens for w in ws)
    return {
        "period": {
            "start": docs[0]["time"],
            "end": docs[-1]["time"],
            "hours": period_s / 3600,
            "lines": len(docs),
            "skipped_lines": docs[0].get("_log", {}).get("skipped", 0),
        },
        "generation": {
            "hours": gen_s / 3600,
            "share_of_period": gen_s / period_s if period_s > 0 else 0.0,
            "tokens": tokens,
            "tokens_per_s_while_generating": tokens / gen_s if gen_s else 0.0,
            "completed": sum(w.completed for w in ws),
            "preemptions": sum(w.preemptions for w in ws),
        },
        "verdict": verdict(ws, rules),
        "rent_vs_buy": rent_vs_buy(gen_s / 3600, period_s / 3600, rent_per_hour, buy_price, own_cost_per_hour),
        "series": [{"t": w.t, "ttft_p50_s": w.ttft_p50_s, "ttft_p99_s": w.ttft_p99_s, "queued": w.queued, "tokens_per_s": w.tokens_per_s} for w in ws],
    }


def plot(rep: dict[str, Any], path: str | Path) -> Path:
    """TTFT p50/p99 and queue depth over the period, to a PNG (matplotlib, Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadRequestError("plot", "needs matplotlib: pip install 'radixserve[bench]' (or pass --no-plot)") from None
    s = rep["series"]
    t0 = rep["period"]["start"]
    hours = [(p["t"] - t0) / 3600 for p in s]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        pts = [(h, p[key]) for h, p in zip(hours, s) if p[key] is not None]
        if pts:
            ax1.plot(*zip(*pts), marker=".", label=f"TTFT {label}")
    ev = rep["verdict"]["evidence"]
    if "ttft_fit_start_s" in ev:
        ax1.plot(
            [(ev["fit_t0"] - t0) / 3600, (ev["fit_t1"] - t0) / 3600], [ev["ttft_fit_start_s"], ev["ttft_fit_end_s"]], "k--", lw=1, label="fit of rolling p50"
        )
    ax1.set_ylabel("TTFT (s)")
    ax1.legend(loc="upper left")
    ax1.set_title(f"verdict: {rep['verdict']['verdict']}")
    ax2.step(hours, [p["queued"] for p in s], where="post", color="tab:red")
    ax2.set_ylabel("queued requests")
    ax2.set_xlabel("hours since the first log line")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def format_report(rep: dict[str, Any]) -> str:
    p, g, v, rb = rep["period"], rep["generation"], rep["verdict"], rep["rent_vs_buy"]
    lo, hi = rb["breakeven_range_hours_at_typical_rents"]
    be = rb["breakeven_generation_hours"]
    wk = rb["weeks_to_breakeven"]
    lines = [
        f"period      {p['hours']:.3f} h ({p['lines']} log lines" + (f", {p['skipped_lines']} unreadable lines skipped" if p["skipped_lines"] else "") + ")",
        f"generation  {g['hours']:.3f} h with tokens generated ({g['share_of_period']:.0%} of the period); "
        f"{g['tokens']:,} tokens, {g['tokens_per_s_while_generating']:.1f} tok/s while generating; "
        f"{g['completed']:,} requests finished, {g['preemptions']} preemptions",
        f"verdict     {v['verdict'].upper()}: {v['reason']}",
        f"rent/buy    break-even after {be:,.0f} h of generation at ${rb['rent_per_hour']:.2f}/h vs ${rb['buy_price']:,.0f} to buy"
        if be
        else f"rent/buy    renting at ${rb['rent_per_hour']:.2f}/h never costs more than owning at ${rb['own_cost_per_hour']:.2f}/h",
        (f"            at this log's rate ({rb['generation_hours_per_week']:.1f} h of generation a week): " + (f"{wk:,.1f} weeks" if wk else "never")),
        (
            f"            at a 24 GB-class GPU's typical rents ${TYPICAL_RENT_RANGE[1]:.2f}-{TYPICAL_RENT_RANGE[0]:.2f}/h: "
            + " to ".join(f"{h:,.0f} h" if h else "never" for h in (lo, hi))
        ),
    ]
    return "\n".join(lines)
