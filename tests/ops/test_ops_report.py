"""radixserve report: verdicts on synthetic rising / sawtooth / flat logs, a recorded log, the CLI."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.errors import BadRequestError
from radixserve.ops.report import drain_cycles, format_report, read_metrics_log, rent_vs_buy, report, verdict, windows_of
from radixserve.serve.metrics import Histogram

RECORDED = Path(__file__).parents[1] / "data" / "metrics_bursts.jsonl"


def synthetic_log(intervals, *, step_s: float = 60.0, t0: float = 1.7e9) -> list[dict]:
    """Stats documents as the router writes them, from per-interval (ttfts, queued, tokens)."""
    hist, gen, docs = Histogram(), 0, []
    for i, (ttfts, queued, tokens) in enumerate([([], 0, 0)] + list(intervals)):
        for v in ttfts:
            hist.observe(v)
        gen += tokens
        docs.append(
            {
                "time": t0 + i * step_s,
                "router": {"uptime_s": 5.0 + i * step_s, "gauges": {"queue_depth": queued, "inflight": 4}, "histograms": {"ttft_s": hist.to_dict()}},
                "workers": {
                    "w0": {
                        "alive": True,
                        "inflight": 4,
                        "engine": {
                            "generated_tokens": gen,
                            "running": 4 if tokens else 0,
                            "waiting": 0,
                            "preemptions": 0,
                            "kv_total_tokens": 1000,
                            "kv_used_tokens": 10,
                            "prefix_query_tokens": 0,
                            "prefix_hit_tokens": 0,
                        },
                    }
                },
            }
        )
    return docs


def _ttfts(p50: float, rng: random.Random, n: int = 20) -> list[float]:
    return [p50 * math.exp(rng.gauss(0, 0.2)) for _ in range(n)]


def rising(n: int = 60) -> list[dict]:
    rng = random.Random(1)
    return synthetic_log([(_ttfts(0.05 + 4.0 * i / n, rng), 1 + i // 2, 600) for i in range(n)])


def sawtooth(n: int = 60) -> list[dict]:
    rng = random.Random(2)
    return synthetic_log([(_ttfts(0.05 + 0.3 * (i % 10), rng), [0, 5, 10, 15, 20, 15, 10, 5, 2, 0][i % 10], 600) for i in range(n)])


def flat(n: int = 60) -> list[dict]:
    rng = random.Random(3)
    return synthetic_log([(_ttfts(0.05, rng), 0, 600 if i % 3 else 0) for i in range(n)])


def overload_episode(n: int = 60) -> list[dict]:
    """Idle, then arrivals above capacity for a while (queue and TTFT climb), then the load stops
    and the queue drains: one long hump, not a sawtooth."""
    rng = random.Random(4)
    rows = []
    for i in range(n):
        if i < 10:
            rows.append((_ttfts(0.05, rng), [0, 0, 0, 3, 0, 0, 2, 0, 0, 0][i], 300))  # light, two blips
        elif i < 45:
            rows.append((_ttfts(0.1 + 0.4 * (i - 10), rng), 10 * (i - 9), 600))
        elif i < 55:
            rows.append((_ttfts(14.0 + (i - 45), rng), max(0, 350 - 40 * (i - 44)), 600))
        else:
            rows.append(([], 0, 0))
    return synthetic_log(rows)


def test_one_long_overload_episode_is_capacity_even_after_it_drains():
    v = verdict(windows_of(overload_episode()))
    assert v["verdict"] == "capacity", v
    assert v["evidence"]["queued_at_end"] == 0 and v["evidence"]["drain_cycles"] == 3
    assert v["evidence"]["longest_queued_share_of_active"] > 0.5


def test_rising_log_is_capacity():
    v = verdict(windows_of(rising()))
    assert v["verdict"] == "capacity", v
    ev = v["evidence"]
    assert ev["ttft_p50_slope_s_per_hour"] > 2.0 and ev["ttft_fit_r2"] > 0.9
    assert ev["ttft_fit_end_s"] > 10 * ev["ttft_fit_start_s"]
    assert ev["drain_cycles"] == 0 and ev["queued_at_end"] == 30


def test_sawtooth_log_is_bursts():
    v = verdict(windows_of(sawtooth()))
    assert v["verdict"] == "bursts", v
    assert v["evidence"]["drain_cycles"] == 6 and v["evidence"]["max_queued"] == 20
    assert v["evidence"]["ttft_fit_r2"] < 0.5


def test_flat_log_is_fine():
    v = verdict(windows_of(flat()))
    assert v["verdict"] == "fine", v
    assert v["evidence"]["max_queued"] == 0
    assert abs(v["evidence"]["ttft_p50_slope_s_per_hour"]) < 0.05


def test_too_few_windows_is_no_data():
    assert verdict(windows_of(synthetic_log([([0.1], 0, 1)] * 2)))["verdict"] == "no data"


def test_drain_cycles_counts_returns_to_zero():
    assert drain_cycles([0, 3, 0, 0, 2, 5, 0, 1]) == 2
    assert drain_cycles([1, 2, 3]) == 0


def test_generation_hours_and_rent_vs_buy():
    rep = report(flat(60), rent_per_hour=2.0, buy_price=600.0, own_cost_per_hour=0.5)
    # 60 windows of 60 s, tokens in 40 of them (i % 3 != 0): 40 minutes of generation out of 60
    assert rep["period"]["hours"] == pytest.approx(1.0)
    assert rep["generation"]["hours"] == pytest.approx(40 / 60)
    assert rep["generation"]["tokens"] == 40 * 600
    assert rep["generation"]["tokens_per_s_while_generating"] == pytest.approx(600 / 60)
    rb = rep["rent_vs_buy"]
    assert rb["breakeven_generation_hours"] == pytest.approx(600 / 1.5)
    assert rb["generation_hours_per_week"] == pytest.approx(168 * 40 / 60)
    assert rb["weeks_to_breakeven"] == pytest.approx(400 / (168 * 40 / 60))
    # at the typical $2/h: 600 / (2 - 0.5) h; at $0.50/h renting never costs more than owning
    assert rb["breakeven_range_hours_at_typical_rents"] == [pytest.approx(400.0), None]


def test_defaults_give_the_typical_break_even_range():
    rb = rent_vs_buy(10, 168, 1.0, 500.0)
    assert rb["breakeven_generation_hours"] == 500
    assert rb["breakeven_range_hours_at_typical_rents"] == [250, 1000]  # $2/h and $0.50/h vs $500
    assert rb["weeks_to_breakeven"] == pytest.approx(50)
    with pytest.raises(BadRequestError):
        rent_vs_buy(1, 1, 0.0, 500)


def test_recorded_log_from_a_real_server(tmp_path):
    """tests/data/metrics_bursts.jsonl was written by tests/record_metrics_log.py: 3 bursts of 24
    requests x 48 tokens against 1 worker with 2 in flight."""
    docs = read_metrics_log(RECORDED)
    rep = report(docs)
    assert rep["generation"]["tokens"] == 3 * 24 * 48
    assert rep["generation"]["completed"] == 3 * 24
    assert 0 < rep["generation"]["hours"] < rep["period"]["hours"]
    assert rep["verdict"]["verdict"] == "bursts"
    assert rep["verdict"]["evidence"]["drain_cycles"] == 3


def test_cli_report_json_plot_and_a_cut_line(tmp_path):
    log = tmp_path / "m.jsonl"
    lines = [json.dumps(d) for d in rising()]
    log.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "report", str(log), "--json", "--rent-per-hour", "0.5", "--buy-price", "400"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["verdict"]["verdict"] == "capacity"
    assert rep["period"]["skipped_lines"] == 1
    assert rep["rent_vs_buy"]["breakeven_generation_hours"] == pytest.approx(800)
    png = Path(rep["plot"])
    assert png == tmp_path / "m.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = subprocess.run([sys.executable, "-m", "radixserve.cli", "report", str(RECORDED), "--no-plot"], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "BURSTS" in text.stdout and "break-even after 500 h" in text.stdout


def test_cli_report_missing_or_empty_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "radixserve.cli", "report", str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "does not exist" in out.stderr
    (tmp_path / "e.jsonl").write_text("not json\n")
    out = subprocess.run([sys.executable, "-m", "radixserve.cli", "report", str(tmp_path / "e.jsonl")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "need at least 2" in out.stderr


def test_texts_say_what_the_figures_are():
    """Issue 49 item 4: `report` printed "at the seed's rents", `plan --help` said "the seed's
    class" and that --model defaults to "the built-in stand-in model", `report --help` said "the
    seed: a few hundred used", and README copied them. They now say what the figures are."""
    from radixserve.cli import build_parser

    subs = next(a for a in build_parser()._actions if a.dest == "command").choices
    helps = {name: " ".join(subs[name].format_help().split()) for name in ("plan", "report")}
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    printed = format_report(report(flat(12)))
    for text in (*helps.values(), readme, printed):
        assert not re.search(r"\bseed's\b|\bthe seed\b", text, re.I), re.search(r".{60}\bseed's?\b.{60}", text, re.I)
    assert "default: 24, a 24 GB-class GPU" in helps["plan"]
    assert "default: the default model" in helps["plan"] and "SmolLM2-135M-Instruct" in helps["plan"]
    assert "a 24 GB-class GPU typically rents for 0.50-2" in helps["report"]
    assert "a used 24 GB-class GPU costs a few hundred" in helps["report"]
    assert "at a 24 GB-class GPU's typical rents $2.00-0.50/h: 250 h to 1,000 h" in printed


def test_flat_verdict_prints_the_measured_ttft_not_a_negative_fit_end():
    """Issue 49 item 5: a flat log printed "rolling p50 TTFT -0.294 s -> 0.710 s", the ends of a
    poor straight-line fit; it now prints the measured rolling medians, and the fit as a slope."""
    spikes = {52, 53, 55, 56, 58, 59}  # a few slow windows at the end: a rising fit with a low R^2
    v = verdict(windows_of(synthetic_log([([1.0 if i in spikes else 0.02] * 5, 0, 600) for i in range(60)])))
    ev = v["evidence"]
    assert v["verdict"] == "fine" and ev["ttft_fit_start_s"] < 0  # the fit's intercept is below 0 s
    m = re.search(r"rolling p50 TTFT (\S+) s -> (\S+) s, fit ([-+]\S+) s/hour", v["reason"])
    assert m, v["reason"]
    assert float(m[1]) == pytest.approx(ev["ttft_p50_first_s"], abs=1e-3) and float(m[1]) > 0
    assert float(m[2]) == pytest.approx(ev["ttft_p50_last_s"], abs=1e-3)
    assert float(m[3]) == pytest.approx(ev["ttft_p50_slope_s_per_hour"], abs=1e-3)
