"""A 7B-shaped GGUF (random weights), or any GGUF, served from its quantized blocks: load time, memory, plan, decode.

Writes (once, into ``--dir``) a GGUF with Llama-2-7B's or Qwen2-7B's shapes and random weights in
``--mix`` (``q4_0``: every projection and the output head Q4_0, the embedding Q4_0; ``q4_k_m``:
llama.cpp's Q4_K_M layout, Q6_K for v, down and the output head, Q4_K elsewhere), with gguf's
GGUFWriter (:func:`radixserve.testing_gguf.write_synthetic_gguf`; nothing is downloaded or
committed); ``--file`` measures an existing GGUF instead (the default model's, say). Then, in a
child process per load (so each starts with an empty heap):

- the load: seconds from ``Engine(file)`` to ready, cold (first) and warm (the file in the page cache);
- memory: the process's RSS after the load and after ``--tokens`` greedy tokens (every weight
  page touched), against ``--max-rss-ratio`` x the file's size plus the KV pool's bytes;
- ``radixserve plan``'s weight bytes for the file against what the engine holds;
- batch-1 decode: the median step of the generation, in ms and tok/s, against the quantized
  weight bytes over the read bandwidth (``bench roofline``'s measurement), with the KV pages it
  writes already in memory (``KVPool.commit``, as llama.cpp's cleared KV buffer has them).

``--llama-bench PATH`` puts llama.cpp's batch-1 decode beside it: before each load, llama.cpp's
``llama-bench -m FILE -n TOKENS -p 0 -t THREADS -r 2`` on the same file (nothing else; its flags
are printed), then the load's decode; each round prints both tok/s and their ratio, and the last
line the median of the rounds' ratios. On these VMs, whose memory bandwidth drifts by tens of
percent from minute to minute, only ratios of neighbouring runs tell the engines apart.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HELP = "7B-shaped random GGUF (Q4_0 or Q4_K_M) served quantized: load time, RSS, plan, batch-1 decode"

SHAPES = {
    "tiny": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_theta=10000.0,
    ),  # (for the smoke test)
    "smollm2-overhead": dict(
        arch="llama",
        hidden_size=576,
        intermediate_size=64,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=1024,
        rope_theta=10000.0,
    ),  # SmolLM2-135M's layers and attention around a narrow MLP: 17 MB of weights, a step of overheads
    "llama2-7b": dict(
        arch="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        rope_theta=10000.0,
    ),
    "qwen2-7b": dict(
        arch="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=32000,
        rope_theta=1000000.0,
    ),
}
MIXES = ("q4_0", "q4_k_m")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--shape", default="llama2-7b", choices=sorted(SHAPES), help="the model's shapes (qwen2-7b keeps its layers but a 32,000-token vocabulary)"
    )
    parser.add_argument("--mix", default="q4_0", choices=MIXES, help="quantization types of the weights")
    parser.add_argument(
        "--file", default=None, metavar="GGUF", help="measure this GGUF file instead of writing a synthetic one (--shape and --mix then unused)"
    )
    parser.add_argument("--dir", default=None, help="where the file is written (default: $RADIXSERVE_CACHE/bench or ~/.cache/radixserve/bench)")
    parser.add_argument(
        "--weights", default="auto", choices=["auto", "quantized", "dequantize"], help="how the engine holds the GGUF's weights (radixserve's --weights)"
    )
    parser.add_argument(
        "--quant-compute", default="auto", choices=["auto", "int8", "fp32"], help="how decode multiplies the quantized weights (radixserve's --quant-compute)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    parser.add_argument("--kv-cache-tokens", type=int, default=4096, help="the engine's KV pool")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens generated after the load")
    parser.add_argument("--loads", type=int, default=2, help="loads timed (the first may read the file from disk)")
    parser.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench binary: a tgN run of it on the same file before each load, and each round's ratio (installs nothing)",
    )
    parser.add_argument("--max-rss-ratio", type=float, default=1.15, help="the RSS target: at most this times the file's size, plus the KV pool")
    parser.add_argument("--json", action="store_true")


def model_file(args) -> Path:
    root = Path(args.dir) if args.dir else Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve")) / "bench"
    return root / f"{args.shape}-{args.mix}-random.gguf"


def qtype_of(mix: str):
    def pick(name: str) -> int:
        if mix == "q4_0":
            return 2
        if name.endswith(("attn_v.weight", "ffn_down.weight", "output.weight")):
            return 14  # Q6_K
        return 12  # Q4_K

    return pick


def write(args, path: Path) -> None:
    from radixserve.testing_gguf import write_synthetic_gguf

    shape = dict(SHAPES[args.shape])
    arch = shape.pop("arch")
    cfg = dict(shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    start = time.perf_counter()
    print(f"writing {path} ({args.shape}, {args.mix}, random weights; once) ...", file=sys.stderr, flush=True)
    write_synthetic_gguf(tmp, cfg, qtype_of(args.mix), arch=arch)
    tmp.replace(path)
    print(f"wrote {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s", file=sys.stderr)


CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from radixserve import Engine, SamplingParams

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

from radixserve.kernels import build
build.load()  # (built or loaded before the baseline: every engine process has it)
base_rss = rss()
start = time.perf_counter()
engine = Engine(sys.argv[1], kv_cache_tokens=int(sys.argv[3]), max_running=1, weights=sys.argv[5], quant_compute=sys.argv[6])
load_s = time.perf_counter() - start
loaded_rss = rss()
engine.pool.commit(-(-(64 + int(sys.argv[4]) + 8) // engine.pool.page_size) + 1)  # (the pages it will use: no page faults timed)
steps = []
req = engine.make_request(list(range(7, 71)), SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0, ignore_eos=True))
engine.add_request(req)
engine.step()  # drains the inbox and prefills the prompt
while engine.scheduler.has_work:
    t0 = time.perf_counter()
    engine.step()
    steps.append(time.perf_counter() - t0)
pool = engine.pool
g = engine.loaded.gguf
print(json.dumps({"load_s": load_s, "rss_base": base_rss, "rss_loaded": loaded_rss, "rss_after": rss(),
                  "kv_bytes": sum(t.numel() * t.element_size() for t in pool.k + pool.v),
                  "held_bytes": sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
                                + (g.quantized_bytes if g else 0),
                  "quantized_bytes": g.quantized_bytes if g else 0, "read_bytes": engine.loaded.model.weight_bytes(),
                  "decode_ms": statistics.median(steps[1:]) * 1e3, "steps": len(steps)}))
"""


