"""``radixserve top ADDR``: a live view of a running fleet, with its saturation signals.

Polls the router's ``stats`` through the SDK every ``interval`` seconds; each poll and the one
before it make a :class:`~radixserve.ops.signals.Window` (TTFT quantiles of the requests that
finished in between, rates, KV, hit rate, preemptions), drawn with rich for the fleet and per
worker, followed by the signals that are on and the remedies, cheapest first.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from radixserve.ops.signals import Signal, Thresholds, Window, remedies, saturation_signals, window_of

HISTORY = 120  # windows kept for the signals (the rising / sagging comparisons look back this far)
PIPE_WIDTH = 1000  # columns of the virtual console off a terminal: lines are never wrapped there


def _ms(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s")


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def snapshot(window: Window, history: list[Window], address: str, th: Thresholds = Thresholds()) -> dict[str, Any]:
    """What one frame shows, as a JSON-able dict (``--json``)."""
    signals = saturation_signals(history, th)
    return {
        "address": address,
        "time": window.t,
        "window": window.to_dict(),
        "signals": [asdict(s) for s in signals],
        "signals_on": [s.name for s in signals if s.on],
        "remedies": [asdict(r) for r in remedies(signals, window)],
    }


def render(window: Window, signals: list[Signal], address: str):
    """A rich renderable of one frame."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    load = Table(
        title=f"radixserve top  {address}  (window {window.dt_s:.1f} s)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption=(f"{window.workers_alive} worker(s) alive; queued = router queue ({window.queue_depth}) + engines' waiting"),
        caption_justify="left",
    )
    for col in ("", "TTFT p50", "TTFT p99", "done", "queued", "run", "tok/s", "per stream", "preempt"):
        load.add_column(col, justify="left" if not col else "right", no_wrap=True, min_width=len(col))
    kv = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("", "KV in use", "evictable", "free", "KV total", "hit rate"):
        kv.add_column(col, justify="left" if not col else "right", no_wrap=True, min_width=len(col))

    def row(name: str, w: Window, queued: int) -> None:
        load.add_row(
            name,
            _ms(w.ttft_p50_s),
            _ms(w.ttft_p99_s),
            str(w.completed),
            str(queued),
            str(w.running),
            _rate(w.tokens_per_s),
            _rate(w.per_stream_tok_s),
            str(w.preemptions),
        )
        in_use = w.kv_used_tokens - w.kv_evictable_tokens
        kv.add_row(
            name,
            f"{in_use:,} ({_pct(w.kv_pressure)})",
            f"{w.kv_evictable_tokens:,}",
            f"{w.kv_total_tokens - w.kv_used_tokens:,}",
            f"{w.kv_total_tokens:,}",
            _pct(w.hit_rate),
        )

    row("fleet", window, window.queued)
    for name, w in window.workers.items():
        row(name, w, w.waiting)
    parts: list[Any] = [
        load,
        kv,
        Text("KV in use = held by running requests and locked prefixes (what saturates); evictable = cached prefixes, reclaimed on demand\n"),
    ]
    on = [s for s in signals if s.on]
    if on:
        parts.append(Text("saturation signals ON:", style="bold red"))
        parts += [Text(f"  * {s.title}: {s.evidence}", style="red") for s in on]
        parts.append(Text("remedies, cheapest first:", style="bold"))
        parts += [Text(f"  {n}. {r.action}: {r.how}") for n, r in enumerate(remedies(signals, window), 1)]
    else:
        parts.append(Text("no saturation signal on", style="green"))
    off = [s for s in signals if not s.on]
    parts += [Text(f"  - {s.title}: off ({s.evidence})", style="dim") for s in off]
    return Group(*parts)


def console():
    """rich's console for stdout: the terminal's width on a terminal; off one (a pipe, a file, a
    log) a virtual console wide enough that no line is wrapped in the middle of a sentence."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH)


def windows(client, interval: float, timeout: float) -> Iterator[Window]:
    """Poll the router forever, yielding one window per poll after the first."""
    prev = client.stats(timeout=timeout)
    while True:
        time.sleep(interval)
        cur = client.stats(timeout=timeout)
        dt = cur["router"].get("uptime_s", 0) - prev["router"].get("uptime_s", 0)
        restarted = dt <= 0
        yield window_of(cur, None if restarted else prev, time.time(), cur["router"].get("uptime_s", interval) if restarted else dt)
        prev = cur


def run_top(
    address: str,
    *,
    interval: float = 2.0,
    once: bool = False,
    as_json: bool = False,
    timeout: float = 5.0,
    iterations: int | None = None,
    th: Thresholds = Thresholds(),
) -> int:
    from radixserve.client import Client

    history: collections.deque[Window] = collections.deque(maxlen=HISTORY)
    count = 1 if once else iterations
    with Client(address, timeout=timeout) as client:
        stream = windows(client, interval, timeout)
        if as_json or once:
            for n, w in enumerate(stream, 1):
                history.append(w)
                if as_json:
                    print(json.dumps(snapshot(w, list(history), address, th)), flush=True)
                else:
                    console().print(render(w, saturation_signals(list(history), th), address))
                if count is not None and n >= count:
                    break
            return 0
        from rich.live import Live

        try:
            with Live(console=console(), refresh_per_second=4, screen=False) as live:
                for n, w in enumerate(stream, 1):
                    history.append(w)
                    live.update(render(w, saturation_signals(list(history), th), address))
                    if count is not None and n >= count:
                        break
        except KeyboardInterrupt:
            pass
    return 0
