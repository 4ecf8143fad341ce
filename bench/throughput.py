"""Decode throughput vs. concurrency, beside a naive serial transformers loop.

At each concurrency N, N distinct random prompts (token ids, fixed seeds) are submitted at
once; greedy (or sampled: --temperature, --top-p), ignore_eos, --gen-len new tokens each;
prefix cache off. Reported per N (median of --repeats): aggregate tokens/s (all generated
tokens / wall time), per-stream tokens/s, the ratio to N=1, the prefill phase (until every
request has its first token) and the decode phase (the rest) separately. The serial baseline runs ``model.generate`` one prompt at a time.
"""

from __future__ import annotations

import argparse
import time

from bench.common import (
    add_common_args,
    emit,
    fmt,
    int_list,
    log,
    machine_line,
    machine_summary,
    median,
    random_ids,
    ratio,
    rng,
    setup,
    table,
)

HELP = "decode throughput vs. concurrency (engine vs. serial transformers)"

SEED = 2026


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32, 64], metavar="N,N,...", help="concurrent requests per measurement")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="runs per concurrency (the median is reported)")
    p.add_argument("--no-hf", action="store_true", help="skip the serial transformers baseline")
    p.add_argument(
        "--hf-sample",
        type=int,
        default=8,
        metavar="K",
        help="serial baseline of the largest concurrency: time K prompts and extrapolate (serial time is linear in the number of requests)",
    )
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="engine token budget per step")
    p.add_argument("--temperature", type=float, default=0.0, help="engine sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="engine nucleus sampling (with --temperature > 0)")
    p.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="engine dtype (default: the checkpoint's); the serial baseline stays fp32"
    )
    add_common_args(p)


def prompts_for(concurrency: int, repeat: int, prompt_len: int, vocab: int) -> list[list[int]]:
    g = rng(SEED, concurrency, repeat)
    return [random_ids(g, prompt_len, vocab) for _ in range(concurrency)]


