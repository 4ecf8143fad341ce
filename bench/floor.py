"""The compute floor of the `bench peers` workloads: their FLOPs at the measured GEMM rate.

With ideal prefix caching (every shared token computed once, as radixserve's computed prompt
tokens show it does on both workloads), a workload's arithmetic is fixed: every computed token
runs the layers' linear maps, attends to every key it can see, and the rows that sample a token
run the output embedding. This command counts those FLOPs exactly for the fleet and GSP shapes
of ``python -m bench peers`` (same flags and defaults), measures the GEMM rate of the model's own
linear shapes at ``--rows`` rows (the faster of ``torch.nn.functional.linear`` and radixserve's
packed-weight GEMM, this dtype and thread count),
and prints the seconds the workload needs at that rate. No engine can beat that floor without
doing less arithmetic or running GEMMs faster, so it bounds what any wall-time target can ask
(give ``--vllm-wall S`` to print a target ratio next to it). The floor is optimistic: attention
at the linear layers' GEMM rate, decode steps at no memory cost, no overhead at all.
"""

from __future__ import annotations

import functools
import json
import time

from bench.peers import OBSERVATION_TOKENS, WALL_TARGET
from bench.shapes import Shape, model_config

HELP = "FLOPs of the peers workloads at the measured GEMM rate: the floor any engine's wall time has"


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="model directory or .gguf file (default: the bench model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads for the GEMM rate")
    p.add_argument("--rows", type=int, default=2048, help="GEMM rows (the step's token budget)")
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--private-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--gsp-groups", type=int, default=16)
    p.add_argument("--gsp-prompts", type=int, default=8)
    p.add_argument("--gsp-prefix", type=int, default=1024)
    p.add_argument("--gsp-question", type=int, default=128)
    p.add_argument("--gsp-output", type=int, default=8)
    p.add_argument(
        "--vllm-wall",
        type=float,
        nargs=2,
        default=None,
        metavar=("FLEET_S", "GSP_S"),
        help=f"vLLM's measured wall times: also print floor / vLLM and the {WALL_TARGET}x target",
    )
    p.add_argument("--json", action="store_true")


class _Counts:
    """Computed tokens, prompt tokens among them, summed visible keys and sampled rows."""

    def __init__(self):
        self.tokens = self.prompt_tokens = self.visible_keys = self.sampled_rows = 0

    def append(self, new: int, context: int, *, prompt: bool) -> int:
        """Count ``new`` tokens appended after ``context`` (bottom-right causal); the new context."""
        self.tokens += new
        self.prompt_tokens += new if prompt else 0
        self.visible_keys += new * context + new * (new + 1) // 2
        return context + new

    def request(self, new: int, context: int, outputs: int) -> int:
        """A prompt chunk, then ``outputs`` sampled tokens (the first from the prompt's last row,
        the rest from one decode each); returns the context with every computed token."""
        context = self.append(new, context, prompt=True)
        for _ in range(outputs - 1):
            context = self.append(1, context, prompt=False)
        self.sampled_rows += outputs
        return context


def workload_counts(args) -> dict[str, dict[str, int]]:
    """What each workload computes with ideal prefix caching (every shared token once)."""
    fleet = _Counts()
    fleet.append(args.system_tokens, 0, prompt=True)
    for _ in range(args.agents):
        context = args.system_tokens
        for turn in range(args.turns):
            # Turn 0 adds the private state; a later turn the previous turn's last output token
            # (sampled, so its KV was never computed) and the observation.
            new = args.private_tokens if turn == 0 else 1 + OBSERVATION_TOKENS
            context = fleet.request(new, context, args.output_tokens)
    gsp = _Counts()
    for _ in range(args.gsp_groups):
        gsp.append(args.gsp_prefix, 0, prompt=True)
        for _ in range(args.gsp_prompts):
            gsp.request(args.gsp_question, args.gsp_prefix, args.gsp_output)
    return {"fleet": vars(fleet), "gsp": vars(gsp)}


def gemm_rate(shape: Shape, rows: int, dtype: str, threads: int, repeats: int = 9) -> float:
    """FLOP/s of one layer's linear maps at ``rows`` rows: total FLOPs over the summed best times
    (the best of ``repeats``, since this is a floor: a busy machine only makes it look lower), each
    map on the faster of ``F.linear`` and radixserve's own (its packed-weight GEMM: MKL's or oneDNN's,
    whichever :func:`radixserve.kernels.gemm.gemm_backend` takes on this CPU; MKL's ``F.linear``
    is the slower one on AMD CPUs)."""
    import torch

    from radixserve.kernels import linear as lin

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    total_s, flops = 0.0, 0
    for k, n in shape.linears:
        x, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
        packed = lin.PackedWeight()
        best = float("inf")
        with torch.no_grad():
            for fn in (torch.nn.functional.linear, functools.partial(lin.linear, packed=packed)):
                fn(x, w)
                for _ in range(repeats):
                    start = time.perf_counter()
                    fn(x, w)
                    best = min(best, time.perf_counter() - start)
        total_s += best
        flops += 2 * rows * k * n
    return flops / total_s


def run(args) -> int:
    if args.model is None:
        from bench.models import bench_model_path

        args.model = str(bench_model_path())
    shape = Shape(model_config(args.model))
    rate = gemm_rate(shape, args.rows, args.dtype, args.threads)
    rows = []
    for i, (name, c) in enumerate(workload_counts(args).items()):
        linear = shape.linear_flops(c["tokens"]) + shape.lm_head_flops(c["sampled_rows"])
        attention = shape.attention_flops(c["visible_keys"])
        row = {"workload": name, **c, "linear_gflop": linear / 1e9, "attention_gflop": attention / 1e9, "floor_s": (linear + attention) / rate}
        if args.vllm_wall:
            vllm = args.vllm_wall[i]
            row.update(vllm_wall_s=vllm, floor_over_vllm=row["floor_s"] / vllm, target_s=WALL_TARGET * vllm)
        rows.append(row)
    if args.json:
        print(json.dumps({"dtype": args.dtype, "threads": args.threads, "gemm_gflop_per_s": rate / 1e9, "rows": rows}))
        return 0
    print(f"GEMM rate of the model's linear maps at {args.rows} rows, {args.dtype}, {args.threads} threads: {rate / 1e9:.0f} GFLOP/s")
    print(
        f"{'workload':9} {'tokens':>8} {'linear GFLOP':>13} {'attention GFLOP':>16} {'floor (s)':>10}"
        + (f" {'vLLM wall (s)':>14} {'floor / vLLM':>13} {f'{WALL_TARGET}x target (s)':>17}" if args.vllm_wall else "")
    )
    for r in rows:
        line = f"{r['workload']:9} {r['tokens']:>8,} {r['linear_gflop']:>13.0f} {r['attention_gflop']:>16.0f} {r['floor_s']:>10.2f}"
        if args.vllm_wall:
            line += f" {r['vllm_wall_s']:>14.2f} {r['floor_over_vllm']:>12.2f}x {r['target_s']:>17.2f}"
        print(line)
    return 0
