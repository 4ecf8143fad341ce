"""Batch-1 decode step against the memory-bandwidth floor.

A batch-1 decode step reads every weight once (the output embedding included), so it cannot
beat ``weight bytes / memory bandwidth``. This command measures the read bandwidth (a sum over
a buffer far larger than the caches, with the engine's thread count), the model's weight bytes,
and the median decode step of one request (``--context`` tokens of prompt, then ``--steps``
decodes through ``Engine.step``), and prints their ratio. ``--batch N`` decodes N requests with
distinct prompts together (no shared prefix, so no cascade group); a step still reads every
weight once. ``--shared-prefix P`` puts a cached P-token prefix in front of every prompt, so the
N requests decode in one cascade group (where N x P reaches the engine's threshold), as an
agent fleet under one system prompt does.

Where radixserve's linear layers send the batch to the small-M kernel
(``radixserve.kernels.linear``: bf16/fp16, and fp32 where oneDNN is the fp32 GEMM), the decode
steps alternate between the kernel and the path the layers take without it (``F.linear``, or
oneDNN's prepacked GEMM), step by step on the same requests, and both medians are printed. bf16
on AMX takes csrc/linear.cpp's AMX GEMM over packed weights at every row count instead of the
kernel ("amx"); its alternate steps run ``F.linear`` with no packed copies.
Where the decoder layers of a step run in one native call (``radixserve.kernels.fused_decode``,
the default), another set of steps runs the same operators layer by layer from Python, and its
median is printed too. ``--gemv`` adds a table of the bench model's linear shapes at several
row counts: the kernel, ``F.linear`` in the model's dtype and in fp32 (MKL), and oneDNN's
prepacked GEMM where torch has it for the dtype, in ms and GB/s of weights read, with weights
rotated over ``--gemv-mib`` MiB of copies so they come from memory, as in a decode step.
``--fragment`` scatters the KV pool's free pages first (half held, the rest freed in a random
order), so the requests' pages come from a pool such as a long-running server has. The pool's
pages are written once before anything runs (``KVPool.commit``): a server's pool is in memory once
it has been through it, and a step that wrote into fresh pages would time their page faults.
"""

from __future__ import annotations

import json
import random
import statistics
import time

HELP = "batch-1 decode step vs weight bytes / measured memory bandwidth"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the bench model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (bandwidth and engine)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the decodes")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (distinct prompts, so no shared prefix); default 1")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="P", help="a cached prefix of P tokens shared by every request (a cascade group)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument(
        "--fragment",
        action="store_true",
        help="before the requests, hold a random half of the KV pool's pages and free the other half "
        "in a random order, as a long-running server's pool looks after requests came and went",
    )
    parser.add_argument(
        "--against",
        metavar="DIR",
        default=None,
        help="another checkout's csrc/: its decode_layers (and the kernels it calls, built as bench kernels --against "
        "builds them) takes every other fused step, and the run prints both medians and the median ratio of adjacent "
        "steps (on a noisy machine, an A/B of two builds that runs after another cannot tell 2%% from 20%%)",
    )
    parser.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth buffer (MiB)")
    parser.add_argument("--gemv", action="store_true", help="also print the per-shape linear kernel table")
    parser.add_argument("--gemv-rows", default="1,8,16,32,64", help="row counts M of the --gemv table")
    parser.add_argument("--gemv-mib", type=int, default=256, help="MiB of weight copies each --gemv shape rotates over")
    parser.add_argument(
        "--prefill", type=int, default=0, metavar="N", help="also time the prefill of N fresh tokens (one request, nothing cached; median of 3), in tok/s"
    )
    parser.add_argument("--json", action="store_true")


