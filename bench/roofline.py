"""Batch-1 decode step against the memory-bandwidth floor.

A batch-1 decode step reads every weight once (the output embedding included), so it cannot
beat ``weight bytes / memory bandwidth``. This command measures the read bandwidth (a sum over
a buffer far larger than the caches, with the engine's thread count), the model's weight bytes,
and the median decode step of one request (``--context`` tokens of prompt, then
``--steps`` decodes through ``Engine.step``), and prints their ratio.

With a bf16/fp16 model and the small-M linear kernel built (``radixserve.model.linear``), the
decode steps alternate between the kernel and ``F.linear`` (step by step, same request), and both
medians are printed. ``--gemv`` adds a table of the bench model's linear shapes at several row
counts, the kernel against ``F.linear`` (and fp32 ``F.linear``, MKL), in ms and GB/s of weights
read, with weights rotated over ``--gemv-mib`` MiB of copies so they come from memory, as in a
decode step.
"""

from __future__ import annotations

import json
import statistics
import time

HELP = "batch-1 decode step vs weight bytes / measured memory bandwidth"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the bench model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (bandwidth and engine)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the decodes")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--buffer-mib", type=int, default=1024, help="bandwidth buffer (MiB)")
    parser.add_argument("--gemv", action="store_true", help="also print the per-shape linear kernel table")
    parser.add_argument("--gemv-rows", default="1,8,16,32,64", help="row counts M of the --gemv table")
    parser.add_argument("--gemv-mib", type=int, default=256, help="MiB of weight copies each --gemv shape rotates over")
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
    path of ``torch.ops.radixserve_linear.linear``), ``F.linear`` in ``dtype`` and in fp32."""
    import torch
    import torch.nn.functional as F

    from radixserve.model import linear as lin

    op = lin.kernel()

    def kernel_fn(a, w):
        return op(a, w, None, False)

    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = [("q/o_proj", q, h), ("k/v_proj", kv, h), ("qkv_proj (fused)", q + 2 * kv, h),
              ("gate/up_proj", i, h), ("gate_up_proj (fused)", 2 * i, h), ("down_proj", h, i), ("lm_head", v, h)]
    out = []
    g = torch.Generator().manual_seed(0)
    for name, n, k in shapes:
        copies = max(2, (mib << 20) // (n * k * 2))
        ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
        ws32 = [w.float() for w in ws[: max(2, copies // 2)]]
        for m in rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            x32 = x.float()
            row = {"shape": name, "N": n, "K": k, "M": m, "dispatched": m <= lin.max_rows(dtype)}
            runs = [("torch", F.linear, x, ws), ("torch_fp32", F.linear, x32, ws32)]
            if op is not None:
                runs.insert(0, ("kernel", kernel_fn, x, ws))
            for key, fn, inp, weights in runs:
                ms = _rotating_ms(fn, inp, weights, max(repeats, len(weights)))
                row[f"{key}_ms"] = ms
                row[f"{key}_gb_s"] = weights[0].numel() * weights[0].element_size() / ms / 1e6
            out.append(row)
        del ws, ws32
    return out


def print_gemv(table: list[dict], dtype: str, threads: int) -> None:
    print(f"\nlinear layers, {dtype} weights, {threads} thread(s): median ms (GB/s of weights read); "
          f"kernel = torch.ops.radixserve_linear.linear, torch = F.linear ({dtype}), fp32 = F.linear (MKL)")
    print(f"{'shape':22} {'N x K':>11} {'M':>3}  {'kernel':>17} {'torch':>17} {'fp32':>17} {'torch/kernel':>12}  used")
    for r in table:
        kern = f"{r['kernel_ms']:7.3f} ({r['kernel_gb_s']:5.1f})" if "kernel_ms" in r else f"{'-':>17}"
        ratio = f"{r['torch_ms'] / r['kernel_ms']:11.2f}x" if "kernel_ms" in r else f"{'-':>12}"
        print(f"{r['shape']:22} {r['N']:>5}x{r['K']:<5} {r['M']:>3}  {kern} "
              f"{r['torch_ms']:7.3f} ({r['torch_gb_s']:5.1f}) {r['torch_fp32_ms']:7.3f} ({r['torch_fp32_gb_s']:5.1f}) "
              f"{ratio}  {'yes' if r['dispatched'] else 'no'}")


def run(args) -> int:
    import torch

    from radixserve import Engine, SamplingParams
    from radixserve.model import linear as lin

    torch.set_num_threads(args.threads)
    if args.model is None:
        from bench.models import bench_model_path

        args.model = str(bench_model_path())
    bw = bandwidth(args.buffer_mib)
    engine = Engine(args.model, dtype=args.dtype, max_running=1, seed=0)
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # A/B: the decode steps alternate between the kernel and F.linear (when the kernel applies)
    param_dtype = next(model.parameters()).dtype
    kernel = lin.kernel() if param_dtype in (torch.bfloat16, torch.float16) else None
    modes = ["kernel", "F.linear"] if kernel is not None else ["F.linear"]
    ids = [7 + i % 1000 for i in range(args.context)]
    engine.add_request(engine.make_request(ids, SamplingParams(max_tokens=len(modes) * args.steps + 2, temperature=0.0,
                                                               ignore_eos=True)))
    engine.step()  # drains the inbox and prefills
    times: dict[str, list[float]] = {m: [] for m in modes}
    step_no = 0
    try:
        while engine.scheduler.has_work:
            mode = modes[step_no % len(modes)]
            lin._state["op"] = kernel if mode == "kernel" else None
            start = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - start)
            step_no += 1
    finally:
        lin._state["op"] = kernel
    floor = weight_bytes / bw
    steps = {m: statistics.median(t[1:]) for m, t in times.items()}  # the first decode may still warm caches
    step = steps[modes[0]]
    result = {"dtype": args.dtype, "threads": args.threads, "bandwidth_gb_s": bw / 1e9, "weight_mb": weight_bytes / 1e6,
              "floor_ms": floor * 1e3, "decode_step_ms": step * 1e3, "ratio": step / floor,
              "backend": type(engine.runner.attention).__name__,
              # without the kernel (fp32): what radixserve's linear runs for one row on this CPU
              "linear": modes[0] if kernel is not None else
              ("oneDNN" if lin.gemm_backend(param_dtype) == "onednn" else "F.linear")}
    if kernel is not None:
        result["decode_step_f_linear_ms"] = steps["F.linear"] * 1e3
        result["ratio_f_linear"] = steps["F.linear"] / floor
    table = gemv_table(model.config, param_dtype, [int(r) for r in args.gemv_rows.split(",")], args.gemv_mib) \
        if args.gemv else None
    if args.json:
        if table is not None:
            result["gemv"] = table
        print(json.dumps(result))
        return 0
    print(f"{args.dtype}, {args.threads} thread(s), {result['backend']}: read bandwidth {result['bandwidth_gb_s']:.1f} GB/s, "
          f"weights {result['weight_mb']:.1f} MB -> floor {result['floor_ms']:.2f} ms; batch-1 decode step "
          f"{result['decode_step_ms']:.2f} ms (median of {len(times[modes[0]]) - 1}, {result['linear']}) = {result['ratio']:.2f}x the floor")
    if kernel is not None:
        print(f"  same run, alternate steps on F.linear: {result['decode_step_f_linear_ms']:.2f} ms = "
              f"{result['ratio_f_linear']:.2f}x the floor (kernel step {steps['F.linear'] / step:.2f}x faster)")
    if table is not None:
        print_gemv(table, args.dtype, args.threads)
    return 0
