"""One decoder layer of the bench model, main's unfused layer vs the fused one, per batch size.

Modes (same random weights, same inputs):
  old          main's layer before the fusion: separate q/k/v and gate/up GEMMs, RMSNorm, RoPE,
               SiLU, mul and the residual adds as separate torch ops
  fused-torch  fused qkv_proj / gate_up_proj GEMMs, the torch fallbacks of radixserve.kernels.layers
               (what RADIXSERVE_NO_EXT=1 runs)
  fused        fused GEMMs and the csrc/layers.cpp kernels (the default); GEMMs on the packed
               weights of radixserve.kernels.gemm's backend (fp32: MKL's, from 16 rows; bf16 on
               AMX: csrc/linear.cpp's AMX GEMM beyond 32 rows; RADIXSERVE_PACKED_LINEAR)
  fused-unpacked  the same with every GEMM beyond the small-M kernel on F.linear
               (RADIXSERVE_PACKED_LINEAR=0; where the dtype has a packed backend)
Attention itself is the same in all modes and left out: a stub stores K/V into a pool layer
(``index_copy_``; the CPU backend now has its own ``store_kv`` kernel) and returns q. Timed ``--repeats`` times with the modes
interleaved; the median per layer forward is printed, the ratio old / fused, and how far each
mode's output (the residual stream after the layer) is from old's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

HELP = "one decoder layer (no attention) at M tokens: main's unfused layer vs fused GEMMs + kernels"

MODES = ("old", "fused-torch", "fused-unpacked", "fused")


def add_arguments(parser) -> None:
    parser.add_argument("--tokens", default="1,64,2048", help="comma list of tokens per batch (M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--json", action="store_true")


class _StubAttention:
    """Stores K/V (with index_copy_, as the CPU backend did before store_kv) and returns q: the
    attention kernels are not what this bench compares."""

    def __init__(self, k_slots, v_slots, slots):
        self.k_slots, self.v_slots, self.slots = k_slots, v_slots, slots

    def forward(self, q, k, v, layer):
        self.k_slots.index_copy_(0, self.slots, k)
        self.v_slots.index_copy_(0, self.slots, v)
        return q.contiguous()


def _old_layer(layer):
    """main's forward (f61806d) over ``layer``'s weights, split back into separate GEMMs."""
    import torch
    import torch.nn.functional as F

    attn, mlp = layer.self_attn, layer.mlp
    nq, nk, _ = attn.qkv_sizes()
    w = attn.qkv_proj.weight.detach()
    wq, wk, wv = w[:nq].clone(), w[nq : nq + nk].clone(), w[nq + nk :].clone()
    inter = mlp.gate_up_proj.out_features // 2
    wg, wu = mlp.gate_up_proj.weight.detach()[:inter].clone(), mlp.gate_up_proj.weight.detach()[inter:].clone()
    wo, wd = attn.o_proj.weight.detach(), mlp.down_proj.weight.detach()
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def norm(x, weight, eps):
        dtype = x.dtype
        x = x.float()
        scale = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return (x * scale).to(dtype).mul_(weight)

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty_like(x)
        lo, hi = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=lo)
        lo.sub_(x2 * sin)
        torch.mul(x2, cos, out=hi)
        hi.add_(x1 * sin)
        return out

    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm

    def forward(x, pending, batch, cos, sin):
        x.add_(pending)  # the previous layer's MLP residual add, which main did at its own end
        h = norm(x, ln1.weight, ln1.eps)
        q = F.linear(h, wq).view(-1, heads, dim)
        k = F.linear(h, wk).view(-1, kv_heads, dim)
        v = F.linear(h, wv).view(-1, kv_heads, dim)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        out = batch.attention.forward(rotate(q, c, s), rotate(k, c, s), v, 0)
        x.add_(F.linear(out.reshape(-1, heads * dim), wo))
        h = norm(x, ln2.weight, ln2.eps)
        gate = F.silu(F.linear(h, wg), inplace=True)
        return F.linear(gate.mul_(F.linear(h, wu)), wd)

    return forward


def run(args) -> int:
    import torch
    from transformers import LlamaConfig

    from radixserve.kernels import gemm
    from radixserve.kernels import layers as fused
    from radixserve.model.llama import ArchSpec, DecoderLayer, ForwardBatch, RotaryEmbedding

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
    )
    sizes = [int(t) for t in args.tokens.split(",") if t.strip()]
    rope = RotaryEmbedding(config, args.head_dim, max(sizes) + 1)
    rope.build("cpu")
    torch.manual_seed(0)
    layer = DecoderLayer(config, 0, ArchSpec(qkv_bias=False, o_bias=False, qk_norm=False), rope)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    layer = layer.to(dtype).eval()
    old = _old_layer(layer)
    kernels = fused.kernels()
    packed = gemm.packed_ops() if kernels is not None and gemm.gemm_backend(dtype) != "none" else None
    modes = [m for m in MODES if (m != "fused" or kernels is not None) and (m != "fused-unpacked" or packed is not None)]
    if kernels is None:
        print("csrc/ kernels unavailable: timing old and fused-torch only", file=sys.stderr)

    results, diffs = {}, {}
    for m in sizes:
        slots = torch.arange(m)
        pool_k = torch.zeros(m, args.kv_heads, args.head_dim, dtype=dtype)
        batch = ForwardBatch(
            input_ids=torch.zeros(m, dtype=torch.long),
            positions=torch.arange(m),
            attention=_StubAttention(pool_k, pool_k.clone(), slots),  # type: ignore[arg-type]
            logits_rows=slots,
        )
        x0 = torch.randn(m, args.hidden).to(dtype)
        pending0 = torch.randn(m, args.hidden).to(dtype) * 0.1

        def call(mode, outputs=None, x0=x0, pending0=pending0, batch=batch):
            x, pending = x0.clone(), pending0.clone()
            start = time.perf_counter()
            if mode == "old":
                cos, sin = rope.tables(batch.positions, dtype)
                out = old(x, pending, batch, cos, sin)
            else:
                out = layer(x, pending, batch)
            elapsed = time.perf_counter() - start
            if outputs is not None:
                outputs[mode] = (x + out).float()  # the residual stream after the layer
            return elapsed

        times: dict[str, list[float]] = {mode: [] for mode in modes}
        outputs: dict = {}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):
                for mode in modes:
                    fused._ops[:] = [kernels if mode in ("fused", "fused-unpacked") else None]
                    gemm._state["packed"] = packed if mode == "fused" else None  # (fused-torch: no extension)
                    t = call(mode, outputs if rep == 0 else None)
                    if rep:  # the first round warms up (and checks that the modes agree)
                        times[mode].append(t)
        fused._ops[:] = [kernels]
        gemm._state["packed"] = packed
        results[m] = {mode: statistics.median(ts) * 1e3 for mode, ts in times.items()}
        diffs[m] = {mode: float((outputs[mode] - outputs["old"]).abs().max()) for mode in modes if mode != "old"}
        print(f"  M={m} done", file=sys.stderr, flush=True)

    if args.json:
        print(json.dumps({"dtype": args.dtype, "threads": args.threads, "ms": results, "max_abs_diff_vs_old": diffs}))
        return 0
    print(
        f"one decoder layer without attention, {args.dtype}, {args.threads} thread(s), hidden {args.hidden}, "
        f"{args.heads}/{args.kv_heads} heads x {args.head_dim}, intermediate {args.intermediate}, "
        f"median of {args.repeats}"
    )
    unpacked = "fused-unpacked" in modes
    print(f"{'M':>6}" + "".join(f"{mode + ' (ms)':>21}" for mode in modes) + f"{'old/fused':>11}" + (f"{'unpacked/fused':>16}" if unpacked else ""))
    for m, r in results.items():
        best = r.get("fused", r["fused-torch"])
        print(
            f"{m:>6}"
            + "".join(f"{r[mode]:>21.3f}" for mode in modes)
            + f"{r['old'] / best:>10.2f}x"
            + (f"{r['fused-unpacked'] / best:>15.2f}x" if unpacked else "")
        )
    worst = {mode: max(d[mode] for d in diffs.values()) for mode in modes if mode != "old"}
    print("largest |output - old| over the batches: " + ", ".join(f"{mode} {v:.2e}" for mode, v in worst.items()))
    return 0
