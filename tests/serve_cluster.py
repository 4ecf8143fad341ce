"""Test helper: a `radixserve serve` cluster in real processes on loopback (not a test module)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from radixserve.client import Client
from radixserve.testing import spawn_server

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


class Cluster:
    """`radixserve serve --port 0 ...` (:func:`radixserve.testing.spawn_server`) and its workers;
    with ``http=True`` also the OpenAI gateway (``--http-port 0``), its base URL in ``url``."""

    def __init__(
        self, model_dir: str, workers: int = 2, *extra: str, kv_cache_tokens: int = 8192, ready_timeout: float = 90.0, restart: bool = False, http: bool = False
    ):
        self.secret_file = os.path.join(tempfile.mkdtemp(prefix="radixserve-test-"), "worker.secret")
        # restart=False: a killed worker stays dead, as the failure tests expect (serve's default
        # restarts it; tests of the supervisor ask for that).
        self.server = spawn_server(
            model_dir,
            "--kv-cache-tokens",
            str(kv_cache_tokens),
            "--worker-threads",
            "1",
            *([] if restart else ["--no-restart"]),
            "--worker-secret-file",
            self.secret_file,
            *extra,
            workers=workers,
            env=ENV,
            ready_timeout=ready_timeout,
            http=http,
        )
        self.url = self.server.http_url  # http://127.0.0.1:PORT/v1, or None without http
        self.proc = self.server.proc
        self.address, self.worker_address = self.server.address, self.server.worker_address
        self.workers = workers
        self.extra_procs: list[subprocess.Popen] = []
        # serve with --api-key: the SDK must carry a key (the first one) on its ZMQ socket too
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        with Client(self.address, timeout=10, api_key=self.api_key) as c:
            self.pids = {name: w["pid"] for name, w in c.stats()["workers"].items()}
            self.worker_pids = [self.pids[name] for name in sorted(self.pids)]

    def start_worker(self, model_dir: str, name: str, *extra: str, **popen) -> subprocess.Popen:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.cli",
                "--log-level",
                "WARNING",
                "worker",
                "--router",
                self.worker_address,
                "--secret-file",
                self.secret_file,
                "--model",
                model_dir,
                "--worker-id",
                name,
                "--kv-cache-tokens",
                "8192",
                "--threads",
                "1",
                *extra,
            ],
            env=ENV,
            **popen,
        )
        self.extra_procs.append(proc)
        return proc

    def stop(self, timeout: float = 20.0) -> int | None:
        pids = list(self.worker_pids)
        self.server.stop(timeout)
        for p in self.extra_procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        deadline = time.monotonic() + 5
        for pid in pids:  # workers exit with the router; make sure of it
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return self.server.proc.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def running_router(config):
    """An in-process Router on its own event loop thread, for tests that talk raw ZMQ to it;
    shut down, joined and its loop closed on exit."""
    import asyncio

    from radixserve.serve.router import Router

    router = Router(config)
    router.bind()
    loop = router.loop = asyncio.new_event_loop()  # tests may run probes on it (run_coroutine_threadsafe)
    thread = threading.Thread(target=loop.run_until_complete, args=(router.serve(),), daemon=True)
    thread.start()
    try:
        yield router
    finally:
        loop.call_soon_threadsafe(router.request_shutdown)
        thread.join(30)
        if not thread.is_alive():
            loop.close()
