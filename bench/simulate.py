"""Prefix-cache simulator: hit rates of cache policies on a workload, no model, in seconds.

Requests are sequences of units: tokens for the generated workloads (agent fleet, generated
shared prefix, multi-turn chat), blocks for trace files (Mooncake: 512-token chained hash ids;
WEKA: 64-token blocks, ids namespaced per session). Requests are served one at a time in
arrival order (the closed loop of an agent fleet approximated by round robin over the agents
per turn); each caches its prompt (and, for generated workloads, its output) when it finishes.

Hit rates are token-weighted: Σ hit tokens / Σ prompt tokens, a request with h cached leading
units hitting min(h x unit, prompt - 1) tokens (the last prompt token is always computed).

Policies (capacity in units: blocks for traces, tokens otherwise):
  none           no cache
  radix-lru/lfu  the engine's RadixCache (radixserve.kv.radix) with each eviction policy it offers
  radix-lru+lpm  radix-LRU, longest-prefix-first among a window of W waiting requests
  vllm-16/128    vLLM-style hash chain over full 16/128-token blocks, LRU over blocks (tail first)
  slots-N        llama.cpp -np N: per-slot longest-common-prefix reuse, capacity split over slots
  belady         MIN over the tree of units at the same capacity (furthest next use first, ties
                 deepest, with bypass): the optimum for unit-count hits, the reference bound for
                 token-weighted hits
  ideal          infinite cache: longest prefix of anything earlier (the % of ideal column)

With --workers N (capacity per worker C): radix-LRU workers behind a router (round_robin,
least_load = fewest prompt tokens assigned so far, cache_aware_approx = SGLang's router with a
router-side tree per worker of what it routed and no eviction feedback, cache_aware_exact = the
same rule on each worker's actual RadixCache), each against one pooled cache of N*C (radix-LRU
and Belady).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.common import emit, fmt, int_list, log, table

HELP = "prefix-cache simulator: policies, bounds and routers on workloads and traces (no model)"

ALL_POLICIES = ["none", "radix-lru", "radix-lfu", "radix-lru+lpm", "vllm-16", "vllm-128", "slots", "belady"]


def _float_list(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return vals


def _str_list(choices):
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {', '.join(choices)}")
        return vals

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench.sim.policies import ROUTINGS

    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, metavar="PATH", help="Mooncake .jsonl, WEKA session .json, or a directory of either (overrides --workload)")
    w.add_argument("--trace-limit", type=int, default=None, metavar="N", help="only the first N requests")
    w.add_argument("--workload", choices=["fleet", "gsp", "chat"], default="fleet")
    w.add_argument("--agents", type=int, default=64, help="fleet: agents")
    w.add_argument("--turns", type=int, default=None, help="fleet: turns per agent (4); chat: per conversation (8)")
    w.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (fleet 2048, gsp 2048 per group, chat 256)")
    w.add_argument("--private-tokens", type=int, default=128, help="fleet: private state per agent")
    w.add_argument("--observation-tokens", type=int, default=16, help="fleet: observation per turn")
    w.add_argument("--output-tokens", type=int, default=None, help="output per request (fleet 8, gsp 256, chat 128)")
    w.add_argument("--groups", type=int, default=64, help="gsp: groups")
    w.add_argument("--prompts-per-group", type=int, default=16, help="gsp: prompts per group")
    w.add_argument("--question-tokens", type=int, default=128, help="gsp: question per prompt")
    w.add_argument("--conversations", type=int, default=32, help="chat: conversations")
    w.add_argument("--user-tokens", type=int, default=64, help="chat: user message per turn")
    w.add_argument("--seed", type=int, default=7)
    c = p.add_argument_group("cache")
    c.add_argument(
        "--capacity-blocks",
        type=int_list,
        default=None,
        metavar="LIST",
        help="capacities in units (trace blocks; tokens for generated workloads), comma-separated",
    )
    c.add_argument("--capacity-tokens", type=int_list, default=None, metavar="LIST", help="capacities in tokens (rounded down to whole units)")
    c.add_argument(
        "--capacity-fraction",
        type=_float_list,
        default=[0.1, 0.25, 0.5],
        metavar="LIST",
        help="when no capacity is given: fractions of the workload's distinct units",
    )
    c.add_argument("--policies", type=_str_list(ALL_POLICIES), default=ALL_POLICIES, metavar="LIST", help=f"comma-separated subset of {','.join(ALL_POLICIES)}")
    c.add_argument(
        "--lpm-window",
        type=int,
        default=32,
        metavar="W",
        help="radix-lru+lpm: waiting requests reordered by cached prefix (0: those with the same arrival time)",
    )
    c.add_argument("--slots", type=int, default=4, metavar="N", help="llama.cpp slots (capacity split between them)")
    r = p.add_argument_group("routing")
    r.add_argument("--workers", type=int, default=1, metavar="N", help="N > 1: N radix-LRU workers of the given capacity each, behind each router")
    r.add_argument("--routing", type=_str_list(ROUTINGS), default=list(ROUTINGS), metavar="LIST", help=f"comma-separated subset of {','.join(ROUTINGS)}")
    r.add_argument("--cache-threshold", type=float, default=0.5, help="cache_aware: minimum match / prompt to follow the match")
    r.add_argument("--balance-rel", type=float, default=1.5, help="cache_aware: loads are imbalanced when max > rel * min ...")
    r.add_argument("--balance-abs", type=int, default=0, help="... and max - min > abs (prompt tokens)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")


def build_workload(args):
    from bench.sim import workloads as W

    if args.trace:
        return W.load_trace(args.trace, args.trace_limit)
    if args.workload == "fleet":
        return W.agent_fleet(
            args.agents, args.system_tokens or 2048, args.private_tokens, args.turns or 4, args.output_tokens or 8, args.observation_tokens, args.seed
        )
    if args.workload == "gsp":
        return W.shared_prefix(args.groups, args.prompts_per_group, args.system_tokens or 2048, args.question_tokens, args.output_tokens or 256, args.seed)
    return W.multi_turn_chat(args.conversations, args.turns or 8, args.system_tokens or 256, args.user_tokens, args.output_tokens or 128, args.seed)


def capacities(args, w) -> list[int]:
    U = w.unit_tokens
    caps = list(args.capacity_blocks or [])
    caps += [max(1, t // U) for t in (args.capacity_tokens or [])]
    if not caps:
        caps = [max(1, int(f * w.distinct_units)) for f in args.capacity_fraction]
    return list(dict.fromkeys(caps))


def simulate(args) -> dict:
    from bench.sim import policies as P

    t0 = time.perf_counter()
    w = build_workload(args)
    w.paths()
    U, total = w.unit_tokens, w.prompt_tokens
    ideal_hit = P.ideal(w)
    ideal = ideal_hit / total if total else 0.0
    log(
        f"simulate: {w.description}; {len(w.requests)} requests, {total:,} prompt tokens, "
        f"{w.distinct_units:,} distinct units of {U} token(s); ideal {ideal:.4f} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    rows: list[dict] = []

    def add(policy, cap, hit, *, workers=1, bound=None, note="", secs=0.0, **extra):
        rate = hit / total if total else 0.0
        row = {
            "policy": policy,
            "capacity": cap,
            "capacity_tokens": cap * U if cap is not None else None,
            "workers": workers,
            "hit_rate": rate,
            "pct_of_ideal": 100 * rate / ideal if ideal else None,
            "hit_tokens": hit,
        }
        if bound is not None:
            row["pooled_bound"] = bound
            row["pct_of_bound"] = 100 * rate / bound if bound else None
        if note:
            row["note"] = note
        row.update(extra)
        row["seconds"] = round(secs, 3)
        rows.append(row)
        log(f"  {policy:<28} capacity {fmt(cap) if cap is not None else 'inf':>10}: hit {rate:.4f} ({secs:.1f} s)")

    def timed(fn, *a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        return out, time.perf_counter() - t

    add("ideal", None, ideal_hit, note="infinite cache")
    for cap in capacities(args, w):
        if args.workers <= 1:
            for pol in args.policies:
                if pol == "none":
                    add("none", cap, 0)
                elif pol.startswith("radix-") and "+lpm" not in pol:
                    h, s = timed(P.radix, w, cap, pol.split("-", 1)[1])
                    add(pol, cap, h, secs=s)
                elif pol == "radix-lru+lpm":
                    served: list[int] = []
                    h, s = timed(P.radix_lpm, w, cap, args.lpm_window, order=served)
                    add(
                        f"radix-lru+lpm(W={args.lpm_window})",
                        cap,
                        h,
                        secs=s,
                        note="reorders: bounded by the ideal of its own order, not by belady",
                        ideal_served_order=P.ideal(w, served) / total if total else 0.0,
                    )
                elif pol.startswith("vllm-"):
                    block = int(pol.split("-")[1])
                    if block % U if block >= U else U % block:
                        log(f"  {pol}: skipped (block {block} vs unit {U} tokens)")
                        continue
                    h, s = timed(P.block_hash, w, cap * U, block)
                    add(pol, cap, h, secs=s)
                elif pol == "slots":
                    h, s = timed(P.slots, w, cap, args.slots)
                    add(f"slots-{args.slots}", cap, h, secs=s)
                elif pol == "belady":
                    h, s = timed(P.belady, w, cap)
                    add("belady", cap, h, secs=s, note="exact for unit-count hits")
        else:
            N = args.workers
            pooled = cap * N
            hb, sb = timed(P.belady, w, pooled)
            bound = hb / total if total else 0.0
            for rt in args.routing:
                (h, per), s = timed(P.route, w, N, cap, rt, cache_threshold=args.cache_threshold, balance_abs=args.balance_abs, balance_rel=args.balance_rel)
                add(f"{rt} x{N}", cap, h, workers=N, bound=bound, secs=s, requests_per_worker=per)
            h, s = timed(P.radix, w, pooled)
            add("pooled radix-lru (N*C)", pooled, h, bound=bound, secs=s)
            add("pooled belady (N*C)", pooled, hb, bound=bound, secs=sb, note="bound for the routers")
    return {
        "workload": w.name,
        "description": w.description,
        "requests": len(w.requests),
        "prompt_tokens": total,
        "unit_tokens": U,
        "distinct_units": w.distinct_units,
        "ideal": ideal,
        "ideal_hit_tokens": ideal_hit,
        "rows": rows,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }


def render(res: dict) -> str:
    U = res["unit_tokens"]
    multi = any(r.get("workers", 1) > 1 or "pooled_bound" in r for r in res["rows"])
    headers = ["policy", "capacity" + (" (blocks)" if U > 1 else " (tokens)"), "tokens", "hit rate %", "% of ideal"]
    if multi:
        headers += ["% of pooled belady", "requests per worker"]
    rows = []
    for r in res["rows"]:
        row = [
            r["policy"],
            "inf" if r["capacity"] is None else fmt(r["capacity"]),
            "inf" if r["capacity_tokens"] is None else fmt(r["capacity_tokens"]),
            100 * r["hit_rate"],
            r["pct_of_ideal"],
        ]
        if multi:
            row += [r.get("pct_of_bound"), ",".join(map(str, r.get("requests_per_worker", []))) or "-"]
        rows.append(row)
    head = (
        f"{res['description']}\n{res['requests']:,} requests, {res['prompt_tokens']:,} prompt tokens, "
        f"unit {U} token(s), {res['distinct_units']:,} distinct units; ideal hit rate "
        f"{100 * res['ideal']:.2f}% (token-weighted); {res['elapsed_s']} s\n"
    )
    return head + table(headers, rows)


def run(args) -> int:
    if args.workers < 1:
        print("simulate: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.trace:
        args.trace = os.path.expanduser(args.trace)
    try:
        res = simulate(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    emit(args, res, render)
    return 0
