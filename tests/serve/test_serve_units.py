"""Serving pieces without processes: wire protocol, cache-event mirror, policies, metrics."""

from __future__ import annotations

import random

import msgspec
import pytest

from radixserve import protocol as P
from radixserve.errors import BadRequestError, OverloadedError, TooLongError, WorkerLostError, error_from_code
from radixserve.kv.radix import RadixCache
from radixserve.sampling_params import SamplingParams
from radixserve.serve.metrics import Histogram, prometheus_text
from radixserve.serve.routing import CacheAware, CacheIndex, Candidate, RoundRobin, common_prefix_len


# ------------------------------------------------------------------ protocol
def test_messages_round_trip_as_tagged_msgpack():
    msgs = [
        P.Generate(id="a", prompt="hi", params=SamplingParams(max_tokens=3, temperature=0.0, stop=["x"]), namespace="t"),
        P.Generate(id="b", token_ids=[1, 2, 3], stream=True),
        P.Final(
            id="a",
            token_ids=[4],
            text="x",
            finish_reason="length",
            usage=P.Usage(prompt_tokens=3, cached_tokens=1, completion_tokens=1),
            timings=P.Timings(queue_s=0.0, ttft_s=0.1, e2e_s=0.2),
            worker="w0",
        ),
        P.Error(id="a", code=P.OVERLOADED, message="busy"),
        P.CacheEvents(worker="w0", events=[P.CacheEvent("insert", None, [1, 2]), P.CacheEvent("evict", "t", [1, 2], 1)]),
        P.Register(worker="w0", pid=1),
        P.Heartbeat(worker="w0", stats={"running": 1}),
        P.Ping(),
        P.Shutdown(),
    ]
    for m in msgs:
        frame = P.encode(m)
        assert msgspec.msgpack.decode(frame)["type"]  # tagged, plain msgpack: no pickle
        assert P.decode(frame) == m


def test_decode_errors_carry_the_request_id_when_readable():
    with pytest.raises(P.DecodeError) as e:
        P.decode(b"\xc1")
    assert e.value.request_id == "" and e.value.code == "bad_request"
    with pytest.raises(P.DecodeError) as e:
        P.decode(msgspec.msgpack.encode({"type": "generate", "id": "r7", "token_ids": "nope"}))
    assert e.value.request_id == "r7"
    with pytest.raises(P.DecodeError, match="version"):
        P.decode(P.encode(P.Health(id="r8", v=99)))
    with pytest.raises(P.DecodeError, match="limit"):
        P.decode(b"x" * 100, max_frame_bytes=10)


def test_generate_validation_bounds_every_size():
    limits = P.Limits(max_prompt_tokens=10, max_tokens=100, max_prompt_chars=20)
    ok = P.Generate(id="a", token_ids=[1, 2])
    P.validate_generate(ok, limits)
    bad = [
        P.Generate(id="", token_ids=[1]),
        P.Generate(id="a"),
        P.Generate(id="a", prompt="x", token_ids=[1]),
        P.Generate(id="a", prompt=""),
        P.Generate(id="a", prompt="x" * 21),
        P.Generate(id="a", token_ids=[]),
        P.Generate(id="a", token_ids=[1], params=SamplingParams(max_tokens=101)),
        P.Generate(id="a", token_ids=[1], params=SamplingParams(stop=["s"] * 17)),
        P.Generate(id="a", token_ids=[1], params=SamplingParams(stop_token_ids=list(range(65)))),
        P.Generate(id="a", token_ids=[1], params=SamplingParams(temperature=-1.0)),
        P.Generate(id="a", token_ids=[1], namespace="n" * 1000),
    ]
    for msg in bad:
        with pytest.raises(BadRequestError):
            P.validate_generate(msg, limits)
    with pytest.raises(TooLongError):
        P.validate_generate(P.Generate(id="a", token_ids=[1] * 11), limits)


def test_error_codes_map_to_exception_classes():
    assert isinstance(error_from_code("overloaded", "busy"), OverloadedError)
    e = error_from_code("worker_lost", "gone")
    assert isinstance(e, WorkerLostError) and e.code == "worker_lost" and str(e) == "gone"
    e = error_from_code("too_long", "prompt: 9 tokens")
    assert isinstance(e, TooLongError) and isinstance(e, ValueError) and e.field == "prompt"
    assert error_from_code("weird", "x").code == "weird"


# ------------------------------------------------------------------ cache-event mirror
class _Pool:
    def __init__(self):
        self.next = 0

    def alloc(self, n):
        self.next += n
        return list(range(self.next - n, self.next))

    def free(self, pages):
        pass


def _paths(tree: RadixCache) -> set:
    """Every cached (namespace, token path) ending at a leaf."""
    out = set()
    stack = [(c, [], c.namespace) for c in tree.root.children.values()]
    while stack:
        node, prefix, ns = stack.pop()
        path = prefix + node.key
        if node.is_leaf:
            out.add((ns, tuple(path)))
        stack.extend((c, path, ns) for c in node.children.values())
    return out


@pytest.mark.parametrize("seed", range(5))
def test_index_mirrors_a_radix_cache_through_its_events(seed):
    rng = random.Random(seed)
    pool = _Pool()
    real = RadixCache(1, pool)
    mirror = CacheIndex()
    events = []
    real.on_event = events.append  # set after construction, as the worker does
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    for _ in range(300):
        op = rng.random()
        if op < 0.6:
            seq = list(rng.choice(bases)) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            ns = rng.choice([None, "t"])
            already = real.insert(seq, pool.alloc(len(seq)), ns)
            m = real.match(seq, ns)  # splits, as the engine's re-match does
            if rng.random() < 0.3:
                real.lock(m.node)
                real.unlock(m.node)
            assert already <= len(seq)
        else:
            real.evict(rng.randrange(1, 40))
        for ev in events:
            if ev[0] == "insert":
                mirror.insert(ev[1], ev[2])
            else:
                mirror.evict(ev[1], ev[2], ev[3])
        events.clear()
        assert mirror.tokens == real.total_pages
        assert _paths(mirror.tree) == _paths(real)
    real.check_integrity()


