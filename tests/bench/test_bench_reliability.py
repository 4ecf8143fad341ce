"""Smoke test of ``python -m bench reliability`` on a tiny model: the kill and overload scenarios at
a small scale end with well-formed JSON whose counts add up. Speed is never asserted (a timing
criterion may FAIL on a busy machine: the exit status is then 1, and the JSON says which)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.testing import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_reliability_kill_and_overload_tiny(tmp_path):
    model = make_tiny_model_dir(tmp_path / "m", "llama")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "reliability",
            "--scenario",
            "kill,overload",
            "--model",
            str(model),
            "--kills",
            "1",
            "--kill-agents",
            "2",
            "--kill-gap-s",
            "1",
            "--router-calls",
            "4",
            "--router-timeout",
            "2",
            "--max-inflight",
            "2",
            "--max-queue",
            "2",
            "--overload-factor",
            "5",
            "--overload-rounds",
            "1",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert res["ok"] == (proc.returncode == 0) == all(c["pass"] for c in res["criteria"])
    kill = res["scenarios"]["kill"]
    calls = kill["workers"]["calls"]
    assert len(kill["workers"]["kills"]) == 1 and calls.get("ok", 0) > 0
    assert calls.get("hung", 0) == 0 and calls.get("lost", 0) == 0, kill["workers"]["problems"]
    assert kill["router"]["ends"] == {"coded router_lost": 4} and kill["router"]["hung"] == 0
    over = res["scenarios"]["overload"]
    assert over["capacity"] == 4 and over["burst"] == 20
    for t in ("zmq", "zmq-sdk", "http"):
        side = over["transports"][t]
        assert side["sent"] == 20 and side["admitted"] == 4 and side["refused"]["n"] == 16, side
    assert [c["criterion"][:4] for c in res["criteria"]] == ["1 wo", "rout", "ZMQ ", "ZMQ ", "HTTP"]
