"""Per-step cost of structured output: decode steps with and without xgrammar token masks.

For each batch size, ``batch`` requests are admitted and prefilled, then ``--steps`` decode
steps are timed one by one (``Engine.step``: forward, mask, sample, advance the matchers) and the
sampler's share is timed separately. Modes: ``plain`` (no grammar), ``regex`` (``[a-z0-9 ]*``,
never completes), ``json`` (a schema with one free string, which a random model does not close
within the window) and ``choice`` (one of 40 chess moves, re-admitted as requests finish, so the
masks are the short-lived, branching kind) and ``tools`` (``tool_choice: "required"`` over two
tools in the Hermes format, a ``make_move`` whose ``move`` is one of those 40 and a ``say`` with a
free string: the grammar a tool-calling agent's turn runs under, re-admitted like ``choice``).
Modes are interleaved per batch size, so drift on a
shared machine hits all alike; medians are reported, in ms per decode step.

The mask step alone (``--mask-reps`` times per mode and batch size: fill each row's bitmask,
apply it to a ``[batch, vocab]`` logits tensor, pick the argmax, advance the matchers; terminated
matchers are reset outside the timing) is timed too: it is the overhead a grammar adds to a step,
without the forward pass's noise.
"""

from __future__ import annotations

import time

from bench.common import add_common_args, emit, fmt, int_list, log, machine_line, machine_summary, median, setup, table

HELP = "decode step time with vs without structured-output (xgrammar) masks"

JSON_SCHEMA = {"type": "object", "properties": {"thought": {"type": "string"}}, "required": ["thought"]}
MOVES = [f"{a}{r}{b}{s}" for a, b in zip("abcdefgh", "hgfedcba") for r, s in ((2, 4), (1, 3), (7, 5), (8, 6), (2, 3))]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "make_move",
            "description": "Play a move.",
            "parameters": {"type": "object", "properties": {"move": {"type": "string", "enum": MOVES}}, "required": ["move"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "say",
            "description": "Say something to the opponent.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}}, "required": ["text"]},
        },
    },
]


def add_arguments(parser) -> None:
    add_common_args(parser)
    parser.add_argument("--batch", type=int_list, default=[1, 8, 32], help="decode batch sizes (comma-separated)")
    parser.add_argument("--skip-steps", action="store_true", help="only the mask step alone (fast, less noisy)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per mode and batch size")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of each request")
    parser.add_argument("--mask-reps", type=int, default=200, help="timed repetitions of the mask step alone")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the modes")


def _spec(mode: str):
    from radixserve.engine.structured import StructuredOutput

    if mode == "tools":
        from radixserve.tools.spec import check_tool_choice, check_tools, tool_calls_spec

        tools = check_tools(TOOLS)
        return StructuredOutput(tool_calls=tool_calls_spec("hermes", tools, check_tool_choice("required", tools)))
    return {
        "plain": None,
        "regex": StructuredOutput(regex="[a-z0-9 ]*"),
        "json": StructuredOutput(json_schema=JSON_SCHEMA),
        "choice": StructuredOutput(choice=MOVES),
    }[mode]