def test_on_event_none_costs_nothing_and_reports_paths():
    pool = _Pool()
    tree = RadixCache(2, pool)
    assert tree.on_event is None
    tree.insert([1, 2, 3, 4], pool.alloc(2))
    got = []
    tree.on_event = got.append
    tree.insert([1, 2, 5, 6], pool.alloc(2), "ns")
    tree.insert([1, 2, 5, 6, 7, 8], pool.alloc(3), "ns")
    assert got == [("insert", "ns", [1, 2, 5, 6]), ("insert", "ns", [1, 2, 5, 6, 7, 8])]
    got.clear()
    tree.evict(100)
    assert ("evict", "ns", [1, 2, 5, 6, 7, 8], 2) in got and ("evict", None, [1, 2, 3, 4], 4) in got
    assert ("evict", "ns", [1, 2, 5, 6], 4) in got


def test_pending_prefixes_count_until_dropped():
    idx = CacheIndex()
    idx.add_pending("1.1", None, [1, 2, 3, 4, 5])
    assert idx.match(None, [1, 2, 3, 9]) == 3
    assert idx.match("other", [1, 2, 3, 9]) == 0
    idx.drop_pending("1.1")
    assert idx.match(None, [1, 2, 3, 9]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2 and common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


# ------------------------------------------------------------------ policies
def _cands(loads, cached=None):
    out = []
    for i, load in enumerate(loads):
        c = Candidate(f"w{i}", load)
        if cached and i in cached:
            c.index.insert(None, cached[i])
        out.append(c)
    return out


def test_cache_aware_prefers_the_cached_prefix_unless_imbalanced():
    tokens = list(range(100))
    policy = CacheAware(balance_abs=4, balance_rel=1.5, cache_threshold=0.3)
    d = policy.choose(_cands([3, 0], {0: tokens[:80]}), tokens, None)
    assert (d.worker, d.reason, d.matched) == ("w0", "cache_hit", 80)
    d = policy.choose(_cands([9, 0], {0: tokens[:80]}), tokens, None)  # 9 - 0 > 4 and 9 > 0
    assert (d.worker, d.reason) == ("w1", "load_balance")
    d = policy.choose(_cands([2, 1], {0: tokens[:10]}), tokens, None)  # 10% < threshold
    assert (d.worker, d.reason) == ("w1", "least_load")
    d = policy.choose(_cands([0, 0], {0: [500] * 50}), tokens, None)  # tie: the smaller tree
    assert d.worker == "w1"
    rr = RoundRobin()
    assert [rr.choose(_cands([0, 0, 0]), tokens, None).worker for _ in range(4)] == ["w0", "w1", "w2", "w0"]


# ------------------------------------------------------------------ metrics
def test_histogram_and_prometheus_text():
    h = Histogram()
    for v in (0.002, 0.003, 0.2, 7.0):
        h.observe(v)
    d = h.to_dict()
    assert d["count"] == 4 and d["p50"] == 0.005 and d["p99"] == 10.0
    stats = {
        "router": {"counters": {"requests": 4}, "gauges": {"queue_depth": 1}, "histograms": {"ttft_s": d}},
        "workers": {"w0": {"engine": {"kv_used_tokens": 10, "preemptions": 0}, "inflight": 1, "alive": True, "index_tokens": 5, "histograms": {}}},
    }
    text = prometheus_text(stats)
    assert "radixserve_router_requests_total 4.0" in text
    assert 'radixserve_router_ttft_s_bucket{le="+Inf"} 4' in text
    assert 'radixserve_worker_kv_used_tokens{worker="w0"} 10.0' in text


def test_prometheus_text_types_buckets_and_worker_labels():
    import radixserve.serve.metrics as M

    h = Histogram()
    h.observe(0.1)
    text = M.prometheus_text(
        {
            "router": {"counters": {"requests": 2}, "gauges": {}, "histograms": {"ttft_s": h.to_dict()}},
            "workers": {"w0": {"engine": {"running": 1}, "histograms": {"e2e_s": h.to_dict()}}},
        }
    )
    assert "# TYPE radixserve_router_requests_total counter" in text
    assert 'radixserve_router_ttft_s_bucket{le="0.1"} 1' in text
    assert 'radixserve_worker_running{worker="w0"} 1.0' in text
    assert 'radixserve_worker_e2e_s_count{worker="w0"} 1' in text


def test_gateway_metrics_count_and_text():
    from radixserve.serve.metrics import GatewayMetrics

    inflight = [2]
    m = GatewayMetrics(lambda: inflight[0])
    live = m.by_route()  # a live view: later answers show up in it
    m.count("chat", 200)
    m.count("chat", 200)
    m.count("completions", 400)
    assert live.get(("chat", 200)) == 2 and live[("completions", 400)] == 1 and live.get(("chat", 499), 0) == 0
    inflight[0] = 5
    text = m.text()
    assert 'radixserve_http_requests_total{route="chat",status="200"} 2.0' in text
    assert "# TYPE radixserve_http_inflight gauge" in text and "radixserve_http_inflight 5.0" in text
