"""radixserve next to vLLM-CPU (or, with --peer llamacpp, llama.cpp's llama-server: see
bench/llamacpp.py): the same token-id workloads through both engines, in one run.

Workloads (greedy, ignore_eos, token ids only, the bench model unless --model):

* fleet: A agents share an S-token system prompt, each has a P-token private state and plays T
  turns (closed loop: an agent's next turn is sent the moment its previous one finished; a turn's
  prompt is system + private + every earlier turn's output + a 16-token observation);
* gsp: G groups x Q prompts of a group prefix + a unique question, shuffled, sent at once.

Each engine runs in a child process of its own, one after the other (never both at once), with
the same thread count; vLLM gets every core (VLLM_CPU_OMP_THREADS_BIND=0-N,
VLLM_CPU_NUM_OF_RESERVED_CPU=0) and its engine core in-process. Each runs with its own OpenMP
defaults: radixserve's short barrier spin (radixserve.runtime.default_omp_wait) is not passed
to vLLM, which keeps libgomp's; OMP_* / GOMP_* variables you set reach both. Likewise radixserve
sets its malloc settings (radixserve.runtime.default_malloc) in its own child only; MALLOC_* or
GLIBC_TUNABLES variables you set reach both (and turn radixserve's off). Both get one warm-up
request first; model loading is not timed. Printed per engine: wall time, output tok/s, TTFT p50/p99
(measured the same way for both: submit -> first step that returns a token), computed prompt
tokens (prompt - cached), the minor page faults and system CPU seconds of the timed part, then
the radixserve/vLLM ratios and whether every request's tokens are equal. With --rounds N, each
workload runs N times, the engines in turn (which goes first alternates), and each round's walls
and ratios are printed before the medians (of each number, and of the rounds' ratios). With --breakdown,
radixserve's timed steps are also split into steps with prompt tokens and decode-only steps:
their seconds, the attention backend's share of the former with its FLOP rate (and, on the
csrc/ backend, split by kernel call: cascade prefix and suffix levels, many-row chunks, the decode
kernel, KV store and merges), and the rate of the layers' linear maps over the rest (compare with
`python -m bench floor`'s GEMM rate). With --floor, each round ends with `python -m bench floor`
in a child process (the workload's FLOPs at the GEMM rate measured right then): each engine's wall
over that floor, and the floor over vLLM's wall, so one run shows where the 0.67x target sits
against what no engine can beat on this machine at that minute. This command installs
nothing: vLLM must be importable by --vllm-python (default: this interpreter), e.g. a venv made
as bench/README.md describes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.shapes import Shape, model_config

HELP = "radixserve vs vLLM-CPU or llama.cpp side by side on the fleet and GSP token workloads (needs a vLLM install or a llama-server)"

ROOT = Path(__file__).resolve().parents[1]
OBSERVATION_TOKENS = 16
SEED = 7
RESULT = "PEERS-RESULT "
WALL_TARGET = 0.67  # issue 11's target: radixserve's wall at most this times vLLM's
PEERS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}  # --peer: the name printed


class UsageError(Exception):
    """A bad command line or a peer that cannot run: one line on stderr, exit status 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer",
        default="vllm",
        choices=sorted(PEERS),
        help="the engine next to radixserve: vLLM in-process (in --vllm-python), or llama.cpp's llama-server "
        "(--llama-server) with radixserve behind its HTTP gateway, both on the same GGUF",
    )
    p.add_argument("--vllm-python", default=None, metavar="PATH", help="python of an environment where vllm imports (default: this one)")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="--peer llamacpp: the llama-server binary")
    p.add_argument("--engines", default=None, help="comma list from radixserve and the peer (default: both)")
    p.add_argument("--workloads", default="fleet,gsp", help="comma list from fleet,gsp")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' dtype")
    p.add_argument(
        "--model", default=None, metavar="PATH", help="model directory (default: the bench model); --peer llamacpp: a .gguf file (default: SmolLM2's)"
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of each engine")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--private-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=8, help="output tokens per fleet turn")
    p.add_argument("--gsp-groups", type=int, default=16)
    p.add_argument("--gsp-prompts", type=int, default=8)
    p.add_argument("--gsp-prefix", type=int, default=1024)
    p.add_argument("--gsp-question", type=int, default=128)
    p.add_argument("--gsp-output", type=int, default=8)
    p.add_argument("--max-running", type=int, default=64, help="fleet: most running requests (both engines)")
    p.add_argument("--gsp-max-running", type=int, default=16, help="gsp: most running requests (both engines)")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget of one step (both engines)")
    p.add_argument(
        "--attention", default="auto", choices=["auto", "cpu", "torch"], help="radixserve's attention backend (auto: the csrc/ kernels when they build)"
    )
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (no torch.compile)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds each engine run may take")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each workload this many times, the engines in turn (the first one alternating); print each round and the medians",
    )
    p.add_argument("--breakdown", action="store_true", help="also split radixserve's time by step kind: attention and linear-map rates (see above)")
    p.add_argument(
        "--floor",
        action="store_true",
        help="after each round, measure the workload's compute floor (`python -m bench floor`: its FLOPs "
        "at the GEMM rate measured then, --max-batched-tokens rows) and print it next to the walls",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", default=None, help=argparse.SUPPRESS)


# -- workloads (numpy only: the vLLM environment has no radixserve) -------------------------------
def _rng(*seed):
    import numpy as np

    return np.random.default_rng(list(seed))


def _ids(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(7, vocab, size=n).tolist()  # ids < 7 are the bench tokenizer's special tokens


def _own_usage() -> tuple[int, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_stime


def drive(adapter, spec: dict) -> dict:
    """Run one workload through an adapter (submit / step); returns per-request records, and the
    minor page faults and system CPU seconds of the timed part (of this process, or of the
    server behind an adapter that has ``usage()``)."""
    vocab, w = spec["vocab"], spec["workload"]
    submitted: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, dict] = {}
    pending: list[tuple[str, list[int], int]] = []
    if w == "fleet":
        system = _ids(_rng(SEED, 0), spec["system_tokens"], vocab)
        private = [_ids(_rng(SEED, 1, a), spec["private_tokens"], vocab) for a in range(spec["agents"])]
        obs = [[_ids(_rng(SEED, 2, a, t), OBSERVATION_TOKENS, vocab) for t in range(spec["turns"])] for a in range(spec["agents"])]
        history: list[list[int]] = [[] for _ in range(spec["agents"])]
        total = spec["agents"] * spec["turns"]
        pending = [(f"a{a}-t0", system + private[a], spec["output_tokens"]) for a in range(spec["agents"])]
    else:
        prompts = []
        for g in range(spec["groups"]):
            prefix = _ids(_rng(SEED, 10, g), spec["prefix_tokens"], vocab)
            for q in range(spec["prompts"]):
                prompts.append((f"g{g}-q{q}", prefix + _ids(_rng(SEED, 11, g, q), spec["question_tokens"], vocab)))
        order = _rng(SEED, 12).permutation(len(prompts)).tolist()
        pending = [(prompts[i][0], prompts[i][1], spec["output_tokens"]) for i in order]
        total = len(pending)
    usage = getattr(adapter, "usage", _own_usage)
    faults0, system0 = usage()
    t0 = time.perf_counter()
    last_log = t0
    while len(done) < total:
        for rid, ids, n in pending:
            submitted[rid] = time.perf_counter()
            adapter.submit(rid, ids, n)
        pending = []
        for rid, has_token, final in adapter.step():
            now = time.perf_counter()
            if has_token and rid not in first:
                first[rid] = now
            if final is None:
                continue
            done[rid] = {"ttft_s": first.get(rid, now) - submitted[rid], **final}  # (or the adapter's own, from server timings)
            if w == "fleet":
                a, t = (int(x[1:]) for x in rid.split("-"))
                if t + 1 < spec["turns"]:
                    history[a] = history[a] + final["tokens"] + obs[a][t]
                    pending.append((f"a{a}-t{t + 1}", system + private[a] + history[a], spec["output_tokens"]))
        if time.perf_counter() - last_log > 10:
            last_log = time.perf_counter()
            print(f"  {spec['engine']} {w}: {len(done)}/{total} requests, {last_log - t0:.0f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    faults, system = usage()
    return {"wall_s": wall, "requests": done, "page_faults": faults - faults0, "system_s": system - system0}


class RadixAdapter:
    def __init__(self, spec: dict):
        from radixserve import Engine, SamplingParams  # before torch: it sets the OpenMP wait policy
        # isort: split

        import torch

        torch.set_num_threads(spec["threads"])
        self.params = SamplingParams
        self.engine = Engine(
            spec["model"],
            dtype=spec["dtype"],
            max_running=spec["max_running"],
            max_batched_tokens=spec["max_batched_tokens"],
            kv_cache_tokens=spec["kv_tokens"],
            seed=0,
            attention=spec.get("attention", "auto"),
        )
        from radixserve.kernels.gemm import gemm_backend

        # the attention backend and the GEMM backend the load chose (RADIXSERVE_CPU_GEMM)
        gemm = gemm_backend(getattr(torch, spec["dtype"]))
        self.backend = f"{type(self.engine.runner.attention).__name__}/{gemm}"
        self.live: dict = {}  # request id -> Request, until it finishes
        self.steps: list[dict] | None = None  # per timed step with --breakdown (record_steps)
        self._current: dict = {}  # the step being recorded

    def record_steps(self) -> None:
        """From now on, time each engine step and note what its forward computed: new tokens,
        sequences, visible keys (summed over the new tokens, bottom-right causal), sampled rows and
        the seconds inside the attention backend's forward (decode steps that run their layers in
        one native call never enter it: their attention is not split out)."""
        self.steps = []
        runner, attention = self.engine.runner, self.engine.runner.attention
        forward, attend = runner.forward, attention.forward

        def timed_forward(items, groups=()):
            n = [item.num_tokens for item in items]
            self._current.update(
                tokens=sum(n), seqs=len(n), decode=all(k == 1 for k in n), keys=sum(k * item.start + k * (k + 1) // 2 for k, item in zip(n, items))
            )
            out = forward(items, groups)
            self._current["sampled"] = int(out.logits.shape[0])
            return out

        def timed_attend(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attend(*args, **kwargs)
            finally:
                self._current["attention_s"] += time.perf_counter() - start

        runner.forward = timed_forward  # (instance attributes: they shadow the methods)
        attention.forward = timed_attend
        if getattr(attention, "ext", None) is not None:  # the csrc/ backend: time each kernel call too
            attention.ext = _TimedKernels(attention, self)

    def note_call(self, kind: str, seconds: float, shape: tuple | None) -> None:
        """A timed kernel call of the current step; its FLOPs are counted after the step (shape:
        what _visible_keys takes, and query heads x head_dim), outside the timed part."""
        self._current.setdefault("raw_calls", []).append((kind, seconds, shape))

    def _count_calls(self, step: dict) -> None:
        calls: dict[str, list[float]] = {}
        for kind, seconds, shape in step.pop("raw_calls", []):
            entry = calls.setdefault(kind, [0.0, 0.0])
            entry[0] += seconds
            if shape is not None:
                *meta, width = shape
                entry[1] += 4.0 * width * _visible_keys(*meta)
        step["calls"] = calls

    def submit(self, rid: str, ids: list[int], n: int) -> None:
        params = self.params(max_tokens=n, temperature=0.0, ignore_eos=True)
        req = self.engine.make_request(ids, params, request_id=rid)
        self.live[rid] = req
        self.engine.add_request(req)

    def step(self):
        # Requests do not stream (no per-step detokenizing, like vLLM's detokenize=False), so the
        # engine only returns final chunks: a first token is seen on the request itself, right
        # after the step that sampled it -- the same point vLLM's step() reports it.
        if self.steps is None:
            chunks = self.engine.step()
        else:
            self._current = {"attention_s": 0.0, "tokens": 0}
            start = time.perf_counter()
            chunks = self.engine.step()
            if self._current["tokens"]:
                self.steps.append({**self._current, "s": time.perf_counter() - start})
                self._count_calls(self.steps[-1])
        for chunk in chunks:
            out = chunk.output
            final = None if out is None else {"tokens": list(out.token_ids), "prompt": out.prompt_tokens, "cached": out.cached_tokens}
            if final is not None:
                self.live.pop(chunk.request_id, None)
            yield chunk.request_id, bool(chunk.token_ids) or out is not None, final
        for rid, req in self.live.items():
            if req.out.output_ids:
                yield rid, True, None


def _visible_keys(qo_indptr, kv_indptr, last_page_len, page_size: int, causal: bool) -> int:
    """Query-key pairs a paged attention call computes (bottom-right causal or not)."""
    qo, kv, last = qo_indptr.tolist(), kv_indptr.tolist(), last_page_len.tolist()
    total = 0
    for i in range(len(qo) - 1):
        n, pages = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
        keys = (pages - 1) * page_size + last[i] if pages else 0
        total += n * keys - (n * (n - 1) // 2 if causal else 0)
    return total


class _TimedKernels:
    """The CPU attention backend's kernels (csrc/), each call timed (--breakdown) and named by
    what it computes: "cascade prefix" (a cascade group's new tokens against the shared prefix),
    "cascade suffix" (the members' tokens against their own suffixes), "chunks" (many-row
    chunks on the GEMM kernel), "decode kernel" (decodes and short extends in no group), "other"
    (KV store, LSE merge)."""

    def __init__(self, attention, adapter: RadixAdapter):
        self._attention, self._ext, self._adapter = attention, attention.ext, adapter

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def _call(self, fn, args, kind: str | None):
        start = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - start
        if kind is None:
            self._adapter.note_call("other", seconds, None)
        else:  # (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale, causal)
            q, k_cache = args[0], args[1]
            shape = (args[3], args[4], args[6], k_cache.shape[1], args[8], q.shape[1] * q.shape[2])
            self._adapter.note_call(kind, seconds, shape)
        return out

    def _suffix(self, qo_indptr) -> bool:
        return self._attention.suffix_level(qo_indptr)

    def prefill_attention(self, *args):
        kind = "cascade prefix" if not args[8] else "cascade suffix" if self._suffix(args[3]) else "chunks"
        return self._call(self._ext.prefill_attention, args, kind)

    def paged_attention(self, *args):
        return self._call(self._ext.paged_attention, args, "cascade suffix" if self._suffix(args[3]) else "decode kernel")

    def store_kv(self, *args):
        return self._call(self._ext.store_kv, args, None)

    def merge_state(self, *args):
        return self._call(self._ext.merge_state, args, None)


class VllmAdapter:
    def __init__(self, spec: dict):
        from vllm import EngineArgs, LLMEngine, SamplingParams

        self.params = SamplingParams
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=spec["model"],
                dtype=spec["dtype"],
                enable_prefix_caching=True,
                skip_tokenizer_init=True,
                max_num_seqs=spec["max_running"],
                max_num_batched_tokens=spec["max_batched_tokens"],
                seed=0,
                max_model_len=spec["max_model_len"],
                enforce_eager=spec["vllm_eager"],
            )
        )
        self.backend = "vllm"

    def submit(self, rid: str, ids: list[int], n: int) -> None:
        from vllm.inputs import TokensPrompt

        params = self.params(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)

    def step(self):
        for out in self.engine.step():
            tokens = list(out.outputs[0].token_ids) if out.outputs else []
            final = None if not out.finished else {"tokens": tokens, "prompt": len(out.prompt_token_ids), "cached": int(out.num_cached_tokens or 0)}
            yield out.request_id, bool(tokens), final


def child(engine: str, spec: dict) -> None:
    if engine == "vllm":
        cpus = f"0-{spec['threads'] - 1}"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec["kv_gib"]))
    else:  # radixserve's malloc settings, as its CLI and workers make them (vLLM keeps glibc's defaults)
        from radixserve.runtime import default_malloc

        default_malloc()
    print(RESULT + json.dumps(measure(lambda: (VllmAdapter if engine == "vllm" else RadixAdapter)(spec), engine, spec)), flush=True)


def measure(start, engine: str, spec: dict) -> dict:
    """Start an engine (``start()``: an adapter; load not timed), warm it up with one small
    untimed burst, run the workload; the adapter is closed at the end when it has ``close()``."""
    t = time.perf_counter()
    adapter = start()
    load_s = time.perf_counter() - t
    try:
        warm = {**spec, "workload": "gsp", "groups": 1, "prompts": 2, "prefix_tokens": 64, "question_tokens": 8, "output_tokens": 4}
        drive(adapter, {**warm, "vocab": spec["vocab"], "system_tokens": 0})  # untimed warm-up; other ids than the workload's
        if spec.get("breakdown") and engine == "radixserve":
            adapter.record_steps()
        result = drive(adapter, spec)
    finally:
        if hasattr(adapter, "close"):
            adapter.close()
    result.update(engine=engine, backend=adapter.backend, load_s=load_s)
    if getattr(adapter, "command", None):
        result["command"] = " ".join(adapter.command)
    if getattr(adapter, "steps", None) is not None:
        result["steps"] = adapter.steps
    return result


# -- parent ----------------------------------------------------------------------------------
def _vocab(model: str) -> tuple[int, int]:
    cfg = model_config(model)
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings", 8192))


def specs(args, model: str) -> dict[str, dict]:
    vocab, max_pos = _vocab(model)
    common = dict(
        model=model,
        vocab=vocab,
        dtype=args.dtype,
        threads=args.threads,
        breakdown=args.breakdown,
        max_batched_tokens=args.max_batched_tokens,
        vllm_eager=args.vllm_eager,
        attention=args.attention,
    )
    if args.peer == "llamacpp":  # both engines behind HTTP servers on the GGUF
        common.update(gguf=model, llama_server=args.llama_server)
    fleet_longest = args.system_tokens + args.private_tokens + args.turns * (args.output_tokens + OBSERVATION_TOKENS)
    fleet_tokens = args.system_tokens + args.agents * (fleet_longest - args.system_tokens)
    gsp_tokens = args.gsp_groups * (args.gsp_prefix + args.gsp_prompts * (args.gsp_question + args.gsp_output))
    out = {
        "fleet": dict(
            common,
            workload="fleet",
            agents=args.agents,
            system_tokens=args.system_tokens,
            private_tokens=args.private_tokens,
            turns=args.turns,
            output_tokens=args.output_tokens,
            max_running=args.max_running,
            tokens=fleet_tokens,
            max_model_len=min(max_pos, max(2048, fleet_longest + 64)),
        ),
        "gsp": dict(
            common,
            workload="gsp",
            groups=args.gsp_groups,
            prompts=args.gsp_prompts,
            prefix_tokens=args.gsp_prefix,
            question_tokens=args.gsp_question,
            output_tokens=args.gsp_output,
            max_running=args.gsp_max_running,
            tokens=gsp_tokens,
            max_model_len=min(max_pos, max(2048, args.gsp_prefix + args.gsp_question + args.gsp_output + 64)),
        ),
    }
    cfg = model_config(model)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * (4 if args.dtype == "float32" else 2)
    for s in out.values():
        # Room for everything the workload computes (no eviction in either engine), plus slack.
        s["kv_tokens"] = -(-int(s["tokens"] * 1.25 + 4096) // 256) * 256
        s["kv_gib"] = max(1, -(-s["kv_tokens"] * per_token // (1 << 30)))
    return out


def run_child(python: str, engine: str, spec: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if engine == "vllm":  # vLLM at its own OpenMP defaults: not radixserve's spin count (yours reach both)
        from radixserve.runtime import defaulted_env

        for key in defaulted_env():
            env.pop(key, None)
    cmd = [python, "-m", "bench.peers", "--child", engine, "--spec", json.dumps(spec)]
    print(f"{engine} {spec['workload']} ({spec['dtype']}, {spec['threads']} threads): starting", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} {spec['workload']} failed (exit {proc.returncode}); see its stderr above")
    return json.loads(lines[-1][len(RESULT) :])


FLOOR_FLAGS = ("agents", "system_tokens", "private_tokens", "turns", "output_tokens", "gsp_groups", "gsp_prompts", "gsp_prefix", "gsp_question", "gsp_output")


def measure_floor(args: argparse.Namespace, model: str, workload: str, timeout: float = 600) -> dict:
    """``python -m bench floor`` for this workload's shapes, dtype and thread count, in a child
    process of its own (nothing of it stays behind to disturb the engines' runs): the GEMM rate
    measured now and the seconds the workload's arithmetic takes at that rate."""
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "floor",
        "--json",
        "--model",
        model,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--rows",
        str(args.max_batched_tokens),
    ]
    for flag in FLOOR_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench floor failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    row = next(r for r in res["rows"] if r["workload"] == workload)
    return {"floor_s": row["floor_s"], "gemm_gflop_per_s": res["gemm_gflop_per_s"]}


def floor_ratios(entry: dict, floor: dict) -> dict:
    """Each engine's wall over the floor, and the floor over the peer's wall (where the 0.67x
    target sits against what no engine can beat)."""
    walls = {e: s["wall_s"] for e, s in entry["engines"].items()}
    out = {**floor, **{f"{e}_over_floor": w / floor["floor_s"] for e, w in walls.items()}}
    for peer in set(walls) & set(PEERS):
        out[f"floor_over_{peer}"] = floor["floor_s"] / walls[peer]
    return out


def summary(res: dict) -> dict:
    from radixserve.ops.stats import percentile  # here: the vLLM child may run where radixserve is not installed

    reqs = res["requests"].values()
    ttft = [r["ttft_s"] * 1e3 for r in reqs]
    out_tokens = sum(len(r["tokens"]) for r in reqs)
    return {
        "backend": res["backend"],
        "wall_s": res["wall_s"],
        "out_tok_per_s": out_tokens / res["wall_s"],
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "prompt_tokens": sum(r["prompt"] for r in reqs),
        "computed_prompt_tokens": sum(r["prompt"] - r["cached"] for r in reqs),
        "requests": len(res["requests"]),
        "page_faults": res.get("page_faults"),
        "system_s": res.get("system_s"),
        "command": res.get("command"),
    }


def breakdown(steps: list[dict], model: str) -> dict:
    """radixserve's recorded steps in two kinds: "prompt" (some sequence computes more than one
    new token) and "decode" (every sequence one). Per kind: steps, seconds, the median step,
    tokens; the seconds inside the attention backend with its FLOP rate (QK^T and PV over the
    visible keys); the rest with the rate of the layers' linear maps and the output embedding
    over the sampled rows (the rest also holds the norms, RoPE, sampling and Python)."""
    from radixserve.ops.stats import percentile

    shape = Shape(model_config(model))
    out = {}
    for kind, chosen in (("prompt", [s for s in steps if not s["decode"]]), ("decode", [s for s in steps if s["decode"]])):
        if not chosen:
            continue
        total = sum(s["s"] for s in chosen)
        attention_s = sum(s["attention_s"] for s in chosen)
        tokens = sum(s["tokens"] for s in chosen)
        attention_flop = shape.attention_flops(sum(s["keys"] for s in chosen if s["attention_s"] > 0))
        linear_flop = shape.linear_flops(tokens) + shape.lm_head_flops(sum(s["sampled"] for s in chosen))
        rest = total - attention_s
        calls: dict[str, list[float]] = {}
        for s in chosen:
            for name, (seconds, flop) in s.get("calls", {}).items():
                entry = calls.setdefault(name, [0.0, 0.0])
                entry[0] += seconds
                entry[1] += flop
        out[kind] = {
            "steps": len(chosen),
            "s": total,
            "median_step_ms": percentile([s["s"] * 1e3 for s in chosen], 50),
            "tokens": tokens,
            "attention_s": attention_s,
            "attention_gflop_per_s": attention_flop / attention_s / 1e9 if attention_s > 0 else None,
            "attention_calls": {
                name: {"s": sec, "gflop": flop / 1e9, "gflop_per_s": flop / sec / 1e9 if flop and sec > 0 else None}
                for name, (sec, flop) in sorted(calls.items(), key=lambda kv: -kv[1][0])
            },
            "rest_s": rest,
            "linear_gflop": linear_flop / 1e9,
            "linear_gflop_per_s": linear_flop / rest / 1e9 if rest > 0 else None,
        }
    return out


def compare(runs: dict[str, dict], model: str) -> dict:
    """One round's entry: each engine's summary, radixserve's breakdown when recorded, and with
    both engines the radixserve/peer ratios and how many requests' tokens are equal."""
    entry: dict = {"engines": {e: summary(r) for e, r in runs.items()}}
    if "steps" in runs.get("radixserve", {}):
        entry["breakdown"] = breakdown(runs["radixserve"]["steps"], model)
    if len(runs) == 2:
        peer = next(e for e in runs if e != "radixserve")
        a, b = runs["radixserve"], runs[peer]
        same = sum(a["requests"][rid]["tokens"] == b["requests"].get(rid, {}).get("tokens") for rid in a["requests"])
        sa, sb = entry["engines"]["radixserve"], entry["engines"][peer]
        entry["ratios"] = {
            "wall": sa["wall_s"] / sb["wall_s"],
            "ttft_p50": sa["ttft_p50_ms"] / sb["ttft_p50_ms"],
            "ttft_p99": sa["ttft_p99_ms"] / sb["ttft_p99_ms"],
            "computed_prompt_tokens": sa["computed_prompt_tokens"] / max(1, sb["computed_prompt_tokens"]),
        }
        entry["equal_requests"] = f"{same}/{len(a['requests'])}"
    return entry


def median_of(rounds: list[dict]) -> dict:
    """The medians over rounds: of each engine's numbers, and of the ratios, each round's ratio
    taken between two runs next to each other (so a slow minute slows both sides of one ratio)."""
    from statistics import median

    engines = {}
    for e, first in rounds[0]["engines"].items():
        engines[e] = {k: (median(r["engines"][e][k] for r in rounds) if isinstance(v, (int, float)) else v) for k, v in first.items()}
    out: dict = {"engines": engines}
    if "floor" in rounds[0]:
        out["floor"] = {k: median(r["floor"][k] for r in rounds) for k in rounds[0]["floor"]}
    if "ratios" in rounds[0]:
        out["ratios"] = {k: median(r["ratios"][k] for r in rounds) for k in rounds[0]["ratios"]}
        equal = [r["equal_requests"] for r in rounds]
        out["equal_requests"] = equal[0] if len(set(equal)) == 1 else " ".join(equal)
    return out


def _setup(args: argparse.Namespace) -> tuple[str, list[str], dict]:
    """The model, the engines to run and what the result says about the peer; UsageError when
    the command line asks for what cannot run."""
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, not {args.rounds}")
    engines = [e.strip() for e in (args.engines or f"radixserve,{args.peer}").split(",") if e.strip()]
    unknown = [e for e in engines if e not in ("radixserve", args.peer)]
    if unknown or not engines:
        raise UsageError(f"--engines {args.engines}: give radixserve and/or {args.peer} (the --peer)")
    if args.peer == "llamacpp":
        return _setup_llamacpp(args, engines)
    if args.model:
        model = str(Path(args.model).expanduser())
    else:
        from bench.models import bench_model_path

        model = str(bench_model_path())
    if "vllm" not in engines:
        return model, engines, {}
    vllm_python = args.vllm_python or sys.executable
    probe = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise UsageError(
            f"vllm does not import in {vllm_python}; give --vllm-python /path/to/venv/bin/python (bench/README.md says how to make one) or --engines radixserve"
        )
    return model, engines, {"vllm_version": probe.stdout.strip()}


def _setup_llamacpp(args: argparse.Namespace, engines: list[str]) -> tuple[str, list[str], dict]:
    from bench.llamacpp import check_binary, version
    from radixserve.model.default import INSTALL_HINT, smollm2_gguf
    from radixserve.model.gguf import is_gguf

    if args.breakdown:
        raise UsageError("--breakdown times radixserve in-process: not with --peer llamacpp (both engines serve over HTTP)")
    model = args.model or smollm2_gguf()
    if model is None:
        raise UsageError(f"--peer llamacpp needs a GGUF file: --model FILE.gguf, or SmolLM2's ({INSTALL_HINT})")
    model = str(Path(model).expanduser())
    if not Path(model).is_file() or not is_gguf(model):
        raise UsageError(f"--model {model}: not a GGUF file (--peer llamacpp runs both engines on one GGUF)")
    if "llamacpp" not in engines:
        return model, engines, {}
    problem = check_binary(args.llama_server)
    if problem:
        raise UsageError(problem)
    return model, engines, {"llama_server": args.llama_server, "llama_server_version": version(args.llama_server)}


def run_engine(args: argparse.Namespace, engine: str, spec: dict) -> dict:
    """One engine's run of one workload: in a child process of its own, or (--peer llamacpp)
    behind the HTTP server this process starts and stops for it."""
    if args.peer == "llamacpp":
        from bench.llamacpp import start

        print(f"{engine} {spec['workload']} ({spec['threads']} threads): starting", file=sys.stderr, flush=True)
        return measure(lambda: start(engine, spec, args.timeout), engine, spec)
    python = (args.vllm_python or sys.executable) if engine == "vllm" else sys.executable
    return run_child(python, engine, spec, args.timeout)


def run(args: argparse.Namespace) -> int:
    if args.child:
        child(args.child, json.loads(args.spec))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.llamacpp import ServerStartError

    try:
        model, engines, about = _setup(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    all_specs = specs(args, model)
    result = {"command": "peers", "peer": args.peer, "model": model, "dtype": args.dtype, "threads": args.threads, **about, "workloads": {}}
    for w in workloads:
        spec = all_specs[w]
        rounds = []
        for k in range(args.rounds):  # each round: both engines, one after the other, alternating which goes first
            order = engines if k % 2 == 0 else engines[::-1]
            try:
                runs = {e: run_engine(args, e, {**spec, "engine": e}) for e in order}
            except ServerStartError as exc:
                print(exc, file=sys.stderr)
                return 2
            rounds.append(compare({e: runs[e] for e in engines}, model))
            if args.floor:
                rounds[-1]["floor"] = floor_ratios(rounds[-1], measure_floor(args, model, w))
        entry = {"config": {k: v for k, v in spec.items() if k not in ("model",)}, **rounds[0]}
        if len(rounds) > 1:
            entry.update(median_of(rounds))
            entry["rounds"] = rounds
        result["workloads"][w] = entry
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(render(result))
    return 0


def _floor_words(r: dict, peer: str) -> str:
    if "floor" not in r:
        return ""
    f = r["floor"]
    words = f"; floor {f['floor_s']:.2f} s"
    over = f"floor_over_{peer}"
    return words + (f", floor / {PEERS[peer]} {f[over]:.2f}x" if over in f else "")


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,.0f}"  # (a median over an even number of rounds may be a half)


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}"


def render(res: dict) -> str:
    peer = res.get("peer", "vllm")
    name = PEERS[peer]
    lines = [
        f"model {res['model']}, {res['dtype']}, {res['threads']} threads per engine"
        + (f", vLLM {res['vllm_version']}" if "vllm_version" in res else "")
        + (f", llama-server {res['llama_server']} ({res['llama_server_version']})" if "llama_server" in res else "")
    ]
    head = (
        f"{'engine':<12}{'backend':<22}{'wall (s)':>10}{'out tok/s':>11}{'TTFT p50 (ms)':>15}{'TTFT p99 (ms)':>15}"
        f"{'computed prompt tok':>21}{'page faults':>13}{'sys (s)':>9}"
    )
    for w, entry in res["workloads"].items():
        c = entry["config"]
        desc = (
            f"fleet: {c['agents']} agents x {c['turns']} turns, {c['system_tokens']} shared + {c['private_tokens']} private"
            f", {c['output_tokens']} out/turn, max_running {c['max_running']}"
            if w == "fleet"
            else f"gsp: {c['groups']} groups x {c['prompts']} prompts, {c['prefix_tokens']} shared + {c['question_tokens']}"
            f" question, {c['output_tokens']} out, max_running {c['max_running']}"
        )
        lines += ["", desc]
        lines += [f"  {e}: {s['command']}" for e, s in entry["engines"].items() if s.get("command")]
        for k, r in enumerate(entry.get("rounds", [])):
            walls = ", ".join(f"{e} {s['wall_s']:.2f} s" for e, s in r["engines"].items())
            ratio = f"; wall {r['ratios']['wall']:.2f}x, TTFT p50 {r['ratios']['ttft_p50']:.2f}x, equal tokens {r['equal_requests']}" if "ratios" in r else ""
            lines.append(f"round {k + 1}: {walls}{ratio}{_floor_words(r, peer)}")
        if "rounds" in entry:
            lines.append(f"medians over {len(entry['rounds'])} rounds (ratios: the median of each round's ratio):")
        lines.append(head)
        for e, s in entry["engines"].items():
            lines.append(
                f"{e:<12}{s['backend']:<22}{s['wall_s']:>10.2f}{s['out_tok_per_s']:>11.1f}{s['ttft_p50_ms']:>15.0f}"
                f"{s['ttft_p99_ms']:>15.0f}{s['computed_prompt_tokens']:>21,.0f}{_count(s.get('page_faults')):>13}"
                f"{_secs(s.get('system_s')):>9}"
            )
        if "ratios" in entry:
            r = entry["ratios"]
            lines.append(
                f"radixserve / {name}: wall {r['wall']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, p99 {r['ttft_p99']:.2f}x, "
                f"computed prompt tokens {r['computed_prompt_tokens']:.2f}x; equal tokens {entry['equal_requests']} requests"
            )
        if "floor" in entry:
            f = entry["floor"]
            median = "medians: " if "rounds" in entry else ""
            line = f"compute floor (bench floor, {median}{f['gemm_gflop_per_s']:.0f} GFLOP/s GEMM rate): {f['floor_s']:.2f} s; " + ", ".join(
                f"{e} / floor {f[e + '_over_floor']:.2f}x" for e in entry["engines"]
            )
            if f"floor_over_{peer}" in f:
                over = f[f"floor_over_{peer}"]
                line += f"; floor / {name} {over:.2f}x" + (f" (the {WALL_TARGET}x target is {WALL_TARGET / over:.2f}x the floor)" if peer == "vllm" else "")
            lines.append(line)
        for kind, b in entry.get("breakdown", {}).items():
            what = ("steps with prompt tokens" if kind == "prompt" else "decode-only steps") + (" (round 1)" if "rounds" in entry else "")
            attn = f"attention {b['attention_s']:.2f} s at {b['attention_gflop_per_s']:.0f} GFLOP/s, " if b["attention_gflop_per_s"] is not None else ""
            rate = "-" if b["linear_gflop_per_s"] is None else f"{b['linear_gflop_per_s']:.0f}"
            lines.append(
                f"radixserve {what}: {b['steps']} steps, {b['s']:.2f} s (median {b['median_step_ms']:.1f} ms), "
                f"{b['tokens']:,} tokens; {attn}the rest {b['rest_s']:.2f} s: {b['linear_gflop']:.0f} GFLOP of "
                f"linear maps at {rate} GFLOP/s"
            )
            if b.get("attention_calls"):
                parts = [
                    f"{name} {c['s']:.2f} s" + (f" ({c['gflop_per_s']:.0f} GFLOP/s)" if c["gflop_per_s"] else "") for name, c in b["attention_calls"].items()
                ]
                lines.append("  attention by kernel call: " + ", ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    from radixserve.runtime import default_omp_wait

    default_omp_wait()  # as `python -m bench` does; a --child inherits it from its parent
    parser = argparse.ArgumentParser(prog="python -m bench.peers")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