def bandwidth(mib: int, repeats: int = 7) -> float:
    """Read bandwidth in bytes/s: the median of ``repeats`` sums over a ``mib`` MiB fp32 buffer."""
    import torch

    x = torch.ones(mib << 18)  # mib MiB of float32
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def _rotating_ms(fn, x, weights: list, repeats: int) -> float:
    """Median ms of ``fn(x, w)``, ``w`` cycling through ``weights`` (so it is not in the caches)."""
    fn(x, weights[-1])
    times = []
    for i in range(repeats):
        w = weights[i % len(weights)]
        start = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemv_table(config, dtype, rows: list[int], mib: int, repeats: int = 7) -> list[dict]:
    """ms and GB/s of each linear shape of ``config`` for each row count: the kernel (the automatic
    path of ``torch.ops.radixserve_linear.linear``, where it has one for ``dtype``), ``F.linear`` in
    ``dtype`` and in fp32, oneDNN over a prepacked weight (where torch runs it for ``dtype``), and
    bf16 on AMX the AMX GEMM over its packed tiles (shapes whose sizes are multiples of 32)."""
    import torch
    import torch.nn.functional as F

    from radixserve.kernels import gemm
    from radixserve.kernels import linear as lin

    op = lin.kernel()
    if op is not None and dtype == torch.float32 and not torch.ops.radixserve_linear.supports_fp32():
        op = None
    # (oneDNN is radixserve's GEMM for fp32 and bf16 only; its fp16 needs AVX512-FP16 or AVX-NE-CONVERT)
    onednn = dtype in (torch.float32, torch.bfloat16) and gemm.has_onednn_ops(dtype)

    def kernel_fn(a, w):
        return op(a, w, None, False)

    prepacked: dict[int, object] = {}
    amx = dtype == torch.bfloat16 and gemm.packed_ops() is not None and bool(torch.ops.radixserve_linear.supports_amx_gemm())
    tiles: dict[int, object] = {}

    def onednn_fn(a, w):
        return gemm.onednn_linear(a, prepacked[id(w)], None)

    def amx_fn(a, w):
        return torch.ops.radixserve_linear.amx_linear(a, tiles[id(w)], None, False)

    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = [
        ("q/o_proj", q, h),
        ("k/v_proj", kv, h),
        ("qkv_proj (fused)", q + 2 * kv, h),
        ("gate/up_proj", i, h),
        ("gate_up_proj (fused)", 2 * i, h),
        ("down_proj", h, i),
        ("lm_head", v, h),
    ]
    out = []
    g = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        copies = max(2, (mib << 20) // (n * k * 2))
        ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
        ws32 = [w.float() for w in ws[: max(2, copies // 2)]]
        if onednn:
            prepacked.clear()
            prepacked.update((id(w), torch.ops.mkldnn._reorder_linear_weight(w)) for w in ws)
        shape_amx = amx and n % 32 == 0 and k % 32 == 0
        if shape_amx:
            tiles.clear()
            tiles.update((id(w), torch.ops.radixserve_linear.pack_amx(w)) for w in ws)
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            x32 = x.float()
            row = {"shape": name, "N": n, "K": k, "M": m, "dispatched": m <= lin.max_rows(dtype)}
            runs = [("torch", F.linear, x, ws), ("torch_fp32", F.linear, x32, ws32)]
            if op is not None:
                runs.insert(0, ("kernel", kernel_fn, x, ws))
            if onednn:
                runs.append(("onednn", onednn_fn, x, ws))
            if shape_amx:
                runs.append(("amx", amx_fn, x, ws))
            for key, fn, inp, weights in runs:
                ms = _rotating_ms(fn, inp, weights, max(repeats, len(weights)))
                row[f"{key}_ms"] = ms
                row[f"{key}_gb_s"] = weights[0].numel() * weights[0].element_size() / ms / 1e6
            out.append(row)
        del ws, ws32
        prepacked.clear()
        tiles.clear()
    return out


def quant_gemv_table(model, rows: list[int], mib: int, repeats: int = 7) -> list[dict]:
    """ms and GB/s of the quantized linear layers of ``model`` (layer 0's and the output head) for
    each row count: csrc/quant.cpp's register path (impl 2) and its tiles (impl 3), what
    ``qlinear`` picks (impl 0), and oneDNN over the same weights dequantized to fp32 and prepacked
    (what the dequantized model runs), each with weights rotated over ``mib`` MiB of copies."""
    import torch

    from radixserve.kernels import quant
    from radixserve.kernels.quant import QuantLinear

    layer = model.model.layers[0]
    head = model.quant_head if model.tie_word_embeddings else model.lm_head
    named = [
        ("qkv_proj", layer.self_attn.qkv_proj),
        ("o_proj", layer.self_attn.o_proj),
        ("gate_up_proj", layer.mlp.gate_up_proj),
        ("down_proj", layer.mlp.down_proj),
        ("lm_head", head),
    ]
    ops, out = quant.ops(), []
    g = torch.Generator().manual_seed(0)
    for name, m in named:
        if not isinstance(m, QuantLinear):
            continue
        copies = max(2, (mib << 20) // m.nbytes)
        args = [([p.data.clone() for p in m.parts], *m._args[1:]) for _ in range(copies)]
        dense = torch.cat([p.dequantize() for p in m.parts])
        packed = [torch.ops.mkldnn._reorder_linear_weight(dense.clone()) for _ in range(max(2, (mib << 20) // (dense.numel() * 4)))]
        for rows_m in rows:
            x = torch.randn(rows_m, m.in_features, generator=g)
            row = {"shape": name, "types": "+".join(p.type_name for p in m.parts), "N": m.out_features, "K": m.in_features, "M": rows_m}
            for key, impl in (("auto", 0), ("rows", 2), ("tiles", 3)):
                ms = _rotating_ms(lambda a, w, impl=impl: ops.qlinear(a, *w, None, impl), x, args, max(repeats, copies))
                row[f"{key}_ms"], row[f"{key}_gb_s"] = ms, m.nbytes / ms / 1e6
            ms = _rotating_ms(lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), x, packed, max(repeats, len(packed)))
            row["onednn_fp32_ms"], row["onednn_fp32_gb_s"] = ms, dense.numel() * 4 / ms / 1e6
            out.append(row)
    return out


def print_quant_gemv(table: list[dict], threads: int) -> None:
    print(
        f"\nquantized linear layers, {threads} thread(s): median ms (GB/s of weights read); rows/tiles = "
        "csrc/quant.cpp's register path / decoded tiles, auto = what it picks; oneDNN fp32 = the same weights "
        "dequantized and prepacked"
    )
    print(f"{'shape':13} {'types':14} {'N x K':>11} {'M':>4}  {'auto':>17} {'rows':>17} {'tiles':>17} {'oneDNN fp32':>17} {'oneDNN/auto':>11}")
    for r in table:
        cells = " ".join(f"{r[k + '_ms']:7.3f} ({r[k + '_gb_s']:5.1f})" for k in ("auto", "rows", "tiles", "onednn_fp32"))
        print(f"{r['shape']:13} {r['types']:14} {r['N']:>5}x{r['K']:<5} {r['M']:>4}  {cells} {r['onednn_fp32_ms'] / r['auto_ms']:10.2f}x")


def prefill_rate(engine, tokens: int, span: int) -> float:
    """tok/s of the prefill of ``tokens`` fresh tokens (one request, a prompt the cache has never
    seen; chunked as the engine's step budget cuts it), the median of 3."""
    from radixserve import SamplingParams

    rates = []
    for r in range(3):
        ids = [7 + (r * 1_000_003 + j * 7919 + 101) % span for j in range(tokens)]
        start = time.perf_counter()
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates)


def print_gemv(table: list[dict], dtype: str, threads: int) -> None:
    print(
        f"\nlinear layers, {dtype} weights, {threads} thread(s): median ms (GB/s of weights read); "
        f"kernel = torch.ops.radixserve_linear.linear, torch = F.linear ({dtype}), fp32 = F.linear (MKL), "
        f"oneDNN = prepacked {dtype}"
        + (", AMX = csrc/linear.cpp's AMX GEMM on packed tiles (what bf16 runs here)" if any("amx_ms" in r for r in table) else "")
    )
    amx = any("amx_ms" in r for r in table)
    print(
        f"{'shape':22} {'N x K':>11} {'M':>3}  {'kernel':>17} {'torch':>17} {'fp32':>17} {'oneDNN':>17} "
        + (f"{'AMX':>17} " if amx else "")
        + f"{'torch/kernel':>12} {'oneDNN/kernel':>13}"
        + (f" {'AMX/kernel':>10}" if amx else "")
        + "  used"
    )

    def cell(r, key):
        return f"{r[key + '_ms']:7.3f} ({r[key + '_gb_s']:5.1f})" if key + "_ms" in r else f"{'-':>17}"

    def ratio(r, key, width):
        return f"{r[key + '_ms'] / r['kernel_ms']:{width - 1}.2f}x" if "kernel_ms" in r and key + "_ms" in r else f"{'-':>{width}}"

    for r in table:
        print(
            f"{r['shape']:22} {r['N']:>5}x{r['K']:<5} {r['M']:>3}  {cell(r, 'kernel')} {cell(r, 'torch')} "
            f"{cell(r, 'torch_fp32')} {cell(r, 'onednn')} "
            + (f"{cell(r, 'amx')} " if amx else "")
            + f"{ratio(r, 'torch', 12)} {ratio(r, 'onednn', 13)}"
            + (f" {ratio(r, 'amx', 10)}" if amx else "")
            + f"  {'yes' if r['dispatched'] else 'no'}"
        )


def against_decode(csrc: str, fused: bool):
    """A fused decode of ``model`` on another checkout's ``csrc`` kernels (bench.kernels.build_against)."""
    from bench.kernels import build_against
    from radixserve.kernels import fused_decode

    if not fused:
        raise SystemExit("--against compares fused decode steps: this model or batch does not take the fused path")
    ops = build_against(csrc)
    if getattr(ops, "decode_weights", None) is None:
        raise SystemExit(f"--against {csrc}: its kernels have no decode_layers to compare")
    return fused_decode.FusedDecode(ops)  # (takes its weights apart at its first batch, as ours did)


def run(args) -> int:
    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.kernels import fused_decode, gemm
    from radixserve.kernels import linear as lin

    torch.set_num_threads(args.threads)
    if args.model is None:
        from bench.models import bench_model_path

        args.model = str(bench_model_path())
    if args.batch < 1:
        raise SystemExit("--batch must be at least 1")
    bw = bandwidth(args.buffer_mib)
    engine = Engine(args.model, dtype=args.dtype, max_running=args.batch, seed=0)
    # the steady state: the pool's pages in memory, as a server has them once it has been through
    # its pool (and llama.cpp from the start), rather than a fault at each page's first write
    # (the pages this run takes, lowest first; --fragment scatters them over the whole pool)
    per_request = args.shared_prefix + args.context + 3 * args.steps + 8  # (up to three alternating modes)
    engine.pool.commit(None if args.fragment else args.batch * (-(-per_request // engine.pool.page_size) + 1))
    model = engine.runner.model
    weight_bytes = model.weight_bytes()  # (GGUF weights held quantized: their blocks' bytes)
    # A/B: the decode steps alternate between the fast path (the small-M kernel, or bf16 on AMX the
    # AMX GEMM) and the path without it (when it takes batches of this many rows of this dtype):
    # F.linear, or oneDNN's prepacked GEMM for fp32 on oneDNN
    param_dtype = next(model.parameters()).dtype
    # bf16 on AMX: the AMX GEMM over packed weights at every row count (where the model's sizes allow)
    quantized = engine.loaded.quantized  # (its linear layers: csrc/quant.cpp, no A/B against F.linear)
    amx = not quantized and gemm.amx_first(model.model.layers[0].self_attn.qkv_proj.weight)
    kernel = lin.kernel() if not quantized and (amx or 0 < args.batch <= lin.max_rows(param_dtype)) else None
    packed_ops = gemm._state.get("packed")
    lo, hi = (1, 0) if quantized else gemm.packed_row_range(param_dtype)  # the rows linear() sends to oneDNN (or MKL's packed GEMM)
    onednn = not quantized and not amx and gemm.gemm_backend(param_dtype) in ("onednn", "amx") and lo <= args.batch <= hi
    fallback = "oneDNN" if onednn else "F.linear"
    # ... and between the decoder layers in one native call (radixserve.kernels.fused_decode, the
    # default, which the steps without the kernel do not take) and layer by layer
    was_enabled = model.fused_decode.enabled
    fused = was_enabled and fused_decode.unsupported(model, param_dtype) is None
    first = "quantized" if quantized else "amx" if amx else "kernel" if kernel is not None else fallback
    modes = [first] + (["against"] if args.against else []) + (["layers"] if fused else []) + ([fallback] if kernel is not None else [])
    ours = model.fused_decode
    theirs = against_decode(args.against, fused) if args.against else None
    if args.fragment:  # (the held half is never freed: this engine serves nothing else)
        pool = engine.runner.pool
        pages = pool.alloc(pool.num_free) or []
        random.Random(0).shuffle(pages)
        pool.free(pages[: len(pages) // 2])
    span = min(1000, model.config.vocab_size - 7)  # ids 7.. skip the special tokens
    shared = [7 + (j * 104729 + 13) % span for j in range(args.shared_prefix)]
    if shared:  # cached before the requests arrive, so that they all hit it
        engine.generate([shared], SamplingParams(max_tokens=1, temperature=0.0))
    for i in range(args.batch):  # distinct prompts (after the shared prefix, if any)
        ids = shared + [7 + (i * 7919 + j) % span for j in range(args.context)]
        engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=len(modes) * args.steps + 2, temperature=0.0, ignore_eos=True)))
    engine.step()  # drains the inbox and starts the prefills
    while engine.scheduler.waiting or any(r.prefilling for r in engine.scheduler.running):
        engine.step()
    times: dict[str, list[float]] = {m: [] for m in modes}
    cascade_before = engine.stats()["cascade_steps"]
    step_no = 0
    try:
        while engine.scheduler.has_work:
            mode = modes[step_no % len(modes)]
            if kernel is not None:
                lin._state["op"] = None if mode == fallback else kernel
                if amx:  # (F.linear's steps: no packed copies either)
                    gemm._state["packed"] = None if mode == fallback else packed_ops
            model.fused_decode = theirs if mode == "against" else ours
            ours.enabled = fused and mode == first
            start = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - start)
            step_no += 1
    finally:
        if kernel is not None:
            lin._state["op"] = kernel
            if amx:
                gemm._state["packed"] = packed_ops
        model.fused_decode = ours
        ours.enabled = was_enabled
    floor = weight_bytes / bw
    steps = {m: statistics.median(t[1:]) for m, t in times.items()}  # the first decode may still warm caches
    step = steps[modes[0]]
    result = {
        "dtype": args.dtype,
        "threads": args.threads,
        "bandwidth_gb_s": bw / 1e9,
        "weight_mb": weight_bytes / 1e6,
        "floor_ms": floor * 1e3,
        "decode_step_ms": step * 1e3,
        "ratio": step / floor,
        "backend": type(engine.runner.attention).__name__,
        # what radixserve's linear layers run for one row on this CPU
        "linear": modes[0],
        "fallback": fallback,
        "batch": args.batch,
        "shared_prefix": args.shared_prefix,
        "fragment": args.fragment,
        "cascade_steps": int(engine.stats()["cascade_steps"] - cascade_before),
        "steps": step_no,
    }
    if kernel is not None:
        result["decode_step_fallback_ms"] = steps[fallback] * 1e3
        result["ratio_fallback"] = steps[fallback] / floor
    # the fused decode layers (one native call per step) against the same kernels layer by layer
    # (only where the fast steps did run fused: a batch it does not take, say more rows than the
    # small-M kernel's under MKL, ran layer by layer in both modes)
    result["fused_layers"] = model.fused_decode.batches > 0
    if "layers" in steps and result["fused_layers"]:
        result["decode_step_layers_ms"] = steps["layers"] * 1e3
    if theirs is not None:  # each of our steps against the step after it, on the other build
        pairs = [b / a for a, b in zip(times[first][1:], times["against"][1:], strict=False)]
        result |= {
            "against": args.against,
            "decode_step_against_ms": steps["against"] * 1e3,
            "against_over_this": statistics.median(pairs),
            "against_pairs": len(pairs),
            "against_fused": theirs.batches > 0,
        }
    gemv_rows = [int(r) for r in args.gemv_rows.split(",")]
    gemv = quant_gemv_table if quantized else (lambda m, *a: gemv_table(m.config, param_dtype, *a))
    table = gemv(model, gemv_rows, args.gemv_mib) if args.gemv else None
    if args.prefill:
        result["prefill_tokens"] = args.prefill
        result["prefill_tok_s"] = prefill_rate(engine, args.prefill, span)
    if args.json:
        if table is not None:
            result["gemv"] = table
        print(json.dumps(result))
        return 0
    print(
        f"{args.dtype}, {args.threads} thread(s), {result['backend']}: read bandwidth {result['bandwidth_gb_s']:.1f} GB/s, "
        f"weights {result['weight_mb']:.1f} MB -> floor {result['floor_ms']:.2f} ms; batch-{args.batch} decode step "
        f"{result['decode_step_ms']:.2f} ms (median of {len(times[modes[0]]) - 1}, {result['linear']}) = {result['ratio']:.2f}x the floor"
    )
    if args.fragment:
        print("  KV pool fragmented first: half its pages held, the other half freed in a random order")
    if args.shared_prefix:
        print(f"  {args.shared_prefix} shared prefix tokens (+ {args.context} own): {result['cascade_steps']} of {step_no} decode steps ran in cascade groups")
    if "decode_step_layers_ms" in result:
        print(
            f"  same run, steps with the layers called one by one (RADIXSERVE_FUSED_DECODE=0): "
            f"{result['decode_step_layers_ms']:.2f} ms (one native call {steps['layers'] / step:.2f}x faster)"
        )
    if theirs is not None and theirs.batches == 0:
        print(f"  (--against {args.against}: its decode_layers took none of its steps; they ran layer by layer)")
    if theirs is not None:
        print(
            f"  same run, alternate steps on {args.against}'s kernels: {result['decode_step_against_ms']:.2f} ms; "
            f"this checkout's step x{result['against_over_this']:.3f} faster (median over {result['against_pairs']} adjacent pairs)"
        )
    if kernel is not None:
        print(
            f"  same run, alternate steps on {fallback}: {result['decode_step_fallback_ms']:.2f} ms = "
            f"{result['ratio_fallback']:.2f}x the floor ({first} step {steps[fallback] / step:.2f}x faster)"
        )
    if args.prefill:
        print(f"  prefill of {args.prefill} fresh tokens (one request, nothing cached): {result['prefill_tok_s']:.0f} tok/s (median of 3)")
    if table is not None:
        if quantized:
            print_quant_gemv(table, args.threads)
        else:
            print_gemv(table, args.dtype, args.threads)
    return 0
