"""GPU checks in one run (for a lent NVIDIA machine): FlashInfer against the torch backend on the
same metadata, the engine's greedy tokens against transformers, and decode throughput by batch.

    bash bench/device_check.sh                 # there: installs the carried wheels, then runs this
    bash bench/device_check.sh --serve         # there: only ``radixserve serve`` (SDK, HTTP, /metrics)
    python -m bench.device_check --device cpu  # here: a dry run of the engine checks (no FlashInfer)

FlashInfer compiles its kernels at first use (nvcc, minutes each); the kernels the checks need
are built first in parallel processes, one per module, and every phase watches a deadline
(``--budget`` seconds), so a slow build costs the later phases, not the whole report. Prints one
line per check with PASS/FAIL and the numbers; exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.kv.pool import KVPool

HEAD_DIM = 128  # every check uses it, so the modules built once serve them all (--head-dim)
failures = 0
START = time.monotonic()


def report(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def info(text: str) -> None:
    print(f"INFO [{time.monotonic() - START:5.0f} s] {text}", flush=True)


# -- FlashInfer against the torch backend --------------------------------------------------------
def compare_backends(
    page_size: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int, cases: tuple[str, ...] = ("decode", "extend", "mixed", "cascade")
) -> None:
    from radixserve.attention.flashinfer_backend import FlashInferAttention

    rng = random.Random(seed)
    pool = KVPool(num_layers=1, num_pages=65536 // page_size, page_size=page_size, num_kv_heads=kv_heads, head_dim=HEAD_DIM, dtype=dtype, device="cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    scale = HEAD_DIM**-0.5
    flashinfer = FlashInferAttention(pool, scale, num_qo_heads=heads)
    reference = TorchAttention(pool, scale)

    def check(name, tables, kv_lens, qo_lens, groups=()):
        n = sum(qo_lens)
        q = torch.randn(n, heads, HEAD_DIM, dtype=dtype, device="cuda")
        k = torch.randn(n, kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
        v = torch.randn(n, kv_heads, HEAD_DIM, dtype=dtype, device="cuda")
        meta = build_metadata(tables, kv_lens, qo_lens, page_size, "cuda", groups=groups)
        reference.plan(meta)
        expected = reference.forward(q, k, v, 0)
        flashinfer.plan(meta)
        got = flashinfer.forward(q, k, v, 0)
        err = (got.float() - expected.float()).abs().max().item()
        report(f"{name} page={page_size} heads={heads}/{kv_heads} {str(dtype)[6:]}", err < 2e-2, f"max abs err {err:.2e}")

    def alloc(n):
        return pool.alloc(-(-n // page_size))

    lens = [rng.randint(1, 2000) for _ in range(16)]
    if "decode" in cases:
        check("decode", [alloc(n) for n in lens], lens, [1] * 16)
    prefix = [rng.randint(0, 1500) for _ in range(6)]
    new = [rng.randint(2, 300) for _ in range(6)]
    kv = [p + n for p, n in zip(prefix, new)]
    if "extend" in cases:
        check("extend", [alloc(n) for n in kv], kv, new)
    if "mixed" in cases:
        mixed_kv = kv + lens[:8]
        check("mixed", [alloc(n) for n in mixed_kv], mixed_kv, new + [1] * 8)
    if "cascade" in cases:
        shared = alloc(1024 // page_size * page_size)
        suffix = [rng.randint(1, 200) for _ in range(12)]
        tables = [shared + alloc(s) for s in suffix]
        kv_lens = [len(shared) * page_size + s for s in suffix]
        check("cascade", tables + [alloc(50)], kv_lens + [50], [1] * 13, groups=[(0, 12, len(shared) * page_size)])


# The FlashInfer modules the checks use, one per process: (heads, kv heads, case). GQA 4:1 decodes
# on the tensor-core (FA2 prefill) kernel, MHA on the decode kernel; extend takes the prefill
# kernel (FA3 on Hopper); cascade adds merge_state.
WARM = {
    "decode-tc": (32, 8, "decode"),
    "decode": (16, 16, "decode"),
    "prefill": (32, 8, "extend"),
    "cascade": (16, 16, "cascade"),
}


def warm_up(dtypes: list[torch.dtype], budget: float) -> list[torch.dtype]:
    """Build the modules of ``dtypes`` in parallel; return the dtypes whose builds all finished."""
    procs = {}
    for dtype in dtypes:
        for kind in WARM:
            name = f"{kind}/{str(dtype)[6:]}"
            cmd = [sys.executable, "-m", "bench.device_check", "--warm", kind, "--dtype", str(dtype)[6:], "--head-dim", str(HEAD_DIM)]
            procs[name] = (dtype, time.monotonic(), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    ready = set(dtypes)
    for name, (dtype, began, proc) in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, budget - (time.monotonic() - START)))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            info(f"build {name}: still compiling at the deadline")
            ready.discard(dtype)
            continue
        info(f"build {name}: exit {proc.returncode} after {time.monotonic() - began:.0f} s")
        if proc.returncode != 0:
            ready.discard(dtype)
            print(out[-3000:], flush=True)
    return [d for d in dtypes if d in ready]


# -- the engine against transformers ---------------------------------------------------------------
def tiny_model(tmp: str, dtype: str, **shape) -> str:
    from radixserve.testing import make_tiny_model_dir

    # initializer_range 0.1: logits spread wide enough that "the chosen token is the argmax up to
    # bf16 noise" rejects a wrong one.
    base = dict(
        hidden_size=256,
        head_dim=HEAD_DIM,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )
    base.update(shape)
    return str(make_tiny_model_dir(tmp + "/m", "qwen3", dtype=dtype, **base))


def greedy_vs_transformers(device: str, dtype_name: str) -> None:
    """Greedy tokens of the engine (FlashInfer on GPU) checked step by step against transformers,
    teacher-forced on the engine's own tokens: each chosen token must be the reference's argmax up
    to rounding (logit within ``tol`` of the max). Also reports exact token agreement with
    ``generate`` and with the engine's torch backend, and runs a shared-prefix batch with cascade on."""
    from transformers import AutoModelForCausalLM

    from radixserve import Engine, SamplingParams

    dtype = getattr(torch, dtype_name)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None
        shared = [random.Random(99).randrange(7, 512) for _ in range(600)]
        prompts = [[random.Random(i).randrange(7, 512) for _ in range(n)] for i, n in enumerate((5, 60, 300, 700))]
        prompts += [shared + [random.Random(50 + i).randrange(7, 512) for _ in range(9 + i)] for i in range(6)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        runs = {}
        for name, opts in (("auto", {}), ("torch", dict(attention="torch", cascade_min_shared_tokens=None)), ("cascade", dict(cascade_min_shared_tokens=64))):
            engine = Engine(model_dir, device=device, dtype=dtype_name, page_size=16, kv_cache_tokens=65536, **opts)
            engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # the shared prefix is not cached yet
            runs[name] = [o.token_ids for o in engine.generate(prompts, params)]
            info(f"engine attention={engine.runner.attention.__class__.__name__} ({name})")
            engine.shutdown()
        tol = 0.02 if dtype == torch.float32 else 0.1
        for name, outs in runs.items():
            worst, exact, spread = 0.0, 0, []
            for prompt, gen in zip(prompts, outs):
                with torch.no_grad():
                    logits = hf(torch.tensor([prompt + gen[:-1]], device=device)).logits[0, len(prompt) - 1 :].float()
                chosen = logits.gather(1, torch.tensor(gen, device=device)[:, None])[:, 0]
                gap = (logits.max(dim=1).values - chosen).max().item()
                worst = max(worst, gap)
                spread.append(logits.std(dim=1).mean().item())
                ref = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=len(gen), do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()
                exact += next((i for i, (a, b) in enumerate(zip(gen, ref)) if a != b), len(gen))
            total = sum(len(g) for g in outs)
            report(
                f"greedy vs transformers ({dtype_name}, {name})",
                worst <= tol,
                f"largest argmax gap {worst:.3f} (tol {tol}; logit std {sum(spread) / len(spread):.2f}); "
                f"{exact}/{total} tokens before the first difference from generate",
            )
        same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(runs["auto"], runs["torch"]))
        info(f"engine auto vs torch attention: {same}/{sum(map(len, runs['auto']))} tokens before the first difference")


