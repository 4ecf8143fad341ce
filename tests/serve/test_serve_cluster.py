"""Router + 2 worker processes on loopback: concurrency, correctness, errors, stats, joining."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from radixserve import Engine, SamplingParams
from radixserve import protocol as P
from radixserve.client import AsyncClient, Client, Completion
from radixserve.errors import BadRequestError, TooLongError

from conftest import random_prompts
from serve_cluster import ENV, Cluster

pytestmark = pytest.mark.timeout(300)

GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(llama_dir):
    c = Cluster(llama_dir, 2, "--policy", "cache_aware")
    yield c
    c.stop()


def _prompts(n: int) -> list[list[int]]:
    shared = random_prompts([48], seed=99)[0]
    lengths = [8 + (i * 7) % 40 for i in range(n)]
    tails = random_prompts(lengths, seed=1)
    # a third share a long prefix (cache hits), the rest are unrelated
    return [(shared + t) if i % 3 == 0 else t for i, t in enumerate(tails)]


def test_200_concurrent_calls_match_the_engine(cluster, llama_dir):
    prompts = _prompts(200)
    engine = Engine(llama_dir, kv_cache_tokens=8192)
    expected = [o.token_ids for o in engine.generate(prompts, SamplingParams(**GREEDY))]

    async def main():
        async with AsyncClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(client.generate(p, **GREEDY) for p in prompts))

    t0 = time.monotonic()
    outs = asyncio.run(main())
    assert time.monotonic() - t0 < 120
    for p, out, exp in zip(prompts, outs, expected):
        assert isinstance(out, Completion)
        assert out.token_ids == exp
        assert out.finish_reason == "length"
        assert out.usage.prompt_tokens == len(p)
        assert out.usage.completion_tokens == 6
        assert 0 <= out.usage.cached_tokens <= len(p) - 1
        assert 0 <= out.timings.queue_s <= out.timings.ttft_s <= out.timings.e2e_s
    assert sum(o.usage.cached_tokens for o in outs) > 0  # the shared prefix hit somewhere
    with Client(cluster.address) as c:
        stats = c.stats()
    assert stats["router"]["counters"]["completed"] >= 200
    assert sum(w["routed"] for w in stats["workers"].values()) >= 200


def test_sync_client_from_threads_stream_and_batch(cluster):
    prompts = random_prompts([12, 20, 30, 16, 25, 9], seed=5)
    results: dict[int, tuple] = {}
    with Client(cluster.address, timeout=60) as client:

        def run(i):
            chunks = list(client.stream(prompts[i], **GREEDY))
            results[i] = (chunks, client.generate(prompts[i], **GREEDY))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        batch = client.batch(prompts, **GREEDY)
        text = client.generate("Play e2e4 or d2d4?", max_tokens=4, temperature=0.0)
    assert text.usage.prompt_tokens > 0 and text.usage.completion_tokens >= 1
    for i in range(len(prompts)):
        chunks, final = results[i]
        *parts, last = chunks
        assert isinstance(last, Completion)
        streamed = [t for c in parts for t in c.token_ids]
        assert streamed == last.token_ids == final.token_ids == batch[i].token_ids  # no duplicates
        assert "".join(c.text for c in parts) == last.text


def test_bad_requests_are_typed_errors(cluster):
    with Client(cluster.address, timeout=30) as c:
        with pytest.raises(BadRequestError) as e:
            c.generate("", max_tokens=4)
        assert e.value.code == "bad_request"
        with pytest.raises(BadRequestError, match="max_tokens"):
            c.generate([5, 6, 7], max_tokens=0)
        with pytest.raises(BadRequestError, match="max_tokens"):
            c.generate([5, 6, 7], max_tokens=10**9)
        with pytest.raises(BadRequestError, match="vocabulary"):
            c.generate([5, 6, 10**6], max_tokens=2)
        with pytest.raises(TooLongError) as e:
            c.generate([5] * 2000, max_tokens=2)  # the tiny model's context is 1024
        assert e.value.code == "too_long"
        with pytest.raises(BadRequestError, match="sampling parameter"):
            c.generate([5, 6], max_tokenz=3)
        assert c.health()["status"] == "ok"


def _raw_roundtrip(address: str, frames: list[bytes], timeout_ms: int = 5000) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "no reply from the router"
        return msgspec.msgpack.decode(s.recv())
    finally:
        s.close()


def test_malformed_and_oversized_frames_get_error_replies(cluster):
    addr = cluster.address
    r = _raw_roundtrip(addr, [b"\xc1 not msgpack"])
    assert r["type"] == "error" and r["code"] == "bad_request"
    r = _raw_roundtrip(addr, [msgspec.msgpack.encode({"type": "generate", "id": "x1", "prompt": 5})])
    assert r["type"] == "error" and r["code"] == "bad_request" and r["id"] == "x1"
    r = _raw_roundtrip(addr, [msgspec.msgpack.encode({"type": "nonsense", "id": "x2"})])
    assert r["code"] == "bad_request" and r["id"] == "x2"
    r = _raw_roundtrip(addr, [P.encode(P.Health(id="x3", v=P.PROTOCOL_VERSION + 1))])
    assert r["code"] == "bad_request" and r["id"] == "x3" and "version" in r["message"]
    big = P.encode(P.Generate(id="x4", prompt="a" * (5 * 2**20)))
    r = _raw_roundtrip(addr, [big])
    assert r["code"] == "bad_request" and "limit" in r["message"]
    r = _raw_roundtrip(addr, [b"a", b"b"])
    assert r["code"] == "bad_request"
    r = _raw_roundtrip(addr, [P.encode(P.Generate(id="x5", token_ids=[1] * (P.DEFAULT_LIMITS.max_prompt_tokens + 1)))])
    assert r["code"] == "too_long" and r["id"] == "x5"
    r = _raw_roundtrip(addr, [P.encode(P.Generate(id="x6", token_ids=[3, 4], params=SamplingParams(stop=["x"] * 40)))])
    assert r["code"] == "bad_request" and "stop" in r["message"]
    # a worker-only message from a client is refused too
    r = _raw_roundtrip(addr, [P.encode(P.Work(id="x7", token_ids=[1], params=SamplingParams()))])
    assert r["code"] == "bad_request"
    with Client(addr) as c:  # still serving
        assert c.health()["status"] == "ok"
        assert c.generate([7, 8, 9], max_tokens=2).usage.completion_tokens == 2
        assert c.stats()["router"]["counters"]["bad_frames"] >= 4


def test_stats_command_prints_json_and_prometheus(cluster):
    deadline = time.monotonic() + 10
    while True:  # a worker's engine stats come with its heartbeats (every 0.5 s): wait for each one's first
        out = subprocess.run([sys.executable, "-m", "radixserve.cli", "stats", cluster.address], capture_output=True, text=True, timeout=60, env=ENV)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        if all(w["engine"] for w in stats["workers"].values()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert set(stats) >= {"router", "workers"}
    router = stats["router"]
    assert {"ttft_s", "e2e_s", "queue_depth_at_arrival"} <= set(router["histograms"])
    assert {"queue_depth", "inflight", "workers_alive"} <= set(router["gauges"])
    assert "overloaded" in router["counters"]
    for w in stats["workers"].values():
        assert {"kv_used_tokens", "kv_evictable_tokens", "prefix_query_tokens", "prefix_hit_tokens", "preemptions", "running", "waiting"} <= set(w["engine"])
        assert "inflight" in w and "index_tokens" in w
    prom = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "stats", cluster.address, "--format", "prometheus"], capture_output=True, text=True, timeout=60, env=ENV
    )
    assert prom.returncode == 0, prom.stderr
    assert "radixserve_router_requests_total" in prom.stdout
    assert 'radixserve_worker_kv_used_tokens{worker="w0"}' in prom.stdout


def test_timeout_aborts(cluster):
    from radixserve.errors import RequestTimeoutError

    with Client(cluster.address) as c:
        with pytest.raises(RequestTimeoutError):
            c.generate([5, 6, 7], max_tokens=1000, ignore_eos=True, timeout=0.05)
        assert c.generate([5, 6, 7], max_tokens=2).finish_reason == "length"


def test_external_worker_joins_and_gets_traffic(cluster, llama_dir):
    """Last in this module: it changes the cluster (a third worker joins, then leaves)."""
    proc = cluster.start_worker(llama_dir, "ext")
    with Client(cluster.address, timeout=60) as c:
        c.wait_ready(3, timeout=90)
        outs = c.batch(random_prompts([10 + i for i in range(12)], seed=11), **GREEDY)
        assert "ext" in {o.worker for o in outs}
        proc.terminate()  # SIGTERM: drains and says goodbye
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while c.stats()["workers"]["ext"]["alive"] and not c.stats()["workers"]["ext"]["draining"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        outs = c.batch(random_prompts([10 + i for i in range(6)], seed=12), **GREEDY)
        assert all(o.worker != "ext" for o in outs)
