"""GPU checks in one run (for a lent NVIDIA machine): FlashInfer vs the torch backend on the same
metadata, greedy tokens vs transformers, and decode throughput by batch size.

    bash bench/device_check.sh        # installs carried wheels from .device/wheels, then runs this

Prints one line per check with PASS/FAIL and the numbers; exits non-zero if any check failed.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time

import torch

from radixserve.attention.flashinfer_backend import FlashInferAttention
from radixserve.attention.metadata import build_metadata
from radixserve.attention.torch_backend import TorchAttention
from radixserve.kv.pool import KVPool

failures = 0


def report(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def compare_backends(page_size: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed)
    dim = 128
    pool = KVPool(num_layers=1, num_pages=65536 // page_size, page_size=page_size, num_kv_heads=kv_heads,
                  head_dim=dim, dtype=dtype, device="cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    scale = dim**-0.5
    flashinfer = FlashInferAttention(pool, scale, num_qo_heads=heads)
    reference = TorchAttention(pool, scale)

    def check(name, tables, kv_lens, qo_lens, groups=()):
        n = sum(qo_lens)
        q = torch.randn(n, heads, dim, dtype=dtype, device="cuda")
        k = torch.randn(n, kv_heads, dim, dtype=dtype, device="cuda")
        v = torch.randn(n, kv_heads, dim, dtype=dtype, device="cuda")
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
    check("decode", [alloc(n) for n in lens], lens, [1] * 16)
    prefix = [rng.randint(0, 1500) for _ in range(6)]
    new = [rng.randint(2, 300) for _ in range(6)]
    kv = [p + n for p, n in zip(prefix, new)]
    check("extend", [alloc(n) for n in kv], kv, new)
    mixed_kv = kv + lens[:8]
    check("mixed", [alloc(n) for n in mixed_kv], mixed_kv, new + [1] * 8)
    shared = alloc(1024 // page_size * page_size)
    suffix = [rng.randint(1, 200) for _ in range(12)]
    tables = [shared + alloc(s) for s in suffix]
    kv_lens = [len(shared) * page_size + s for s in suffix]
    check("cascade", tables + [alloc(50)], kv_lens + [50], [1] * 13, groups=[(0, 12, len(shared) * page_size)])


def greedy_vs_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from radixserve import Engine, SamplingParams
    from radixserve.testing import make_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model_dir(tmp + "/m", "qwen3", hidden_size=256, head_dim=64,
                                            num_attention_heads=8, num_key_value_heads=2, dtype="bfloat16"))
        prompts = [[random.Random(i).randrange(7, 512) for _ in range(n)] for i, n in enumerate((5, 60, 300, 700))]
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        hf.generation_config.eos_token_id = None
        engine = Engine(model_dir, device="cuda", dtype="bfloat16", page_size=16, kv_cache_tokens=65536)
        outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        same = 0
        for p, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False, pad_token_id=0)
            ref = ref[0, len(p):].tolist()
            same += sum(a == b for a, b in zip(out.token_ids, ref))
        total = 16 * len(prompts)
        # bf16 kernels round differently, so a late divergence is tolerated; an early one is a bug.
        report("greedy vs transformers (bf16, flashinfer)", same >= 0.75 * total, f"{same}/{total} tokens equal")


def decode_throughput() -> None:
    from bench.models import bench_model_path

    from radixserve import Engine, SamplingParams

    engine = Engine(str(bench_model_path()), device="cuda", dtype="bfloat16", page_size=16,
                    kv_cache_tokens=1 << 20, max_running=256, cascade_min_shared_tokens=None)
    for batch in (1, 8, 32, 64, 128, 256):
        prompts = [[random.Random(i).randrange(7, 32000) for _ in range(128)] for i in range(batch)]
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"INFO decode batch {batch:4d}: {tokens / elapsed:10.0f} tok/s aggregate, "
              f"{tokens / elapsed / batch:8.1f} tok/s per stream", flush=True)


if __name__ == "__main__":
    for page_size in (1, 16):
        for heads, kv_heads in ((32, 8), (16, 16)):
            for dtype in (torch.bfloat16, torch.float16):
                compare_backends(page_size, heads, kv_heads, dtype, seed=page_size + heads)
    greedy_vs_transformers()
    decode_throughput()
    print(f"{failures} failed checks")
    sys.exit(1 if failures else 0)
