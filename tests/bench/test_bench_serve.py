"""Smoke tests for ``python -m bench serve`` (SDK and HTTP targets, a tiny model) and ``python -m bench plots``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from radixserve.testing import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny", "llama", max_position_embeddings=2048))


def _bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "bench", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _check(res: dict, n: int) -> None:
    assert res["requests"] == n and res["succeeded"] == n and res["failed"] == 0, res["errors"]
    assert 0.0 < res["hit_rate"] <= 1.0  # shared prefixes: later requests of a group hit
    assert res["prompt_tokens"] > 0 and res["completion_tokens"] > 0
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = res[key]
        assert d["n"] > 0 and 0 <= d["p50"] <= d["p99"], (key, d)
    assert res["ttft_s"]["p50"] <= res["e2e_s"]["p99"]
    assert res["queue"]["max_queue_depth"] >= 0 and res["queue"]["max_inflight_client"] >= 1


WORKLOAD = (
    "--groups",
    "2",
    "--per-group",
    "4",
    "--prefix-tokens",
    "64",
    "--question-tokens",
    "8",
    "--output-tokens",
    "4",
    "--workers",
    "1",
    "--no-progress",
    "--json",
)


def test_serve_sdk_poisson_with_timeline(tiny_model, tmp_path):
    timeline = tmp_path / "tl.jsonl"
    p = _bench("serve", "--start", "--model", tiny_model, "--rate", "20", "--timeline", str(timeline), *WORKLOAD)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["target"] == "sdk" and res["load"]["kind"] == "poisson"
    _check(res, 8)
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert rows and sum(r["first_tokens"] for r in rows) == 8
    assert all(r["queue_depth_max"] >= 0 for r in rows)


def test_serve_http_closed_loop(tiny_model):
    pytest.importorskip("openai")  # the HTTP target's client
    pytest.importorskip("starlette")  # radixserve's gateway
    p = _bench("serve", "--start", "--target", "http", "--model", tiny_model, "--agents", "3", *WORKLOAD)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["target"] == "http" and res["endpoint"].startswith("http://") and res["load"]["kind"] == "closed"
    _check(res, 8)
    assert res["queue"]["max_inflight_client"] <= 3


def test_trace_items_rebuild_chained_prefixes(tmp_path):
    import argparse

    from bench.serve import trace_items

    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1024, "output_length": 3, "hash_ids": [1, 3]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(trace=str(trace), max_requests=None, block_tokens=512, seed=0, time_scale=0.5, max_output=None)
    a, b = trace_items(args, 1000)
    assert len(a.prompt) == 700 and len(b.prompt) == 1024
    assert a.prompt[:512] == b.prompt[:512] and a.prompt[512:] != b.prompt[512:700]
    assert (a.at, b.at) == (0.0, 0.5) and (a.max_tokens, b.max_tokens) == (5, 3)


def test_plots_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    timeline = tmp_path / "tl.jsonl"
    timeline.write_text(
        "".join(
            json.dumps(
                {"t_s": s, "first_tokens": 1, "ttft_mean_s": 0.1 * s, "ttft_max_s": 0.2 * s, "queue_depth_max": s % 3, "inflight_max": s % 4, "completed": 1}
            )
            + "\n"
            for s in range(5)
        )
    )
    sim = tmp_path / "sim.json"
    sim.write_text(
        json.dumps(
            {
                "ideal": 0.37,
                "rows": [
                    {"policy": "ideal", "capacity": None, "workers": 1, "hit_rate": 0.37},
                    {"policy": "radix-lru", "capacity": 100, "workers": 1, "hit_rate": 0.14},
                    {"policy": "belady", "capacity": 100, "workers": 1, "hit_rate": 0.36},
                ],
            }
        )
    )
    thr = tmp_path / "thr.json"
    thr.write_text(
        json.dumps(
            {
                "config": {"prompt_len": 64, "gen_len": 32},
                "engine": [{"concurrency": c, "aggregate_tok_s": 20.0 * c**0.5, "per_stream_tok_s": 20.0 / c**0.5} for c in (1, 8, 64)],
            }
        )
    )
    out = tmp_path / "plots"
    p = _bench("plots", "--timeline", str(timeline), "--simulate", str(sim), "--throughput", str(thr), "--out", str(out), timeout=60)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in ("serve_timeline.png", "simulate_hit_rate.png", "throughput.png"):
        png = out / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