def decode_throughput(device: str, dtype_name: str, batches: tuple[int, ...], deadline: float) -> None:
    from radixserve import Engine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        # About 0.3 B parameters: large enough that a step is not only launch overhead.
        model_dir = tiny_model(
            tmp,
            dtype_name,
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=8,
            intermediate_size=4096,
            num_hidden_layers=12,
            vocab_size=32000,
            initializer_range=0.02,
        )
        engine = Engine(
            model_dir,
            device=device,
            dtype=dtype_name,
            page_size=16,
            kv_cache_tokens=(1 << 19) if device == "cuda" else (1 << 13),
            max_running=max(batches),
            cascade_min_shared_tokens=None,
        )
        engine.generate([[7] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for batch in batches:
            if time.monotonic() > deadline:
                info(f"decode batch {batch}: skipped at the deadline")
                break
            prompts = [[random.Random(i).randrange(7, 32000) for _ in range(128)] for i in range(batch)]
            params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            info(
                f"decode batch {batch:4d} ({dtype_name}): {tokens / elapsed:9.0f} tok/s aggregate, "
                f"{tokens / elapsed / batch:7.1f} tok/s per stream, {elapsed / 64 * 1e3:6.2f} ms per step "
                f"(128-token prompts, 64 new tokens, prefill included)"
            )
        engine.shutdown()


def environment() -> None:
    info(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info(f"GPU {props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}")
    try:
        import flashinfer

        info(f"flashinfer {flashinfer.__version__}")
    except Exception as exc:  # noqa: BLE001 (reported, then the checks that need it fail)
        info(f"flashinfer does not import: {exc!r}")
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=30).stdout
        info("nvcc " + nvcc.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError) as exc:
        info(f"no nvcc: {exc!r}")


def sampled_generation(device: str, dtype_name: str) -> None:
    """Sampled decoding (temperature, top-k, top-p, min-p) on the device: tokens in range, a
    seeded request repeats its tokens whatever shares its batch, and other seeds differ."""
    import msgspec

    from radixserve import Engine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(tiny_model(tmp, dtype_name), device=device, dtype=dtype_name, page_size=16, kv_cache_tokens=16384)
        prompts = [[random.Random(i).randrange(7, 512) for _ in range(20 + i)] for i in range(6)]
        seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=100, seed=1234, ignore_eos=True)
        others = [SamplingParams(max_tokens=24, temperature=0.8, min_p=0.02, ignore_eos=True)] * 5
        alone = engine.generate([prompts[0]], seeded)[0].token_ids
        mixed = engine.generate(prompts, [seeded, *others])
        reseeded = engine.generate([prompts[0]], msgspec.structs.replace(seeded, seed=99))[0].token_ids
        in_range = all(0 <= t < 512 for o in mixed for t in o.token_ids)
        ok = in_range and mixed[0].token_ids == alone and reseeded != alone and len(set(alone)) > 3
        report(
            f"sampled generation ({dtype_name})",
            ok,
            f"seeded alone == in a batch: {mixed[0].token_ids == alone}; another seed differs: {reseeded != alone}; ids in range: {in_range}",
        )
        engine.shutdown()


def serve_check(device: str, dtype_name: str) -> None:
    """``radixserve serve`` on ``device``: one worker, the SDK and the OpenAI HTTP gateway. Greedy
    tokens over the SDK must equal an in-process Engine's on the same checkpoint, a batch of
    requests must all finish, and /v1/completions and /metrics must answer."""
    import json
    import urllib.request

    from radixserve import Engine, SamplingParams
    from radixserve.client import Client
    from radixserve.testing import spawn_server

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp, dtype_name)
        prompts = [[random.Random(70 + i).randrange(7, 512) for _ in range(n)] for i, n in enumerate((5, 40, 300))]
        engine = Engine(model_dir, device=device, dtype=dtype_name, page_size=16, kv_cache_tokens=16384)
        want = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
        engine.shutdown()
        began = time.monotonic()
        server = spawn_server(model_dir, "--device", device, "--dtype", dtype_name, "--kv-cache-tokens", "16384", workers=1, http=True, ready_timeout=300)
        try:
            info(f"serve on {device}: ready in {time.monotonic() - began:.0f} s at {server.address}, {server.http_url}")
            client = Client(server.address, timeout=120)
            got = [client.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
            many = client.batch([p[:20] for p in prompts] * 8, max_tokens=8, temperature=0.0, ignore_eos=True)
            client.close()
            models = json.load(urllib.request.urlopen(server.http_url + "/models", timeout=60))
            body = json.dumps({"model": models["data"][0]["id"], "prompt": prompts[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(server.http_url + "/completions", data=body, headers={"Content-Type": "application/json"})
            http = json.load(urllib.request.urlopen(req, timeout=120))
            metrics_url = server.http_url.rsplit("/v1", 1)[0] + "/metrics"
            metrics = urllib.request.urlopen(metrics_url, timeout=60).read().decode()
            ok = got == want and all(len(c.token_ids) == 8 for c in many) and http["usage"]["completion_tokens"] == 8 and "radixserve" in metrics
            report(
                f"serve on {device} ({dtype_name}): SDK, HTTP, metrics",
                ok,
                f"SDK greedy tokens equal the in-process engine's: {got == want}; a batch of {len(many)} finished: "
                f"{all(len(c.token_ids) == 8 for c in many)}; /v1/completions tokens: "
                f"{http['usage']['completion_tokens']}; /metrics has radixserve series: {'radixserve' in metrics}",
            )
        except Exception as exc:  # a check, not a crash: report it and go on
            report(f"serve on {device} ({dtype_name}): SDK, HTTP, metrics", False, repr(exc))
        finally:
            server.stop()


def gpu_checks(dtype: torch.dtype, args: argparse.Namespace) -> None:
    name = str(dtype)[6:]
    if not warm_up([dtype], budget=args.budget * 0.6):
        report(f"FlashInfer {name} modules", False, "did not build in time")
        return
    info(f"FlashInfer modules ready for {name}, head_dim {HEAD_DIM}")
    for page_size in (16,) if args.quick else (1, 16):
        for heads, kv_heads in ((32, 8), (16, 16)) if args.quick else ((32, 8), (16, 16), (8, 1)):
            compare_backends(page_size, heads, kv_heads, dtype, seed=page_size + heads)
    greedy_vs_transformers("cuda", name)
    sampled_generation("cuda", name)
    if not args.no_throughput:
        decode_throughput("cuda", name, (1, 8, 32, 64, 128, 256), deadline=START + args.budget * 0.85)


def main() -> None:
    global HEAD_DIM
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run without FlashInfer")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("DEVICE_CHECK_BUDGET", 480)), help="seconds for the whole run (default 480)")
    ap.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16, float16: each builds its own FlashInfer modules (minutes)")
    ap.add_argument("--no-throughput", action="store_true", help="skip the decode throughput table")
    ap.add_argument("--quick", action="store_true", help="compare the backends at page size 16, GQA and MHA only")
    ap.add_argument("--serve", action="store_true", help="only the serve check: radixserve serve on the device, its SDK, HTTP gateway and metrics")
    ap.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        choices=(64, 128, 256),
        help="head_dim of every check (FlashInfer builds its modules per head_dim; default 128)",
    )
    ap.add_argument("--warm", choices=sorted(WARM), help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    args = ap.parse_args()
    HEAD_DIM = args.head_dim
    if args.warm:  # one module build, in a process of its own
        heads, kv_heads, case = WARM[args.warm]
        compare_backends(16, heads, kv_heads, getattr(torch, args.dtype), seed=0, cases=(case,))
        sys.exit(1 if failures else 0)
    environment()
    if args.serve:
        serve_check(args.device, "bfloat16" if args.device == "cuda" else "float32")
    elif args.device == "cuda":
        # one dtype at a time: a later dtype's builds cannot delay an earlier one's checks
        for name in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            if time.monotonic() - START > args.budget * 0.6:
                info(f"{name} not checked: no time left for its builds")
                continue
            gpu_checks(getattr(torch, name), args)
    else:
        greedy_vs_transformers("cpu", "float32")
        sampled_generation("cpu", "float32")
        decode_throughput("cpu", "float32", (1, 8), deadline=START + args.budget)
    print(f"{failures} failed checks after {time.monotonic() - START:.0f} s", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
