"""radixserve top and report against a live server (real processes on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.client import Client

from serve_cluster import ENV, Cluster

REQUESTS, MAX_TOKENS = 48, 32


@pytest.fixture()
def busy_cluster(llama_dir, tmp_path):
    """1 worker, 1 request in flight at most (so a queue forms), a metrics line every 0.3 s, and
    48 requests x 32 tokens in flight from a background thread (long enough to outlast the top calls)."""
    log = tmp_path / "metrics.jsonl"
    cluster = Cluster(llama_dir, 1, "--metrics-log", str(log), "--metrics-interval", "0.3", "--max-inflight", "1")
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        time.sleep(0.05)  # the first line is the baseline; load starts after it
    results: list = []

    def load():
        with Client(cluster.address, timeout=120) as c, ThreadPoolExecutor(REQUESTS) as pool:
            prompts = [[(5 * i + j) % 400 + 1 for j in range(64)] for i in range(REQUESTS)]
            results.extend(pool.map(lambda p: c.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), prompts))

    thread = threading.Thread(target=load)
    thread.start()
    try:
        yield cluster, log, thread, results
    finally:
        thread.join(120)
        cluster.stop()


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_top_and_report_on_a_live_server(busy_cluster):
    cluster, log, thread, results = busy_cluster
    out = _cli("top", cluster.address, "--json", "--iterations", "3", "--interval", "0.5")
    assert out.returncode == 0, out.stderr
    frames = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(frames) == 3
    for f in frames:
        assert f["address"] == cluster.address
        assert set(f["window"]["workers"]) == {"w0"}
        assert [s["name"] for s in f["signals"]] == ["ttft_rising", "queue_persistent", "per_stream_sagging", "preemption"]
        assert f["window"]["kv_total_tokens"] == 8192
    busy = [f["window"] for f in frames if f["window"]["tokens"] > 0]
    assert busy, "no tokens generated while 48 requests were in flight"
    assert all(w["tokens_per_s"] > 0 and w["running"] <= 1 for w in busy)
    text = _cli("top", cluster.address, "--once", "--interval", "0.5")
    assert text.returncode == 0, text.stderr
    assert "radixserve top" in text.stdout and "fleet" in text.stdout and "w0" in text.stdout
    assert "TTFT p50" in text.stdout
    live = _cli("top", cluster.address, "--iterations", "2", "--interval", "0.3")  # the rich.live path
    assert live.returncode == 0, live.stderr
    assert live.stdout.count("radixserve top") >= 1 and "saturation signal" in live.stdout

    thread.join(120)
    assert len(results) == REQUESTS
    time.sleep(1.0)  # at least two more log lines after the last token
    rep_out = _cli("report", str(log), "--json", "--no-plot")
    assert rep_out.returncode == 0, rep_out.stderr
    rep = json.loads(rep_out.stdout)
    assert rep["generation"]["tokens"] == REQUESTS * MAX_TOKENS  # every generated token, counted once
    assert rep["generation"]["completed"] == REQUESTS
    assert 0 < rep["generation"]["hours"] <= rep["period"]["hours"]
    assert rep["verdict"]["evidence"]["max_queued"] > 0  # 48 requests against 1 in flight did queue
    assert rep["verdict"]["verdict"] in {"capacity", "bursts", "fine", "no data"}


def test_top_against_no_server_is_a_clear_error():
    out = _cli("top", "tcp://127.0.0.1:9", "--once", "--timeout", "1")
    assert out.returncode == 2 and "radixserve: error" in out.stderr