def run(args) -> int:
    from bench.roofline import bandwidth
    from radixserve.ops.model_shape import read_model_shape

    path = Path(args.file) if args.file else model_file(args)
    if not path.is_file():
        if args.file:
            raise SystemExit(f"--file {args.file}: no such file")
        write(args, path)
    size = path.stat().st_size
    planned = read_model_shape(str(path), dequantize=args.weights == "dequantize").weights_bytes
    llama_cmd = llama_bench_command(args, path)
    if llama_cmd and not args.json:
        print(f"llama.cpp each round: {shlex.join(llama_cmd)}", flush=True)
    loads, rounds = [], []
    for i in range(args.loads):
        llama_tok_s = llama_bench(llama_cmd) if llama_cmd else None
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(args.threads), str(args.kv_cache_tokens), str(args.tokens), args.weights, args.quant_compute],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        loads.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"load {i + 1}: {loads[-1]['load_s']:.1f} s", file=sys.stderr)
        if llama_tok_s is not None:
            ours = 1e3 / loads[-1]["decode_ms"]
            rounds.append({"llama_cpp_tok_s": llama_tok_s, "radixserve_tok_s": ours, "ratio": ours / llama_tok_s})
            if not args.json:
                print(f"  round {i + 1}: llama.cpp {llama_tok_s:.2f} tok/s, radixserve {ours:.2f} tok/s: {ours / llama_tok_s:.2f}x", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    bw = bandwidth(1024)
    last = loads[-1]
    limit = args.max_rss_ratio * size + last["kv_bytes"]
    result = {
        "file": str(path),
        "file_bytes": size,
        "plan_weight_bytes": planned,
        "held_weight_bytes": last["held_bytes"],
        "load_s": [x["load_s"] for x in loads],
        "rss_base": last["rss_base"],
        "rss_loaded": last["rss_loaded"],
        "rss_after": last["rss_after"],
        "kv_bytes": last["kv_bytes"],
        "rss_limit": limit,
        "decode_ms": statistics.median(x["decode_ms"] for x in loads),
        "read_bytes": last["read_bytes"],
        "bandwidth_gb_s": bw / 1e9,
        "threads": args.threads,
    }
    result["floor_ms"] = last["read_bytes"] / bw * 1e3
    if rounds:
        result["llama_cpp_rounds"] = rounds
        result["ratio_median"] = statistics.median(r["ratio"] for r in rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    gib = 2**30
    print(f"{path.name}: {size / gib:.2f} GiB file; {args.threads} thread(s)")
    print(f"  load: {', '.join(f'{s:.1f} s' for s in result['load_s'])} (first, then warm)")
    print(
        f"  weights held: {result['held_weight_bytes'] / gib:.3f} GiB; radixserve plan: {planned / gib:.3f} GiB "
        f"({'agree' if abs(planned - result['held_weight_bytes']) <= 0.001 * planned else 'DISAGREE'})"
    )
    print(
        f"  RSS: {result['rss_loaded'] / gib:.2f} GiB after the load, {result['rss_after'] / gib:.2f} GiB after "
        f"{args.tokens} tokens; limit {args.max_rss_ratio} x file + KV {result['kv_bytes'] / gib:.2f} GiB = "
        f"{limit / gib:.2f} GiB ({'within' if result['rss_after'] <= limit else 'OVER'}); the engine grew the process "
        f"by {(result['rss_after'] - result['rss_base']) / gib:.2f} GiB (from {result['rss_base'] / gib:.2f} GiB of "
        "runtime before it)"
    )
    print(
        f"  batch-1 decode: {result['decode_ms']:.1f} ms/token ({1e3 / result['decode_ms']:.1f} tok/s); floor "
        f"{result['read_bytes'] / 1e9:.2f} GB / {result['bandwidth_gb_s']:.1f} GB/s = {result['floor_ms']:.1f} ms "
        f"({result['decode_ms'] / result['floor_ms']:.2f}x)"
    )
    if rounds:
        ratios = ", ".join(f"{r['ratio']:.2f}" for r in rounds)
        print(
            f"  batch-1 decode against llama.cpp: {result['ratio_median']:.2f}x, the median of {len(rounds)} rounds' ratios "
            f"({ratios}; above 1: radixserve is faster)"
        )
    return 0


def llama_bench_command(args, path: Path) -> list[str] | None:
    if not args.llama_bench:
        return None
    binary = Path(args.llama_bench).expanduser()
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise SystemExit(f"--llama-bench {args.llama_bench}: no such executable (bench/README.md says how to build llama-bench)")
    return [args.llama_bench, "-m", str(path), "-n", str(args.tokens), "-p", "0", "-t", str(args.threads), "-r", "2", "-o", "json"]


def llama_bench(cmd: list[str]) -> float:
    """llama-bench's mean decode tok/s over its repetitions."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed ({out.returncode}): {out.stderr[-2000:]}")
    try:
        return float(json.loads(out.stdout)[0]["avg_ts"])
    except (ValueError, LookupError, TypeError) as exc:
        raise SystemExit(f"llama-bench printed no result ({exc}): {out.stdout[-2000:]}") from None
