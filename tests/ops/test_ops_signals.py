"""The saturation signals and remedies (pure functions), windows between stats documents, and
`radixserve top`'s frame from a stand-in client."""

from __future__ import annotations

import re

import pytest

from radixserve.ops.signals import Thresholds, Window, hist_delta_quantile, remedies, saturation_signals, window_of
from radixserve.serve.metrics import Histogram


def W(**kw) -> Window:
    return Window(t=kw.pop("t", 0.0), dt_s=kw.pop("dt_s", 1.0), **kw)


def on(windows, **th) -> set[str]:
    return {s.name for s in saturation_signals(windows, Thresholds(**th)) if s.on}


def test_quiet_fleet_has_no_signal_and_no_remedy():
    ws = [W(ttft_p50_s=0.02, per_stream_tok_s=30.0, running=2) for _ in range(5)]
    sigs = saturation_signals(ws)
    assert [s.name for s in sigs] == ["ttft_rising", "queue_persistent", "per_stream_sagging", "preemption"]
    assert not any(s.on for s in sigs) and remedies(sigs) == []


def test_ttft_from_ms_to_seconds():
    ws = [W(ttft_p50_s=x) for x in (0.02, 0.03, 0.05, 1.4, 1.8, 2.2)]
    assert on(ws) == {"ttft_rising"}
    assert on([W(ttft_p50_s=x) for x in (0.02, 0.03, 0.6, 0.7, 0.65)]) == {"ttft_rising"}  # 0.5 s+ and 20x the best
    assert on([W(ttft_p50_s=x) for x in (0.4, 0.5, 0.6, 0.7, 0.65)]) == set()  # slow-ish but not rising
    assert on([W(ttft_p50_s=0.02), W(), W()]) == set()  # nothing finished lately: no evidence


def test_queue_must_stay_above_zero():
    assert on([W(queue_depth=3), W(waiting=1), W(queue_depth=2, waiting=5)]) == {"queue_persistent"}
    assert on([W(queue_depth=3), W(queue_depth=0), W(queue_depth=2)]) == set()  # it drained: a burst
    assert on([W(queue_depth=9), W(), W(queue_depth=2), W(queue_depth=1), W(waiting=4)]) == {"queue_persistent"}


def test_per_stream_tok_s_sagging_as_the_batch_fills():
    ws = [W(per_stream_tok_s=40.0, running=2), W(per_stream_tok_s=30.0, running=8), W(per_stream_tok_s=15.0, running=32)]
    assert on(ws) == {"per_stream_sagging"}
    # slower per stream but with a smaller batch (e.g. longer contexts): not this signal
    assert on([W(per_stream_tok_s=40.0, running=8), W(per_stream_tok_s=15.0, running=4)]) == set()
    assert on([W(per_stream_tok_s=40.0, running=2), W(per_stream_tok_s=25.0, running=32)]) == set()  # 62% of best


def test_preemption_in_recent_windows():
    assert on([W(preemptions=2), W(), W(), W()]) == set()  # long ago
    assert on([W(), W(preemptions=1), W()]) == {"preemption"}


def test_remedies_in_cost_order():
    rs = remedies(saturation_signals([W(preemptions=1, queue_depth=1)] * 3))
    assert [r.rank for r in rs] == [1, 2, 3]
    assert [r.action for r in rs] == ["bound context", "quantize the KV cache", "add workers / GPUs"]
    # TTFT alone: the KV cache is not the bottleneck, so quantizing it is not offered
    rs = remedies(saturation_signals([W(ttft_p50_s=2.0)] * 3))
    assert [r.action for r in rs] == ["bound context", "add workers / GPUs"]


def _hist(values) -> dict:
    h = Histogram()
    for v in values:
        h.observe(v)
    return h.to_dict()


def test_quantile_of_the_observations_between_two_histograms():
    before = _hist([0.002] * 10)
    after = _hist([0.002] * 10 + [0.3] * 4)  # 4 new, all in (0.25, 0.5]
    # rank 2 of 4 inside (0.25, 0.5]: 0.25 + 0.25 * 2/4
    assert hist_delta_quantile(after, before, 0.5) == pytest.approx(0.375)
    assert hist_delta_quantile(after, before, 0.99) == pytest.approx(0.25 + 0.25 * 3.96 / 4)
    assert hist_delta_quantile(before, before, 0.5) is None
    assert hist_delta_quantile(_hist([100.0]), None, 0.5) == 60.0  # beyond the last bucket: its bound
    # a restarted source (counts went down) counts from zero
    assert hist_delta_quantile(_hist([0.3]), after, 0.5) == pytest.approx(0.375)


