"""Failures in real processes: a worker SIGKILLed mid-stream, overload, shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from radixserve.client import AsyncClient, Client, Completion
from radixserve.errors import OverloadedError, RadixServeError, ShuttingDownError, WorkerLostError

from conftest import random_prompts
from serve_cluster import Cluster

pytestmark = pytest.mark.timeout(300)

LONG = dict(temperature=0.0, ignore_eos=True)


async def _consume(client: AsyncClient, prompt, stream: bool, max_tokens: int, first_token: asyncio.Event):
    """Run one call; return (kind, streamed tokens, Completion or exception)."""
    streamed: list[int] = []
    try:
        if not stream:
            return "call", streamed, await client.generate(prompt, max_tokens=max_tokens, **LONG)
        async for item in client.stream(prompt, max_tokens=max_tokens, **LONG):
            if isinstance(item, Completion):
                return "stream", streamed, item
            streamed += item.token_ids
            first_token.set()
        raise AssertionError("stream ended without a final message")
    except RadixServeError as exc:
        return ("stream" if stream else "call"), streamed, exc


def test_worker_sigkill_mid_stream_loses_nothing(llama_dir):
    cluster = Cluster(llama_dir, 2, "--policy", "round_robin")
    try:
        prompts = random_prompts([10 + i % 13 for i in range(40)], seed=3)

        async def main():
            first = asyncio.Event()
            async with AsyncClient(cluster.address, timeout=90) as client:
                tasks = [asyncio.ensure_future(_consume(client, p, i % 2 == 0, 150, first)) for i, p in enumerate(prompts)]
                await asyncio.wait_for(first.wait(), 30)
                victim = cluster.worker_pids[0]
                os.kill(victim, signal.SIGKILL)
                t0 = time.monotonic()
                results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
                return results, time.monotonic() - t0, await client.stats()

        results, elapsed, stats = asyncio.run(main())
        lost = ok = 0
        for kind, streamed, res in results:
            if isinstance(res, Completion):
                ok += 1
                assert res.finish_reason == "length" and len(res.token_ids) == 150
                if kind == "stream":
                    assert streamed == res.token_ids  # nothing duplicated, nothing missing
            else:
                assert isinstance(res, WorkerLostError), res
                assert res.code == "worker_lost"
                assert kind == "stream" and streamed  # only a stream that already got tokens fails
                lost += 1
        assert ok + lost == 40 and ok >= 20  # every non-streaming call was retried and finished
        router = stats["router"]["counters"]
        assert router["worker_deaths"] == 1
        assert router["retries"] >= 1 or lost == 20
        assert stats["router"]["gauges"]["inflight"] == 0
        assert sum(1 for w in stats["workers"].values() if w["alive"]) == 1
        with Client(cluster.address) as c:  # still serving on the survivor
            assert c.generate([5, 6, 7], max_tokens=3).usage.completion_tokens == 3
    finally:
        cluster.stop()


def test_overload_answers_at_once_and_sigterm_ends_every_call(llama_dir, tmp_path):
    log = tmp_path / "metrics.jsonl"
    cluster = Cluster(llama_dir, 1, "--max-inflight", "2", "--max-queue", "2", "--drain-timeout", "0.5", "--metrics-log", str(log), "--metrics-interval", "0.2")
    try:
        prompts = random_prompts([12] * 30, seed=4)

        async def timed(client, p, max_tokens):
            t0 = time.monotonic()
            try:
                res = await client.generate(p, max_tokens=max_tokens, **LONG)
            except RadixServeError as exc:
                res = exc
            return res, time.monotonic() - t0

        async def overload():
            async with AsyncClient(cluster.address, timeout=120) as client:
                return await asyncio.gather(*(timed(client, p, 300) for p in prompts))

        results = asyncio.run(overload())
        rejected = [(r, dt) for r, dt in results if isinstance(r, OverloadedError)]
        done = [r for r, _ in results if isinstance(r, Completion)]
        assert len(done) == 4 and len(rejected) == 26  # 2 in flight + 2 queued
        assert all(r.code == "overloaded" for r, _ in rejected)
        assert max(dt for _, dt in rejected) < 0.5
        with Client(cluster.address) as c:
            assert c.stats()["router"]["counters"]["overloaded"] == 26

        # SIGTERM with calls in flight and queued: each one gets a result or shutting_down.
        async def shutdown():
            async with AsyncClient(cluster.address, timeout=60) as client:
                tasks = [asyncio.ensure_future(timed(client, p, 1000)) for p in prompts[:4]]
                await asyncio.sleep(0.3)
                cluster.proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(*tasks), 30)

        results = asyncio.run(shutdown())
        for res, _ in results:
            assert isinstance(res, (Completion, ShuttingDownError)), res
        assert any(isinstance(r, ShuttingDownError) for r, _ in results)
        assert cluster.proc.wait(30) == 0
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert len(lines) >= 2 and {"time", "router", "workers"} <= set(lines[-1])
        assert lines[-1]["router"]["counters"]["overloaded"] == 26
    finally:
        cluster.stop()


def test_silent_worker_is_declared_dead_by_heartbeat(llama_dir):
    """A worker that stops answering (SIGSTOP: the process exists but says nothing) misses its
    heartbeats; its requests are restarted on the other worker and finish."""
    cluster = Cluster(llama_dir, 2, "--policy", "round_robin", "--heartbeat-timeout", "1.5")
    try:
        prompts = random_prompts([10 + i for i in range(10)], seed=8)

        async def main():
            async with AsyncClient(cluster.address, timeout=60) as client:
                # Stopped before the requests go out, so w0 surely holds some when it goes silent
                # (300 tokens of the tiny model take a fraction of a second: a stop after sending
                # could find w0 already done). Round robin still dispatches half of them to it.
                os.kill(cluster.pids["w0"], signal.SIGSTOP)
                tasks = [asyncio.ensure_future(client.generate(p, max_tokens=300, **LONG)) for p in prompts]
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
                return outs, await client.stats()

        outs, stats = asyncio.run(main())
        assert all(len(o.token_ids) == 300 for o in outs)
        assert stats["router"]["counters"]["worker_deaths"] == 1
        assert stats["router"]["counters"]["retries"] >= 1
        assert not stats["workers"]["w0"]["alive"]
    finally:
        try:
            os.kill(cluster.pids["w0"], signal.SIGCONT)
        except OSError:
            pass
        cluster.stop()
