"""A remote worker outlives its router: the router is killed (SIGKILL) and started again on the
same ports with the same secret file; the worker registers with the new one by itself and its
snapshot carries the cache it built under the old one (loopback, real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from radixserve.client import Client
from radixserve.testing import spawn_server

from serve_cluster import ENV

pytestmark = pytest.mark.timeout(180)


def _serve(model: str, secret: str, port: int = 0, worker_port: int | None = None):
    extra = ["--worker-secret-file", secret, *(["--worker-port", str(worker_port)] if worker_port is not None else [])]
    server = spawn_server(model, *extra, workers=0, port=port, env=ENV)
    return server.proc, server.address, server.worker_address


def test_worker_rejoins_a_restarted_router_with_its_cache(llama_dir, tmp_path):
    secret = str(tmp_path / "secret")
    procs = []
    try:
        router, address, worker_address = _serve(llama_dir, secret)
        procs.append(router)
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.cli",
                "--log-level",
                "WARNING",
                "worker",
                "--router",
                worker_address,
                "--secret-file",
                secret,
                "--model",
                llama_dir,
                "--worker-id",
                "wx",
                "--threads",
                "1",
                "--kv-cache-tokens",
                "2048",
            ],
            env=ENV,
        )
        procs.append(worker)
        prompt = list(range(10, 70))
        with Client(address, timeout=30) as c:
            c.wait_ready(1, timeout=90)
            assert c.generate(prompt, max_tokens=4, temperature=0).worker == "wx"
        router.kill()
        router.wait(timeout=10)
        port, wport = int(address.rsplit(":", 1)[1]), int(worker_address.rsplit(":", 1)[1])
        router2, _, _ = _serve(llama_dir, secret, port, wport)
        procs.append(router2)
        with Client(address, timeout=30) as c:
            c.wait_ready(1, timeout=30)  # the worker found the new router by itself
            deadline = time.monotonic() + 15
            while True:
                w = c.stats()["workers"]["wx"]
                tree = w["engine"].get("kv_evictable_tokens", 0) + w["engine"].get("kv_locked_tokens", 0)
                if w["index_synced"] and w["index_tokens"] == tree > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            # The new router never saw the first request, yet it knows the prefix is cached there.
            assert w["index_synced"] and w["index_tokens"] == tree >= len(prompt), w
            probe = c.stats(probe=prompt)["probe"]
            assert probe["wx"] >= len(prompt) - 1, probe
            out = c.generate(prompt, max_tokens=4, temperature=0)
            assert out.worker == "wx" and out.usage.cached_tokens > 0
        worker.terminate()
        assert worker.wait(timeout=20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
