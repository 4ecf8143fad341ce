"""Issue 49 items 8 and 16: what an unauthenticated client can make the router hold is bounded,
and no one error ends a periodic task of the router."""

from __future__ import annotations

import os
import resource
import signal
import time

import pytest
import zmq

from radixserve.client import Client
from radixserve.serve.router import RouterConfig
from radixserve.testing import spawn_server

from serve_cluster import ENV, running_router

pytestmark = pytest.mark.timeout(240)

NOFILE = 128  # the serve process's open-file limit, soft and hard (prlimit --nofile=128): ~30 in use idle


class _FailingSupervisor:
    workers: dict = {}
    procs: list = []
    fatal = None

    def tick(self, now, shutting_down=False):
        raise OSError(24, "Too many open files")


def test_an_error_in_a_tick_does_not_end_the_ticker():
    with running_router(RouterConfig(port=0, heartbeat_s=0.05)) as router:
        router.supervisor = _FailingSupervisor()
        deadline = time.monotonic() + 10
        while router.counters.get("task_errors", 0) < 5:  # one per tick: the ticker goes on
            assert time.monotonic() < deadline, router.counters
            time.sleep(0.05)
        router.supervisor = None


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def test_idle_client_flood_then_a_worker_kill_the_worker_comes_back(llama_dir):
    """The repro, made small: under a low open-file limit, idle client connections past it made
    libzmq spin on accept() and the restart's Popen fail with EMFILE, which ended the ticker: the
    killed worker was never restarted and nothing was pinged again."""
    server = spawn_server(llama_dir, "--kv-cache-tokens", "8192", "--worker-threads", "1", env=ENV, preexec_fn=_limit_open_files)
    flood = zmq.Context()
    try:
        with Client(server.address, timeout=30) as c:  # connected before the flood
            victim = c.stats()["workers"]["w0"]["pid"]
            socks = []
            for _ in range(NOFILE + 30):
                s = flood.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(server.address)
                socks.append(s)
            time.sleep(2.0)
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + 90
            while True:
                stats = c.stats()
                w0 = stats["workers"]["w0"]
                if w0["alive"] and w0["pid"] != victim:
                    break
                assert time.monotonic() < deadline, (w0, stats["router"]["counters"])
                time.sleep(0.5)
            gauges = stats["router"]["gauges"]
            assert stats["router"]["counters"]["refused_clients"] > 0 and gauges["max_clients"] == NOFILE // 2
            assert gauges["clients"] <= NOFILE // 2 + 8
            assert len(c.generate([5, 6, 7], max_tokens=2, temperature=0.0).token_ids) == 2
        for s in socks:
            s.close()
        with Client(server.address, timeout=30) as c:  # the slots are free again
            assert c.health()["workers_alive"] == 1
    finally:
        flood.destroy(linger=0)
        server.stop()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_unread_stats_replies_are_bounded_and_a_reading_client_loses_none(tmp_path):
    """Item 16, the repro made small: a client that sends thousands of stats calls and reads
    nothing grew the router by 2 KB per reply (20k: 43 MB). Past its connection's high-water mark
    the router now drops such replies; a busy client that reads gets every reply (the HTTP
    gateway's streams broke under a plain per-client SNDHWM, which dropped them silently)."""
    from radixserve import protocol as P

    n = 5000
    with running_router(RouterConfig(address=f"ipc://{tmp_path}/r", client_sndhwm=200)) as router:
        ctx = zmq.Context()
        try:
            mute = ctx.socket(zmq.DEALER)
            mute.setsockopt(zmq.LINGER, 0)
            mute.setsockopt(zmq.RCVHWM, 1)  # reads nothing: its pipe and the kernel's buffer fill up
            mute.connect(router.address)
            before = _rss_mb()
            for i in range(n):
                mute.send(P.encode(P.Stats(id=f"s{i}")))
            deadline = time.monotonic() + 30
            while router.counters["dropped_replies"] < n // 2:
                assert time.monotonic() < deadline, router.counters["dropped_replies"]
                time.sleep(0.05)
            assert _rss_mb() - before < 8.0  # 5000 replies held would be ~10 MB
        finally:
            ctx.destroy(linger=0)
        with Client(router.address, timeout=30) as busy:  # reads: 1000 concurrent calls, all answered
            import asyncio

            async def burst():  # a dropped reply would time out its call
                return await asyncio.gather(*(busy._async.stats(timeout=15) for _ in range(1000)))

            assert len(busy._run(burst())) == 1000