# -- engine ------------------------------------------------------------------------------------
def run_engine_once(engine, prompts: list[list[int]], gen_len: int, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Submit all prompts at once and step the engine until they finish."""
    from radixserve import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=temperature, top_p=top_p, ignore_eos=True)
    t0 = time.perf_counter()
    reqs = [engine.make_request(p, params) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    outputs = {}
    t_first = None
    tokens_at_first = 0
    while len(outputs) < len(reqs):
        for chunk in engine.step():
            if chunk.output is not None:
                outputs[chunk.request_id] = chunk.output
        if t_first is None and all(r.life.first_token_at is not None for r in reqs):
            t_first = time.perf_counter()
            tokens_at_first = sum(len(r.out.output_ids) for r in reqs)
    wall = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outputs.values())
    assert generated == len(prompts) * gen_len, (generated, len(prompts), gen_len)
    prefill_s = t_first - t0
    decode_s = wall - prefill_s
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "prefill_phase_s": prefill_s,
        "decode_phase_s": decode_s,
        "decode_phase_tokens": generated - tokens_at_first,
    }


def measure_engine(args, model_dir: str, vocab_holder: dict) -> tuple[list[dict], dict]:
    from radixserve import Engine, SamplingParams

    cmax = max(args.concurrency)
    kv = cmax * (args.prompt_len + args.gen_len) + 1024
    t = time.perf_counter()
    engine = Engine(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        enable_prefix_cache=False,
        max_running=cmax,
        max_batched_tokens=args.max_batched_tokens,
        kv_cache_tokens=kv,
        seed=0,
    )
    load_s = time.perf_counter() - t
    vocab = engine.vocab_size
    vocab_holder["vocab"] = vocab
    vocab_holder["dtype"] = str(engine.loaded.dtype).removeprefix("torch.")
    # Warm-up (first-call allocations, lazy init): not measured.
    engine.generate(
        [random_ids(rng(SEED, 0, 99), args.prompt_len, vocab) for _ in range(min(cmax, 4))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    rows = []
    for c in args.concurrency:
        runs = []
        for r in range(args.repeats):
            log(f"  engine: concurrency {c}, run {r + 1}/{args.repeats} ...")
            runs.append(run_engine_once(engine, prompts_for(c, r, args.prompt_len, vocab), args.gen_len, args.temperature, args.top_p))
            log(f"    {runs[-1]['wall_s']:.2f} s, {runs[-1]['generated_tokens'] / runs[-1]['wall_s']:.1f} tok/s")
        walls = [x["wall_s"] for x in runs]
        agg = [x["generated_tokens"] / x["wall_s"] for x in runs]
        dec = [ratio(x["decode_phase_tokens"], x["decode_phase_s"]) for x in runs]
        pre = [ratio(c * args.prompt_len, x["prefill_phase_s"]) for x in runs]
        rows.append(
            {
                "concurrency": c,
                "wall_s": median(walls),
                "aggregate_tok_s": median(agg),
                "per_stream_tok_s": median(agg) / c,
                "prefill_phase_s": median([x["prefill_phase_s"] for x in runs]),
                "prefill_tok_s": median(pre),
                "decode_phase_tok_s": median(dec),
                "runs_wall_s": walls,
            }
        )
    base = next((row["aggregate_tok_s"] for row in rows if row["concurrency"] == 1), None)
    for row in rows:
        row["ratio_vs_c1"] = ratio(row["aggregate_tok_s"], base) if base else None
    stats = engine.stats()
    info = {
        "load_s": load_s,
        "kv_cache_tokens": kv,
        "max_running": cmax,
        "max_batched_tokens": args.max_batched_tokens,
        "preemptions": stats["preemptions"],
        "prefix_hit_tokens": stats["prefix_hit_tokens"],
    }
    return rows, info


# -- serial transformers baseline --------------------------------------------------------------
def measure_serial(args, model_dir: str, vocab: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos=True
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(prompt: list[int]) -> None:
        ids = torch.tensor([prompt], device=args.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, do_sample=False, pad_token_id=pad
        )
        assert out.shape[1] == len(prompt) + args.gen_len

    def serial(prompts: list[list[int]]) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                generate(p)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        generate(random_ids(rng(SEED, 0, 99), args.prompt_len, vocab))  # warm-up
    rows = []
    targets = sorted({1, max(args.concurrency)}) if 1 in args.concurrency else [max(args.concurrency)]
    for c in targets:
        k = min(c, args.hf_sample)
        repeats = args.repeats if k == 1 else 1
        times = []
        for r in range(repeats):
            log(f"  serial transformers: workload of concurrency {c}, {k} prompt(s), run {r + 1}/{repeats} ...")
            times.append(serial(prompts_for(c, r, args.prompt_len, vocab)[:k]))
        t = median(times)
        tok_s = k * args.gen_len / t
        rows.append(
            {
                "concurrency": c,
                "prompts_timed": k,
                "extrapolated": k < c,
                "time_s": t * c / k,
                "tok_s": tok_s,
            }
        )
        log(f"    {tok_s:.1f} tok/s")
    return rows


# -- command -----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    model_dir = setup(args)
    log(f"throughput: model {model_dir}, concurrency {args.concurrency}, prompt {args.prompt_len} tokens, gen {args.gen_len} tokens, {args.repeats} repeat(s)")
    holder: dict = {}
    rows, info = measure_engine(args, model_dir, holder)
    serial = None if args.no_hf else measure_serial(args, model_dir, holder["vocab"])
    if serial:
        by_c = {s["concurrency"]: s["tok_s"] for s in serial}
        ref = by_c[max(by_c)]
        for row in rows:
            row["serial_tok_s"] = by_c.get(row["concurrency"], ref)
            row["ratio_vs_serial"] = ratio(row["aggregate_tok_s"], row["serial_tok_s"])
    result = {
        "command": "throughput",
        "model": model_dir,
        "device": args.device,
        "dtype": str(holder.get("dtype")),
        "config": {
            "concurrency": args.concurrency,
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "repeats": args.repeats,
            "prefix_cache": False,
            **info,
        },
        "machine": machine_summary(),
        "engine": rows,
        "serial": serial,
        "runtime_s": time.perf_counter() - t_start,
    }
    emit(args, result, render)
    return 0


def render(res: dict) -> str:
    cfg = res["config"]
    out = [
        f"Decode throughput: {cfg['prompt_len']}-token prompts, {cfg['gen_len']} new tokens each, greedy, prefix cache off; median of {cfg['repeats']} run(s)",
        f"model {res['model']} ({res.get('dtype', '?')}) on {res['device']}; {machine_line(res['machine'])}; KV pool {cfg['kv_cache_tokens']:,} tokens",
        "",
    ]
    has_serial = bool(res["serial"])
    headers = [
        "concurrency",
        "wall (s)",
        "aggregate (tok/s)",
        "per stream (tok/s)",
        "vs c=1 (x)",
        "prefill phase (s)",
        "prefill (tok/s)",
        "decode phase (tok/s)",
    ]
    if has_serial:
        headers.append("vs serial HF (x)")
    rows = []
    for r in res["engine"]:
        row = [
            str(r["concurrency"]),
            fmt(r["wall_s"], 2),
            fmt(r["aggregate_tok_s"]),
            fmt(r["per_stream_tok_s"], 2),
            fmt(r["ratio_vs_c1"], 2),
            fmt(r["prefill_phase_s"], 2),
            fmt(r["prefill_tok_s"]),
            fmt(r["decode_phase_tok_s"]),
        ]
        if has_serial:
            row.append(fmt(r.get("ratio_vs_serial"), 2))
        rows.append(row)
    out.append(table(headers, rows))
    out.append("")
    out.append(
        "aggregate = all generated tokens / wall time; prefill phase = until every request has its "
        "first token;\ndecode phase = tokens generated after that / the remaining time."
    )
    if has_serial:
        out.append("")
        out.append("Serial transformers baseline (model.generate, one request after another, greedy, fp32):")
        srows = []
        for s in res["serial"]:
            how = (
                f"timed {s['prompts_timed']} of {s['concurrency']} prompts, extrapolated (serial is linear)"
                if s["extrapolated"]
                else f"timed all {s['prompts_timed']}"
            )
            srows.append([str(s["concurrency"]), fmt(s["time_s"], 2), fmt(s["tok_s"]), how])
        out.append(table(["workload (concurrency)", "time for all (s)", "tok/s", "how"], srows, align="lrrl"))
        out.append(
            "The 'vs serial HF' column divides engine aggregate tok/s by the serial tok/s of the same "
            "workload\n(the largest-concurrency figure for concurrencies not timed serially)."
        )
    out.append("")
    out.append(f"total runtime {res['runtime_s']:.1f} s")
    return "\n".join(out)