def _doc(gen, running, q, h, pre, queue, ttfts, kv_used=100):
    eng = {
        "generated_tokens": gen,
        "running": running,
        "waiting": 1,
        "preemptions": pre,
        "prefix_query_tokens": q,
        "prefix_hit_tokens": h,
        "kv_total_tokens": 1000,
        "kv_used_tokens": kv_used,
        "kv_evictable_tokens": 40,
        "kv_locked_tokens": 50,
    }
    return {
        "router": {"uptime_s": 10.0, "gauges": {"queue_depth": queue, "inflight": 3}, "histograms": {"ttft_s": _hist(ttfts)}},
        "workers": {
            "w0": {"alive": True, "inflight": 2, "engine": eng, "histograms": {"router_ttft_s": _hist(ttfts)}},
            "w1": {"alive": True, "inflight": 1, "engine": dict(eng, generated_tokens=gen // 2), "histograms": {}},
            "dead": {"alive": False, "engine": dict(eng, generated_tokens=10**9)},
        },
    }


def test_window_between_two_stats_documents():
    prev = _doc(gen=100, running=2, q=1000, h=200, pre=1, queue=0, ttfts=[0.002] * 3)
    cur = _doc(gen=300, running=6, q=2000, h=1100, pre=3, queue=4, ttfts=[0.002] * 3 + [0.03] * 2)
    w = window_of(cur, prev, t=5.0, dt=2.0)
    assert w.tokens == 200 + 100  # w0 + w1; the dead worker does not count
    assert w.tokens_per_s == 150.0
    assert w.per_stream_tok_s == pytest.approx(150.0 / ((12 + 4) / 2))  # fleet running: 2+2 -> 6+6
    assert w.hit_rate == pytest.approx(1800 / 2000)
    assert w.preemptions == 4 and w.completed == 2
    assert w.queue_depth == 4 and w.waiting == 2 and w.queued == 6
    assert w.kv_used_tokens == 200 and w.kv_total_tokens == 2000 and w.kv_locked_tokens == 100
    assert w.ttft_p50_s == pytest.approx(0.025 + 0.025 * 1 / 2)
    assert set(w.workers) == {"w0", "w1"}
    assert w.workers["w0"].tokens == 200 and w.workers["w0"].per_stream_tok_s == pytest.approx(100 / 4)
    assert w.workers["w1"].ttft_p50_s is None
    assert w.to_dict()["workers"]["w0"]["queued"] == 1
    # a worker that restarted (its counters went down) counts from zero, never negative
    restarted = _doc(gen=50, running=1, q=10, h=0, pre=0, queue=0, ttfts=[0.002] * 3)
    assert window_of(restarted, cur, t=7.0, dt=2.0).workers["w0"].tokens == 50


def test_remedies_read_the_kv_state():
    queue = saturation_signals([W(queue_depth=5)] * 3)
    # KV mostly free and every worker at its in-flight cap: the cap, not memory, queues requests
    idle = W(queue_depth=5, kv_total_tokens=1000, kv_used_tokens=300, kv_evictable_tokens=200, inflight=8, inflight_cap=8)
    assert idle.kv_pressure == pytest.approx(0.1)
    assert [r.rank for r in remedies(queue, idle)] == [0, 1, 3]
    # KV nearly all held by running requests: quantizing it is the next step
    full = W(queue_depth=5, kv_total_tokens=1000, kv_used_tokens=950, kv_evictable_tokens=50, inflight=8, inflight_cap=8)
    assert [r.rank for r in remedies(queue, full)] == [1, 2, 3]
    # below the cap with free KV: neither extra
    below = W(queue_depth=5, kv_total_tokens=1000, kv_used_tokens=300, inflight=3, inflight_cap=8)
    assert [r.rank for r in remedies(queue, below)] == [1, 3]
    # preemptions mean KV ran out whatever the gauge says now
    pre = saturation_signals([W(preemptions=1)] * 3)
    assert [r.rank for r in remedies(pre, below)] == [1, 2, 3]


class _IdleRouter:
    """A stand-in SDK client for ``radixserve top``: an idle server whose KV is all evictable
    cache (23,300 of 23,300 tokens used)."""

    def __init__(self, address, timeout=None):
        self.polls = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def stats(self, timeout=None):
        self.polls += 1
        eng = {
            "generated_tokens": 0,
            "running": 0,
            "waiting": 0,
            "preemptions": 0,
            "prefix_query_tokens": 0,
            "prefix_hit_tokens": 0,
            "kv_total_tokens": 23300,
            "kv_used_tokens": 23300,
            "kv_evictable_tokens": 23300,
            "kv_locked_tokens": 0,
        }
        return {
            "router": {"uptime_s": 10.0 + self.polls, "gauges": {"queue_depth": 0, "inflight": 0}, "histograms": {}},
            "workers": {"w0": {"alive": True, "inflight": 0, "engine": eng, "histograms": {}}},
        }


def _top_once(monkeypatch, capsys) -> str:
    import radixserve.client
    from radixserve.ops.top import run_top

    monkeypatch.setattr(radixserve.client, "Client", _IdleRouter)
    for var in ("COLUMNS", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)
    assert run_top("tcp://127.0.0.1:1", interval=0.0, once=True) == 0
    return capsys.readouterr().out


def test_top_once_off_a_terminal_never_wraps_a_sentence(monkeypatch, capsys):
    """Issue 49 item 5: off a TTY `top --once` wrapped at 80 columns in the middle of sentences."""
    lines = [line.rstrip() for line in _top_once(monkeypatch, capsys).splitlines()]
    assert "  - per-stream tok/s sagging as the batch fills: off (not enough windows with decoding to compare)" in lines
    assert max(map(len, lines)) > 80


def test_top_shows_idle_evictable_kv_apart_from_kv_in_use(monkeypatch, capsys):
    """Issue 49 item 5: an idle server showed "KV used 23,300 (100%)", all of it evictable cache,
    which reads as an alarm. In use (what saturates), evictable and free are now apart."""
    out = _top_once(monkeypatch, capsys)
    assert re.search(r"KV in use\s+evictable\s+free\s+KV total", out), out
    assert re.search(r"fleet\s+0 \(0%\)\s+23,300\s+0\s+23,300", out), out
    assert "100%" not in out
