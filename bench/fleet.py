"""Prefix-cache workloads: an agent fleet (closed loop) and generated shared prefixes (burst).

Agent fleet: A agents share one S-token system prompt; each has a P-token private state and
plays T turns. A turn's prompt is system + private + (for every earlier turn: that turn's
output + a 16-token observation); outputs are --output-tokens tokens (greedy, ignore_eos).
Closed loop: an agent sends its next turn as soon as its previous one finished. Run twice with
the same KV pool: prefix cache on, then off.

Generated shared prefix (GSP): G groups x Q prompts, each a group's prefix + a unique
question, shuffled, all submitted at once. Run with longest-prefix-match admission plus
in-batch dedup ("lpm") and with first-come-first-served without dedup ("fcfs"), both with the
cache on and the same deliberately small KV pool and max_running, so order matters.

Every run reports the token-weighted hit rate (sum of cached prompt tokens / sum of prompt
tokens) beside the ideal hit rate of the same trace (an infinite cache: each prompt hits the
longest prefix of anything known before it arrived, capped at its length - 1).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace

from bench.common import (
    Progress,
    add_common_args,
    emit,
    fmt,
    ideal_hit_tokens,
    log,
    machine_line,
    machine_summary,
    random_ids,
    ratio,
    rng,
    setup,
    table,
)
from radixserve.ops.stats import percentile

HELP = "prefix-cache workloads: agent fleet (cache on/off) and shared-prefix groups (lpm/fcfs)"

SEED = 7
OBSERVATION_TOKENS = 16


@dataclass(frozen=True)
class FleetConfig:
    agents: int = 64
    system_tokens: int = 2048
    private_tokens: int = 128
    turns: int = 4
    output_tokens: int = 8
    observation_tokens: int = OBSERVATION_TOKENS

    @property
    def working_set_tokens(self) -> int:
        """KV of everything the fleet ever computes, shared system prompt counted once."""
        per_agent = self.private_tokens + self.turns * (self.output_tokens + self.observation_tokens)
        return self.system_tokens + self.agents * per_agent

    @property
    def longest_sequence(self) -> int:
        return self.system_tokens + self.private_tokens + (self.turns - 1) * (self.output_tokens + self.observation_tokens) + self.output_tokens


@dataclass(frozen=True)
class GSPConfig:
    groups: int = 16
    prompts: int = 8
    prefix_tokens: int = 1024
    question_tokens: int = 128
    output_tokens: int = 8
    max_running: int = 16
    kv_tokens: int | None = None  # None: see default_kv()

    def default_kv(self) -> int:
        """Room for a quarter of the groups' prefixes plus a full batch of questions: not every
        group fits at once, so admission order decides what stays cached."""
        return max(1, self.groups // 4) * self.prefix_tokens + self.max_running * (self.question_tokens + self.output_tokens) + self.prefix_tokens


QUICK_FLEET = FleetConfig(agents=8, system_tokens=256, private_tokens=32, turns=2, output_tokens=8)
QUICK_GSP = GSPConfig(groups=4, prompts=4, prefix_tokens=256, question_tokens=32, output_tokens=8, max_running=4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = FleetConfig()
    g = GSPConfig()
    p.add_argument("--agents", type=int, default=d.agents, help="agents in the fleet")
    p.add_argument("--system-tokens", type=int, default=d.system_tokens, help="shared system prompt tokens")
    p.add_argument("--private-tokens", type=int, default=d.private_tokens, help="private state tokens per agent")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per agent")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens, help="output tokens per turn")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool of both fleet runs, tokens (default: 1.25x the fleet's working set)")
    p.add_argument("--max-running", type=int, default=64, help="engine max_running of the fleet runs")
    p.add_argument("--gsp-groups", type=int, default=g.groups, help="GSP: groups (distinct prefixes)")
    p.add_argument("--gsp-prompts", type=int, default=g.prompts, help="GSP: prompts per group")
    p.add_argument("--gsp-prefix", type=int, default=g.prefix_tokens, help="GSP: shared prefix tokens per group")
    p.add_argument("--gsp-question", type=int, default=g.question_tokens, help="GSP: unique question tokens")
    p.add_argument("--gsp-output", type=int, default=g.output_tokens, help="GSP: output tokens per prompt")
    p.add_argument("--gsp-max-running", type=int, default=g.max_running, help="GSP: engine max_running (both policies)")
    p.add_argument(
        "--gsp-kv-tokens", type=int, default=None, help="GSP: KV pool tokens, both policies (default: groups/4 prefixes + a batch of questions + one prefix)"
    )
    p.add_argument(
        "--gsp-policies", type=policy_list, default=list(GSP_POLICIES), metavar="P,P,...", help=f"GSP: admission policies to run, from {','.join(GSP_POLICIES)}"
    )
    p.add_argument(
        "--skip",
        choices=["fleet", "fleet-off", "gsp"],
        action="append",
        default=[],
        help="skip a workload (repeatable); fleet-off skips only the fleet's cache-off run",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"scaled-down run (< 30 s): fleet {QUICK_FLEET.agents} agents x {QUICK_FLEET.turns} turns, "
        f"{QUICK_FLEET.system_tokens}-token system prompt; GSP {QUICK_GSP.groups}x{QUICK_GSP.prompts}",
    )
    add_common_args(p)


def policy_list(text: str) -> list[str]:
    names = [x.strip().replace("-", "_") for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in GSP_POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {bad or text!r}; choose from {','.join(GSP_POLICIES)}")
    return names


def configs(args: argparse.Namespace) -> tuple[FleetConfig, GSPConfig]:
    if args.quick:
        return QUICK_FLEET, replace(QUICK_GSP, kv_tokens=args.gsp_kv_tokens)
    fleet = FleetConfig(
        agents=args.agents, system_tokens=args.system_tokens, private_tokens=args.private_tokens, turns=args.turns, output_tokens=args.output_tokens
    )
    gsp = GSPConfig(
        groups=args.gsp_groups,
        prompts=args.gsp_prompts,
        prefix_tokens=args.gsp_prefix,
        question_tokens=args.gsp_question,
        output_tokens=args.gsp_output,
        max_running=args.gsp_max_running,
        kv_tokens=args.gsp_kv_tokens,
    )
    return fleet, gsp


# -- shared run bookkeeping --------------------------------------------------------------------
def summarize(outputs: list, events: list, wall: float, engine) -> dict:
    prompt = sum(o.prompt_tokens for o in outputs)
    cached = sum(o.cached_tokens for o in outputs)
    generated = sum(len(o.token_ids) for o in outputs)
    ideal_hit, ideal_total = ideal_hit_tokens(events)
    assert ideal_total == prompt, (ideal_total, prompt)
    ttft = [o.ttft_s * 1e3 for o in outputs]
    hit_rate = ratio(cached, prompt)
    ideal = ratio(ideal_hit, ideal_total)
    stats = engine.stats()
    return {
        "requests": len(outputs),
        "wall_s": wall,
        "req_per_s": len(outputs) / wall,
        "tok_per_s": (prompt + generated) / wall,
        "output_tok_per_s": generated / wall,
        "prompt_tokens": prompt,
        "output_tokens": generated,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "e2e_p50_ms": percentile([o.e2e_s * 1e3 for o in outputs], 50),
        "hit_rate": hit_rate,
        "ideal_hit_rate": ideal,
        "pct_of_ideal": 100 * ratio(hit_rate, ideal) if ideal else None,
        "preemptions": stats["preemptions"],
        "evicted_tokens": stats["evictions"],
        "engine_steps": stats.get("steps"),
        "cascade_steps": stats.get("cascade_steps"),
        "finish_reasons": sorted({o.finish_reason for o in outputs}),
    }


def make_engine(model_dir: str, args, **kw):
    from radixserve import Engine

    t = time.perf_counter()
    engine = Engine(model_dir, device=args.device, seed=0, **kw)
    log(f"    engine ready in {time.perf_counter() - t:.1f} s ({', '.join(f'{k}={v}' for k, v in kw.items())})")
    return engine


# -- agent fleet -------------------------------------------------------------------------------
def run_fleet(engine, cfg: FleetConfig, label: str) -> dict:
    """Closed loop: every agent's next turn is submitted the moment its previous one finishes."""
    from radixserve import SamplingParams

    vocab = engine.vocab_size
    system = random_ids(rng(SEED, 0), cfg.system_tokens, vocab)
    private = [random_ids(rng(SEED, 1, a), cfg.private_tokens, vocab) for a in range(cfg.agents)]
    observation = [[random_ids(rng(SEED, 2, a, t), cfg.observation_tokens, vocab) for t in range(cfg.turns)] for a in range(cfg.agents)]
    params = SamplingParams(max_tokens=cfg.output_tokens, temperature=0.0, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(cfg.agents)]
    owner: dict[str, tuple[int, int]] = {}
    events: list[tuple[str, list[int]]] = []
    outputs = []
    total = cfg.agents * cfg.turns
    progress = Progress(label, total)

    def submit(agent: int, turn: int) -> None:
        prompt = system + private[agent] + history[agent]
        req = engine.make_request(prompt, params, request_id=f"agent{agent}-turn{turn}")
        owner[req.input.rid] = (agent, turn)
        events.append(("arrive", prompt))
        engine.add_request(req)

    t0 = time.perf_counter()
    for a in range(cfg.agents):
        submit(a, 0)
    while len(outputs) < total:
        for chunk in engine.step():
            out = chunk.output
            if out is None:
                continue
            agent, turn = owner.pop(out.request_id)
            outputs.append(out)
            # What a perfect cache could keep: the prompt and every output token but the last
            # (whose KV is never computed).
            events.append(("known", out.prompt_token_ids + out.token_ids[:-1]))
            if turn + 1 < cfg.turns:
                history[agent] = history[agent] + out.token_ids + observation[agent][turn]
                submit(agent, turn + 1)
        progress.update(len(outputs), f"{sum(o.cached_tokens for o in outputs):,} cached prompt tokens")
    wall = time.perf_counter() - t0
    progress.update(len(outputs), force=True)
    return summarize(outputs, events, wall, engine)