def _measure(engine, mode: str, batch: int, steps: int, prompt_tokens: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-step wall time and sampler time (seconds) of ``steps`` decode steps at ``batch``."""
    from bench.common import random_ids, rng
    from radixserve import SamplingParams

    r = rng(seed, batch)
    spec = _spec(mode)
    max_tokens = 4 * steps + 8

    def submit(n: int) -> None:
        for _ in range(n):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=int(r.integers(1 << 30)), ignore_eos=spec is None, structured=spec)
            engine.add_request(engine.make_request(random_ids(r, prompt_tokens, engine.vocab_size), params))

    submit(batch)
    while any(req.prefilling or req.kv.computed == 0 for req in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    timed = _TimedSampler(engine.sampler)
    step_times: list[float] = []
    engine.sampler = timed
    try:
        for _ in range(steps):
            running = len(engine.scheduler.running)
            if running < batch:  # choice requests finish after a few tokens: keep the batch full
                submit(batch - running)
                while engine.scheduler.waiting or any(q.prefilling for q in engine.scheduler.running):
                    engine.step()
            timed.on = True
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
            timed.on = False
    finally:
        engine.sampler = timed.inner
        for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(req.input.rid)
        engine.step()
    return step_times, timed.times


class _TimedSampler:
    """The engine's sampler, timed while ``on``."""

    def __init__(self, inner):
        self.inner, self.on, self.times = inner, False, []

    def __call__(self, logits, reqs):
        t = time.perf_counter()
        out = self.inner(logits, reqs)
        if self.on:
            self.times.append(time.perf_counter() - t)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _mask_only(engine, mode: str, batch: int, reps: int) -> float:
    """Median seconds of one mask step (fill + apply + argmax + advance) over ``batch`` rows."""
    import torch

    from radixserve import SamplingParams
    from radixserve.engine.request import Request
    from radixserve.engine.sampler import advance_grammars, apply_grammar_masks

    reqs = [Request(rid=str(i), prompt_ids=[7], params=SamplingParams()) for i in range(batch)]
    for r in reqs:
        r.decode.grammar = engine.grammars.matcher(_spec(mode))
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, engine.vocab_size, generator=g)
    times = []
    for _ in range(reps):
        for r in reqs:
            if r.decode.grammar is None or r.decode.grammar.is_terminated():
                r.decode.grammar = engine.grammars.matcher(_spec(mode))
        x = logits.clone()
        t = time.perf_counter()
        tokens = apply_grammar_masks(x, reqs).argmax(dim=-1).tolist()
        advance_grammars(tokens, reqs)
        times.append(time.perf_counter() - t)
    return median(times)


def run(args) -> int:
    model = setup(args)
    from radixserve import Engine
    from radixserve.engine.structured import xgrammar_available

    if not xgrammar_available():
        log("xgrammar is not installed: pip install 'radixserve[structured]'")
        return 2
    modes = ["plain", "regex", "json", "choice", "tools"]
    engine = Engine(
        model,
        device=args.device,
        kv_cache_tokens=max(args.batch) * (args.prompt_tokens + 4 * args.steps + 16) * 2,
        max_running=max(args.batch),
        enable_prefix_cache=False,
    )
    for mode in modes[1:]:  # compile once, outside the timings (the cache keeps them)
        engine.grammars.compile(_spec(mode))
    for mode in modes if not args.skip_steps else []:  # warm-up (first-touch allocations, thread pools), not recorded
        _measure(engine, mode, min(args.batch), 2, args.prompt_tokens, seed=99)
    rows = {}
    for batch in args.batch:
        step_t = {m: [] for m in modes}
        samp_t = {m: [] for m in modes}
        for rnd in range(0 if args.skip_steps else args.rounds):
            for mode in modes:
                log(f"batch {batch}, {mode}, round {rnd + 1}/{args.rounds}")
                s, q = _measure(engine, mode, batch, args.steps, args.prompt_tokens, seed=rnd)
                step_t[mode] += s
                samp_t[mode] += q
        rows[batch] = {
            m: {"step_ms": median(step_t[m]) * 1e3 if step_t[m] else None, "sampler_ms": median(samp_t[m]) * 1e3 if samp_t[m] else None} for m in modes
        }
        for m in modes[1:]:
            log(f"batch {batch}, {m}, mask step alone x {args.mask_reps}")
            rows[batch][m]["mask_ms"] = _mask_only(engine, m, batch, args.mask_reps) * 1e3
    result = {
        "model": model,
        "vocab_size": engine.vocab_size,
        "device": args.device,
        "steps": args.steps,
        "rounds": args.rounds,
        "machine": machine_summary(),
        "batches": rows,
    }
    engine.shutdown()
    emit(args, result, _render)
    return 0


def _render(res: dict) -> str:
    head = (
        f"decode step with structured-output masks; model {res['model']} (vocab {res['vocab_size']}) on "
        f"{res['device']}; {machine_line(res['machine'])}; median of {res['steps']} x {res['rounds']} steps"
    )
    out = []
    for batch, modes in res["batches"].items():
        base = modes["plain"]["step_ms"]
        out.append(f"batch {batch}")
        out.append(
            table(
                ["mode", "step ms", "sampler ms", "step - plain ms", "mask step alone ms", "mask / plain step %"],
                [
                    [
                        m,
                        v["step_ms"],
                        v["sampler_ms"],
                        None if base is None else v["step_ms"] - base,
                        fmt(v.get("mask_ms"), 2),
                        fmt(100 * v["mask_ms"] / base if "mask_ms" in v and base else None),
                    ]
                    for m, v in modes.items()
                ],
            )
        )
    return head + "\n" + "\n".join(out)
