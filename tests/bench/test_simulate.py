"""``python -m bench simulate``: bounds and policies against hand-worked traces, Belady against
brute force, ordering between policies and bounds, and the Mooncake acceptance numbers."""

from __future__ import annotations

import io
import itertools
import json
import os
import random
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from bench.sim import policies as P
from bench.sim.workloads import Request, Workload, agent_fleet, load_trace, multi_turn_chat, shared_prefix

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO / "bench" / "traces" / "mooncake" / "conversation_trace.jsonl"  # vendored, Apache-2.0


def write_mooncake(path: Path, rows: list[tuple[list[int], int]]) -> str:
    with open(path, "w") as f:
        for t, (ids, n) in enumerate(rows):
            f.write(json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n")
    return str(path)


# Five requests, 512-token blocks (the last block partial):
#   r0 [1,2,3] 1200 tokens   r1 [1,2,4] 1300   r2 [1,2,3] 1200   r3 [5] 100   r4 [1,6] 600
# Σ prompt tokens = 4400.
# Ideal: r0 0; r1 shares [1,2] -> 1024; r2 all three blocks seen -> min(1536, 1200-1) = 1199;
#        r3 0; r4 block 1 -> 512.  Σ 2735 -> 2735/4400 = 0.621590...
HAND = [([1, 2, 3], 1200), ([1, 2, 4], 1300), ([1, 2, 3], 1200), ([5], 100), ([1, 6], 600)]


@pytest.fixture()
def hand(tmp_path) -> Workload:
    return load_trace(write_mooncake(tmp_path / "hand.jsonl", HAND))


def test_ideal_hand_trace(hand):
    assert hand.unit_tokens == 512 and hand.prompt_tokens == 4400
    assert P.ideal(hand) == 2735


def test_radix_lru_hand_trace(hand):
    # Radix-LRU (the engine's RadixCache), capacity 3 blocks:
    #   r0 miss; caches node [1,2,3] (3 pages, full).
    #   r1 hits [1,2] = 1024; the node splits into [1,2]->[3]; [1,2] locked, 1 page needed, none
    #      free: evict leaf [3]; insert [4]: [1,2]->[4].
    #   r2 hits [1,2] = 1024 (its [3] was evicted); evict [4] (the only unlocked leaf), insert [3].
    #   r3 [5] miss; evict the only leaf [3]; cache [1,2], [5].
    #   r4 hits [1] = 512 (splits [1,2] into [1]->[2]); leaves [2] (used at r2) and [5] (r3):
    #      LRU evicts [2]; insert [6].
    # Σ 1024 + 1024 + 512 = 2560.
    assert P.radix(hand, 3, "lru") == 2560
    # Capacity 4: r1 needs 1 page and one is free, so [3] survives and r2 hits 1199; r3 evicts
    # [4] (last used r1, before [3] at r2); r4 evicts [3] ([1,2]->[3] touched r2, [5] r3).
    # Σ 1024 + 1199 + 512 = 2735 = the ideal.
    assert P.radix(hand, 4, "lru") == 2735
    # Belady at 3: after r1 drop [4] (never used again) and keep [1,2,3] -> r2 hits 1199; r3 and
    # r4 as LRU.  Σ 1024 + 1199 + 512 = 2735 > LRU's 2560.
    assert P.belady(hand, 3) == 2735
    # No reuse, no cache.
    assert P.radix(hand, 1000, "lfu") == 2735


def test_block_hash_tiny_case():
    # Token units, block 4, capacity 8 tokens = 2 blocks.
    #   r0 [1..10] (L=10): full blocks b1=[1-4], b2=[5-8]; hit 0. Queued tail first: b2, b1.
    #   r1 [1..9] (L=9): at most (9-1)//4 = 2 blocks; b1, b2 cached -> 8.
    #   r2 [1,2,3,4,20..24] (L=9): b1 hit, [20-23] not -> 4. Queue: b2, b3, b1 (3 > 2): evict b2.
    #   r3 [1..8, 30] (L=9): b1 hit, b2 evicted -> 4.
    # Σ 0 + 8 + 4 + 4 = 16 of 37 prompt tokens.
    seqs = [list(range(1, 11)), list(range(1, 10)), [1, 2, 3, 4, 20, 21, 22, 23, 24], list(range(1, 9)) + [30]]
    w = Workload("tiny", [Request(s, len(s), s, len(s)) for s in seqs], 1)
    assert P.block_hash(w, 8, 4) == 16
    # Without eviction pressure r3 would also hit b2: 0 + 8 + 4 + 8 = 20.
    assert P.block_hash(w, 400, 4) == 20
    # Block 512 on the hand trace (capacity 3 blocks): only full blocks count, at most
    # (L-1)//512: r1 [1,2] 1024, r2 [1,2] 1024 (its block 3 is partial), r4 [1] 512 -> 2560.


def test_block_hash_hand_trace(hand):
    assert P.block_hash(hand, 3 * 512, 512) == 2560
    # Block 16: a 512-block is 32 sub-blocks; a partial block holds (tokens // 16) full ones
    # (block 3 of r0/r2: 176 tokens -> 11, block 4: 276 -> 17, block 5: 100 -> 6, block 6: 5).
    # Capacity 3 x 512 tokens = 96 sub-blocks: r0 stores 32+32+11 = 75; r1 hits 64 sub-blocks
    # (1024) and adds 17 (92, no eviction); r2 hits 32+32+11 = 75, capped at (1200-1)//16 = 74
    # -> 1184; r3 adds 6 (98: 2 evicted from the oldest, block 4); r4 hits block 1 -> 512.
    # Σ 1024 + 1184 + 512 = 2720 (more than block 512: the partial block's full sub-blocks).
    assert P.block_hash(hand, 3 * 512, 16) == 2720
    # Capacity 80 sub-blocks: r1's 17 new push 92 > 80: evict the oldest (tail-first order
    # leaves r0's block 3 oldest): all 11 of block 3 and 1 of block 4. r2 then hits 1024 only.
    # r4 still hits 512. Σ 1024 + 1024 + 512 = 2560.
    assert P.block_hash(hand, 80 * 16, 16) == 2560


def test_slots_hand_trace(hand):
    # 2 slots of 100 units each: r0 -> slot A; r1 LCP 2 with A -> A (hit 1024, A = [1,2,4]);
    # r2 LCP 2 with A -> 1024, A = [1,2,3]; r3 no LCP -> LRU slot B (empty); r4 LCP 1 with A -> 512.
    assert P.slots(hand, 200, 2) == 1024 + 1024 + 512


def test_lpm_hand_trace(hand):
    # Window 5 (everything): after r0, r2 (full match, 3 blocks) goes first: 1199; then r1 and r4
    # (LCP 2 vs 1): r1 1024, r4 512; r3 last, 0. Capacity 10: nothing evicted. Σ 2735.
    order: list[int] = []
    assert P.radix_lpm(hand, 10, 5, order=order) == 2735 and order == [0, 2, 1, 4, 3]
    # Capacity 3: r2 1199 (nothing evicted yet); r1 1024 evicts [3] for [4]; r4 (LCP 1) then r3:
    # r4 hits 512 and evicts [4] (the only unlocked leaf) for [6]; r3 0.  Σ 2735 > LRU's 2560.
    assert P.radix_lpm(hand, 3, 5) == 2735
    # Window 0: every request has its own timestamp, so arrival order: plain LRU.
    assert P.radix_lpm(hand, 3, 0) == P.radix(hand, 3) == 2560


def random_workload(seed: int, n: int = 40) -> Workload:
    """Prompts are random paths in a small random tree (lots of partial sharing), plus outputs."""
    rnd = random.Random(seed)
    trunks = [[rnd.randrange(1, 50) for _ in range(rnd.randrange(1, 12))] for _ in range(5)]
    reqs = []
    for _ in range(n):
        base = list(rnd.choice(trunks))
        base += [rnd.randrange(1, 6) for _ in range(rnd.randrange(0, 6))]
        out = [rnd.randrange(1, 6) for _ in range(rnd.randrange(0, 3))]
        if rnd.random() < 0.3:
            rnd.choice(trunks).extend(out)
        reqs.append(Request(base, len(base), base + out, len(base) + len(out)))
    return Workload(f"random{seed}", reqs, 1)


def brute_force_optimum(w: Workload, capacity: int) -> int:
    """Best token hits over every caching choice: after each request keep any subset of
    (cache ∪ the request's units) of at most ``capacity`` units (exhaustive)."""
    paths = w.paths()
    states = {frozenset(): 0}
    for r, p in zip(w.requests, paths):
        n = r.access_units(1)
        nxt: dict = {}
        for s, v in states.items():
            h = 0
            while h < n and p[h] in s:
                h += 1
            v += r.hit_tokens(h, 1)
            pool = sorted(s | set(p))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    keep = frozenset(keep)
                    if nxt.get(keep, -1) < v:
                        nxt[keep] = v
        states = nxt
    return max(states.values())


def test_belady_is_optimal_on_tiny_traces():
    for seed in range(6):
        rnd = random.Random(seed)
        seqs = []
        for _ in range(7):
            seqs.append([rnd.randrange(1, 3) for _ in range(rnd.randrange(2, 5))])
        w = Workload("t", [Request(s, len(s), s, len(s)) for s in seqs], 1)
        for cap in (1, 2, 3):
            assert P.belady(w, cap) == brute_force_optimum(w, cap), (seed, cap)


def test_bounds_dominate_policies():
    for seed in range(8):
        w = random_workload(seed)
        ideal = P.ideal(w)
        for cap in (3, 8, 20, 60):
            b = P.belady(w, cap)
            assert b <= ideal
            for name, got in [
                ("lru", P.radix(w, cap, "lru")),
                ("lfu", P.radix(w, cap, "lfu")),
                ("vllm4", P.block_hash(w, cap, 4)),
                ("vllm2", P.block_hash(w, cap, 2)),
                ("slots", P.slots(w, cap, 2)),
            ]:
                # token units: every unit is worth one token, so Belady is the exact optimum
                assert got <= b, (seed, cap, name, got, b)
            order: list[int] = []
            lpm = P.radix_lpm(w, cap, 4, order=order)
            assert sorted(order) == list(range(len(w.requests)))
            assert lpm <= P.ideal(w, order)
        assert P.radix(w, 10**6) == ideal  # an unbounded radix tree is the ideal


def test_routers_bounded_by_pooled_cache():
    w = shared_prefix(groups=6, prompts=4, system_tokens=64, question_tokens=8, output_tokens=8, seed=1)
    pooled = P.belady(w, 4 * 48)
    got = {}
    for rt in P.ROUTINGS:
        hit, per = P.route(w, 4, 48, rt)
        assert sum(per) == len(w.requests)
        assert hit <= pooled
        got[rt] = hit
    assert got["cache_aware_exact"] > got["round_robin"]
    assert got["cache_aware_approx"] > got["round_robin"]


def test_generated_workloads():
    # SGLang defaults (64 groups; 8 here for speed: the ratio does not depend on the group
    # count): the first prompt of a group misses, the other 15 hit the 2048-token prefix of
    # their 2048 + 128 tokens: ideal = 15/16 * 2048/2176 ≈ 0.882.
    w = shared_prefix(groups=8)
    assert len(w.requests) == 128
    assert P.ideal(w) / w.prompt_tokens == pytest.approx(15 * 2048 / (16 * 2176), abs=1e-3)
    f = agent_fleet(agents=4, system_tokens=32, private_tokens=8, turns=3, output_tokens=2, observation_tokens=3)
    assert [r.prompt_tokens for r in f.requests] == [40] * 4 + [45] * 4 + [50] * 4
    assert f.requests[4].units[:42] == f.requests[0].stored and f.requests[4].after == 0
    # turn 1+ hits everything but its new observation... capped at len-1
    assert P.ideal(f) == 4 * 32 + 4 * 42 + 4 * 47 - 32  # first agent's turn 0 misses the system prompt
    c = multi_turn_chat(conversations=3, turns=4)
    assert len(c.requests) == 12 and all(r.after < i for i, r in enumerate(c.requests))


def test_weka_sessions_share_nothing(tmp_path):
    sess = {
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "n", "in": 200, "out": 5, "hash_ids": [1, 2, 3]},
            {"t": 5.0, "type": "n", "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4]},
        ],
    }
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(sess))
    w = load_trace(str(tmp_path))
    assert len(w.requests) == 4 and w.unit_tokens == 64
    # Per session: the second request hits blocks 1-3 = 192 tokens; the other session's
    # identical ids are different blocks, so each session's first request misses.
    assert P.ideal(w) == 2 * 192
    assert [r.after for r in w.requests] == [-1, -1, 0, 1]


