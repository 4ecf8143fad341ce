"""Record a real --metrics-log for the ops tests (not a test module).

    python tests/record_metrics_log.py tests/data/metrics_bursts.jsonl

Starts `radixserve serve` (1 worker, tiny random Llama, 2 requests in flight at most, a line every
0.5 s), sends 3 bursts of 24 requests 3 s apart so the router queue fills and drains three
times, waits for a few idle lines, and stops. Takes about 15 s on 2 CPU cores.
"""

from __future__ import annotations

import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from radixserve.client import Client  # noqa: E402
from radixserve.testing import make_tiny_model_dir  # noqa: E402

from serve_cluster import Cluster  # noqa: E402


def record(out: Path, *, bursts: int = 3, per_burst: int = 24, gap_s: float = 3.0, interval_s: float = 0.5, model_dir: str | None = None) -> Path:
    out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_dir or str(make_tiny_model_dir(Path(tmp) / "llama", "llama", seed=7))
        cluster = Cluster(model_dir, 1, "--metrics-log", str(out), "--metrics-interval", str(interval_s), "--max-inflight", "2", "--max-queue", "256")
        try:
            time.sleep(2 * interval_s)  # idle lines first
            with Client(cluster.address, timeout=120) as c, ThreadPoolExecutor(per_burst) as pool:
                for b in range(bursts):
                    prompts = [[(7 * b + 3 * i + j) % 500 + 1 for j in range(48)] for i in range(per_burst)]
                    list(pool.map(lambda p: c.generate(p, max_tokens=48, temperature=0, ignore_eos=True), prompts))
                    time.sleep(gap_s)
        finally:
            cluster.stop()
    return out


if __name__ == "__main__":
    path = record(Path(sys.argv[1] if len(sys.argv) > 1 else "metrics.jsonl"))
    print(f"{path}: {sum(1 for _ in open(path))} lines, {path.stat().st_size:,} bytes")
