"""int8 KV cache: capacity gain and greedy agreement against the unquantized cache.

Capacity: KV bytes per token (2 x layers x kv_heads x head_dim x bytes, plus int8's float32
scale per token and head) for float32, bfloat16 and int8 at the model's shape, the tokens that
fit in one GiB, and the pool the engine actually allocates for ``--kv-gb`` (counted from its
tensors). Agreement: the same prompts decoded greedily by two engines on the same weights, one
with the model-dtype cache and one with ``kv_dtype="int8"``: the fraction of identical tokens
position by position, of sequences identical end to end, of first tokens, and the mean share of
each sequence before the first difference. Wall time of both runs is shown side by side.
"""

from __future__ import annotations

import time

from bench.common import add_common_args, emit, fmt, log, machine_line, machine_summary, random_ids, rng, setup, table

HELP = "int8 KV cache: tokens per GiB vs float32/bfloat16, greedy agreement with the unquantized cache"

TEXT_PROMPTS = [
    "The rules of chess say that a pawn",
    "Write a short story about a robot who",
    "def fibonacci(n):",
    "The capital of France is",
    "Janggi is a Korean board game in which",
    "In 1969, the first humans",
    "A recipe for bread: first,",
    "The three laws of thermodynamics are",
    "Dear team, the meeting on Monday",
    "Photosynthesis converts light into",
    "Once upon a time, in a kingdom by the sea,",
    "SELECT name FROM users WHERE",
]


def add_arguments(parser) -> None:
    add_common_args(parser)
    parser.add_argument("--prompts", type=int, default=32, help="prompts for the agreement test")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="random prompt length (text prompts: --text)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--text", action="store_true", help="use built-in text prompts (for a real model) instead of random ids")
    parser.add_argument("--kv-gb", type=float, default=0.25, help="KV budget for the allocated-pool check (GiB)")


def _pool_bytes(pool) -> int:
    tensors = list(pool.k) + list(pool.v) + list(getattr(pool, "k_scale", [])) + list(getattr(pool, "v_scale", []))
    return sum(t.numel() * t.element_size() for t in tensors)


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    total = sum(len(p) for p in a)

    def prefix(p, q):
        n = 0
        while n < min(len(p), len(q)) and p[n] == q[n]:
            n += 1
        return n / max(1, len(p))

    return {
        "token_agreement": same / total,
        "sequence_agreement": sum(p == q for p, q in zip(a, b)) / len(a),
        "first_token_agreement": sum(p[:1] == q[:1] for p, q in zip(a, b)) / len(a),
        "mean_prefix_agreement": sum(prefix(p, q) for p, q in zip(a, b)) / len(a),
    }


def run(args) -> int:
    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.kv.pool import KVPool

    model = setup(args)
    engines = {}
    for kv in (None, "int8"):
        engines[kv] = Engine(model, device=args.device, kv_memory_gb=args.kv_gb, kv_dtype=kv)
    cfg = engines[None].loaded.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    dim = engines[None].pool.k[0].shape[-1]
    capacity = {}
    for name, dtype, kv in (("float32", torch.float32, None), ("bfloat16", torch.bfloat16, None), ("int8", torch.float32, "int8")):
        per = KVPool.bytes_per_token(layers, heads, dim, dtype, kv)
        capacity[name] = {"bytes_per_token": per, "tokens_per_gib": 2**30 // per}
    model_dtype = str(engines[None].loaded.dtype).removeprefix("torch.")
    allocated = {("int8" if kv else model_dtype): {"tokens": e.pool.capacity_tokens, "bytes": _pool_bytes(e.pool)} for kv, e in engines.items()}

    r = rng(0)
    if args.text:
        prompts = [TEXT_PROMPTS[i % len(TEXT_PROMPTS)] for i in range(args.prompts)]
    else:
        prompts = [random_ids(r, args.prompt_tokens, engines[None].vocab_size) for _ in range(args.prompts)]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs, wall = {}, {}
    for kv, e in engines.items():
        log(f"greedy decode, {args.prompts} prompts x {args.max_tokens} tokens, kv={kv or model_dtype}")
        t = time.perf_counter()
        outs[kv] = [o.token_ids for o in e.generate(prompts, sp)]
        wall[kv or model_dtype] = time.perf_counter() - t
        e.shutdown()
    result = {
        "model": model,
        "model_dtype": model_dtype,
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": dim},
        "capacity": capacity,
        "allocated": allocated,
        "kv_gb": args.kv_gb,
        "agreement": _agreement(outs[None], outs["int8"]),
        "prompts": args.prompts,
        "prompt": "text" if args.text else f"{args.prompt_tokens} random ids",
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "machine": machine_summary(),
    }
    emit(args, result, _render)
    return 0


def _render(res: dict) -> str:
    s = res["shape"]
    cap = res["capacity"]
    lines = [
        f"int8 KV cache; model {res['model']} ({res['model_dtype']}; {s['layers']} layers x {s['kv_heads']} KV heads "
        f"x head_dim {s['head_dim']}); {machine_line(res['machine'])}",
        f"KV bytes/token = 2 x {s['layers']} layers x {s['kv_heads']} KV heads x {s['head_dim']} x bytes per element "
        f"(int8: 2 x {s['layers']} x {s['kv_heads']} x ({s['head_dim']} x 1 + 4 bytes of scale))",
        table(
            ["KV dtype", "bytes/token", "tokens/GiB", "vs float32", "vs bfloat16"],
            [
                [
                    n,
                    v["bytes_per_token"],
                    v["tokens_per_gib"],
                    fmt(v["tokens_per_gib"] / cap["float32"]["tokens_per_gib"], 2) + " x",
                    fmt(v["tokens_per_gib"] / cap["bfloat16"]["tokens_per_gib"], 2) + " x",
                ]
                for n, v in cap.items()
            ],
        ),
        f"allocated for --kv-gb {res['kv_gb']}: "
        + "; ".join(f"{n}: {v['tokens']:,} tokens in {v['bytes'] / 2**20:,.1f} MiB" for n, v in res["allocated"].items()),
    ]
    a = res["agreement"]
    lines.append(
        f"greedy agreement, int8 vs {res['model_dtype']} KV, {res['prompts']} prompts ({res['prompt']}) x "
        f"{res['max_tokens']} tokens: tokens {100 * a['token_agreement']:.1f} %, first tokens "
        f"{100 * a['first_token_agreement']:.1f} %, whole sequences {100 * a['sequence_agreement']:.1f} %, "
        f"mean prefix before the first difference {100 * a['mean_prefix_agreement']:.1f} %"
    )
    lines.append("wall time: " + ", ".join(f"{n} {v:.2f} s" for n, v in res["wall_s"].items()))
    return "\n".join(lines)