def run_cli(argv: list[str]) -> dict:
    from bench.__main__ import main

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(buf.getvalue())


def test_cli_hand_trace(hand, tmp_path, monkeypatch):
    path = write_mooncake(tmp_path / "h.jsonl", HAND)
    monkeypatch.chdir(tmp_path)
    res = run_cli(["--trace", "h.jsonl", "--capacity-blocks", "3,4", "--workers", "1"])
    assert res["ideal"] == pytest.approx(2735 / 4400)
    rows = {(r["policy"], r["capacity"]): r for r in res["rows"]}
    assert rows[("radix-lru", 3)]["hit_rate"] == pytest.approx(2560 / 4400)
    assert rows[("belady", 3)]["hit_rate"] == pytest.approx(2735 / 4400)
    assert rows[("none", 4)]["hit_rate"] == 0
    res = run_cli(["--trace", path, "--capacity-blocks", "2", "--workers", "2"])
    assert {r["policy"] for r in res["rows"]} >= {"round_robin x2", "cache_aware_exact x2", "pooled belady (N*C)"}


def independent_mooncake_ideal(path: Path, limit: int | None = None) -> tuple[float, float]:
    """(token-weighted, block-weighted) infinite-cache hit rate straight from the file: chained
    ids, so a block id seen before means its whole prefix was seen."""
    seen: set[int] = set()
    hit_t = tot_t = hit_b = tot_b = 0
    with open(path) as f:
        for k, line in enumerate(f):
            if limit and k >= limit:
                break
            d = json.loads(line)
            ids, n = d["hash_ids"], d["input_length"]
            h = 0
            while h < len(ids) and ids[h] in seen:
                h += 1
            hit_t += min(512 * h, n - 1)
            tot_t += n
            hit_b += h
            tot_b += len(ids)
            seen.update(ids)
    return hit_t / tot_t, hit_b / tot_b


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not available")
def test_mooncake_acceptance(monkeypatch):
    token_w, block_w = independent_mooncake_ideal(MOONCAKE)
    assert block_w == pytest.approx(0.366, abs=0.002)  # the trace README's figure
    assert token_w == pytest.approx(0.374, abs=0.005)  # bench/traces/README.md
    monkeypatch.chdir(REPO)
    rel = os.path.relpath(MOONCAKE, REPO)  # bench/traces/... : relative paths resolve normally
    res = run_cli(["--trace", rel, "--capacity-blocks", "5860", "--policies", "radix-lru,belady"])
    assert res["ideal"] == pytest.approx(0.374, abs=0.005)
    assert res["ideal"] == pytest.approx(token_w, abs=1e-12)
    rows = {r["policy"]: r for r in res["rows"]}
    lru, bel = rows["radix-lru"]["hit_rate"], rows["belady"]["hit_rate"]
    assert 0 < lru < bel <= res["ideal"]
    assert lru < res["ideal"] / 2  # Mooncake paper: a 3M-token LRU cache gets under half the ideal


@pytest.mark.skipif(not MOONCAKE.with_name("synthetic_trace.jsonl").exists(), reason="trace not available")
def test_mooncake_synthetic_ideal():
    path = MOONCAKE.with_name("synthetic_trace.jsonl")
    token_w, block_w = independent_mooncake_ideal(path)
    assert block_w == pytest.approx(0.640, abs=0.002)  # trace README
    assert token_w == pytest.approx(0.651, abs=0.005)  # bench/traces/README.md
    w = load_trace(str(path))
    assert P.ideal(w) / w.prompt_tokens == pytest.approx(token_w, abs=1e-12)