def fleet_benchmark(model_dir: str, args, cfg: FleetConfig) -> dict:
    kv = args.kv_tokens or -(-int(cfg.working_set_tokens * 1.25) // 256) * 256
    kv = max(kv, cfg.longest_sequence + 1)
    log(
        f"fleet: {cfg.agents} agents x {cfg.turns} turns, system {cfg.system_tokens}, private {cfg.private_tokens}, "
        f"output {cfg.output_tokens} tokens; KV pool {kv:,} tokens (working set {cfg.working_set_tokens:,})"
    )
    runs = {}
    for label, cache in (("cache_on", True), ("cache_off", False)):
        if not cache and "fleet-off" in args.skip:
            continue
        log(f"  fleet, prefix cache {'on' if cache else 'off'}:")
        engine = make_engine(model_dir, args, kv_cache_tokens=kv, max_running=args.max_running, enable_prefix_cache=cache)
        runs[label] = run_fleet(engine, cfg, f"fleet cache {'on' if cache else 'off'}")
        r = runs[label]
        log(f"    {r['wall_s']:.1f} s, {r['req_per_s']:.2f} req/s, hit rate {100 * r['hit_rate']:.1f}%")
        del engine
    return {
        "config": asdict(cfg),
        "kv_cache_tokens": kv,
        "max_running": args.max_running,
        "working_set_tokens": cfg.working_set_tokens,
        "runs": runs,
        "speedup": ratio(runs["cache_on"]["req_per_s"], runs["cache_off"]["req_per_s"]) if "cache_off" in runs else None,
    }


# -- generated shared prefix -------------------------------------------------------------------
def run_gsp(engine, cfg: GSPConfig, label: str) -> dict:
    from radixserve import SamplingParams

    vocab = engine.vocab_size
    prompts = []
    for g in range(cfg.groups):
        prefix = random_ids(rng(SEED, 10, g), cfg.prefix_tokens, vocab)
        for q in range(cfg.prompts):
            prompts.append(prefix + random_ids(rng(SEED, 11, g, q), cfg.question_tokens, vocab))
    order = rng(SEED, 12).permutation(len(prompts)).tolist()
    prompts = [prompts[i] for i in order]
    params = SamplingParams(max_tokens=cfg.output_tokens, temperature=0.0, ignore_eos=True)
    events: list[tuple[str, list[int]]] = [("arrive", p) for p in prompts]
    outputs = []
    progress = Progress(label, len(prompts))
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(engine.make_request(p, params))
    while len(outputs) < len(prompts):
        for chunk in engine.step():
            if chunk.output is not None:
                outputs.append(chunk.output)
                events.append(("known", chunk.output.prompt_token_ids + chunk.output.token_ids[:-1]))
        progress.update(len(outputs), f"{sum(o.cached_tokens for o in outputs):,} cached prompt tokens")
    wall = time.perf_counter() - t0
    progress.update(len(outputs), force=True)
    return summarize(outputs, events, wall, engine)


GSP_POLICIES = {
    # Longest cached prefix first + in-batch dedup: the engine's defaults, including its aging
    # (a request overtaken by max_overtakes = 256 later arrivals is admitted in arrival order).
    "lpm": dict(schedule_policy="lpm"),
    # The same without aging: pure longest-prefix-match order.
    "lpm_no_aging": dict(schedule_policy="lpm", max_overtakes=10**9),
    # First come, first served, no dedup.
    "fcfs": dict(schedule_policy="fcfs", dedup_min_tokens=0),
}
GSP_LABELS = {"lpm": "lpm + dedup", "lpm_no_aging": "lpm + dedup, no aging", "fcfs": "fcfs, no dedup"}


def gsp_benchmark(model_dir: str, args, cfg: GSPConfig) -> dict:
    kv = cfg.kv_tokens or cfg.default_kv()
    log(
        f"gsp: {cfg.groups} groups x {cfg.prompts} prompts, prefix {cfg.prefix_tokens} + question "
        f"{cfg.question_tokens} tokens, output {cfg.output_tokens}; KV pool {kv:,} tokens, max_running {cfg.max_running}"
    )
    runs = {}
    for label in args.gsp_policies:
        policy = GSP_POLICIES[label]
        log(f"  gsp, {GSP_LABELS[label]}:")
        engine = make_engine(model_dir, args, kv_cache_tokens=kv, max_running=cfg.max_running, enable_prefix_cache=True, **policy)
        runs[label] = run_gsp(engine, cfg, f"gsp {label}")
        r = runs[label]
        log(f"    {r['wall_s']:.1f} s, {r['req_per_s']:.2f} req/s, hit rate {100 * r['hit_rate']:.1f}%")
        runs[label]["engine_options"] = policy
        del engine
    speedups = {}
    if "fcfs" in runs:
        for label in runs:
            if label != "fcfs":
                speedups[f"{label}_vs_fcfs"] = ratio(runs[label]["req_per_s"], runs["fcfs"]["req_per_s"])
    return {
        "config": {**asdict(cfg), "kv_tokens": kv},
        "kv_cache_tokens": kv,
        "runs": runs,
        "speedups": speedups,
    }


# -- command -----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    model_dir = setup(args)
    fleet_cfg, gsp_cfg = configs(args)
    result = {"command": "fleet", "model": model_dir, "device": args.device, "quick": bool(args.quick)}
    if "fleet" not in args.skip:
        result["fleet"] = fleet_benchmark(model_dir, args, fleet_cfg)
    if "gsp" not in args.skip:
        result["gsp"] = gsp_benchmark(model_dir, args, gsp_cfg)
    result["machine"] = machine_summary()
    result["runtime_s"] = time.perf_counter() - t_start
    emit(args, result, render)
    return 0


RUN_HEADERS = [
    "run",
    "wall (s)",
    "req/s",
    "tok/s (prompt+out)",
    "TTFT p50 (ms)",
    "TTFT p99 (ms)",
    "hit rate (%)",
    "ideal (%)",
    "% of ideal",
    "prefilled (tok)",
    "preempt",
    "evicted (tok)",
]


def _run_row(name: str, r: dict) -> list[str]:
    return [
        name,
        fmt(r["wall_s"], 2),
        fmt(r["req_per_s"], 2),
        fmt(r["tok_per_s"], 0),
        fmt(r["ttft_p50_ms"], 0),
        fmt(r["ttft_p99_ms"], 0),
        fmt(100 * r["hit_rate"], 1),
        fmt(100 * r["ideal_hit_rate"], 1),
        fmt(r["pct_of_ideal"], 1),
        fmt(r["prefilled_tokens"]),
        fmt(r["preemptions"]),
        fmt(r["evicted_tokens"]),
    ]


def render(res: dict) -> str:
    m = res["machine"]
    out = [f"model {res['model']} on {res['device']}; {machine_line(m)}" + ("; --quick" if res["quick"] else "")]
    if "fleet" in res:
        f = res["fleet"]
        c = f["config"]
        out += [
            "",
            f"Agent fleet (closed loop): {c['agents']} agents x {c['turns']} turns; system {c['system_tokens']} "
            f"+ private {c['private_tokens']} tokens, +{c['output_tokens']} output +{c['observation_tokens']} "
            f"observation tokens per turn",
            f"KV pool {f['kv_cache_tokens']:,} tokens for both runs (working set {f['working_set_tokens']:,} tokens), max_running {f['max_running']}",
            table(RUN_HEADERS, [_run_row(name.replace("_", " "), r) for name, r in f["runs"].items()]),
        ]
        if f["speedup"] is not None:
            on, off = f["runs"]["cache_on"], f["runs"]["cache_off"]
            out.append(
                f"speedup with the prefix cache: {fmt(f['speedup'], 2)}x requests/s, "
                f"{fmt(ratio(on['tok_per_s'], off['tok_per_s']), 2)}x tokens/s; TTFT p50 "
                f"{fmt(ratio(off['ttft_p50_ms'], on['ttft_p50_ms']), 1)}x lower"
            )
    if "gsp" in res:
        g = res["gsp"]
        c = g["config"]
        out += [
            "",
            f"Generated shared prefix (open burst): {c['groups']} groups x {c['prompts']} prompts, prefix "
            f"{c['prefix_tokens']} + question {c['question_tokens']} tokens, output {c['output_tokens']}, shuffled",
            f"cache on; KV pool {g['kv_cache_tokens']:,} tokens, max_running {c['max_running']}, the same for every policy",
            table(RUN_HEADERS, [_run_row(GSP_LABELS[name], r) for name, r in g["runs"].items()]),
        ]
        for name, x in g["speedups"].items():
            label = name.removesuffix("_vs_fcfs")
            out.append(
                f"{GSP_LABELS[label]} vs fcfs: {fmt(x, 2)}x requests/s, hit rate "
                f"{fmt(100 * g['runs'][label]['hit_rate'], 1)}% vs {fmt(100 * g['runs']['fcfs']['hit_rate'], 1)}%"
            )
        if "lpm" in g["runs"]:
            out.append(
                "('lpm' uses the engine defaults: a request overtaken by max_overtakes = 256 later arrivals goes next;\n'no aging' sets max_overtakes = 1e9.)"
            )
    out += [
        "",
        "hit rate = sum(cached prompt tokens) / sum(prompt tokens); ideal = the same trace through an infinite "
        "cache\n(longest prefix of anything known before arrival, capped at prompt length - 1); prefilled = "
        "prompt tokens computed.",
        f"total runtime {res['runtime_s']:.1f} s",
    ]
    return "\n".join(out)
