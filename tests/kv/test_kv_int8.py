"""int8 KV cache: quantize/dequantize error bounds, the pool's quantizing view, capacity, backend
selection, and the engine end to end (prefix hits, chunked prefill, preemption) with int8 KV."""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.attention.torch_backend import TorchAttention
from radixserve.errors import BadRequestError
from radixserve.kv.pool import KVPool, QuantizedSlots, dequantize_int8, quantize_int8

from conftest import random_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_dequantize_error_bound(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 64, generator=g) * torch.logspace(-4, 3, 64)[:, None, None]  # 7 decades of scale
    x[3] = 0.0  # an all-zero token
    x[5, 1, 7] = 5e4  # one outlier: only its own (token, head) scale grows
    x = x.to(dtype)
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    back = dequantize_int8(q, scale, torch.float32)
    err = (x.float() - back).abs()
    assert torch.all(err <= scale[..., None] / 2 * (1 + 1e-5) + 1e-30)  # round-to-nearest bound
    assert torch.equal(back[3], torch.zeros_like(back[3])) and torch.all(scale[3] == 1.0)
    assert torch.allclose(scale[5, 1], x[5, 1].float().abs().max() / 127)
    assert float(scale[5, 0]) < 1.0  # the neighbouring head keeps its small scale
    rel = err.amax(-1) / x.float().abs().amax(-1).clamp_min(1e-30)
    assert float(rel.max()) <= 0.5 / 127 + 1e-6
    assert dequantize_int8(q, scale, dtype).dtype == dtype


def test_pool_quantized_view_stores_and_reads():
    pool = KVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", kv_dtype="int8")
    assert pool.k[0].dtype == torch.int8 and pool.k_scale[1].shape == (8, 4, 2)
    k = torch.randn(5, 2, 16)
    slots = torch.tensor([0, 3, 9, 17, 31])
    view = pool.k_slots(1)
    assert isinstance(view, QuantizedSlots) and view.shape == (32, 2, 16)
    view[slots] = k
    back = view.index_select(0, slots)
    assert back.dtype == torch.float32
    assert torch.all((back - k).abs() <= pool.k_scale[1].view(-1, 2)[slots][..., None] / 2 + 1e-6)
    assert torch.count_nonzero(pool.k[0]) == 0 and torch.count_nonzero(pool.v[1]) == 0  # nothing else written
    others = torch.tensor([s for s in range(32) if s not in slots.tolist()])
    assert torch.count_nonzero(view.index_select(0, others)) == 0


def test_capacity_per_gb():
    layers, heads, dim = 4, 2, 64
    f32 = KVPool.bytes_per_token(layers, heads, dim, torch.float32)
    bf16 = KVPool.bytes_per_token(layers, heads, dim, torch.bfloat16)
    i8 = KVPool.bytes_per_token(layers, heads, dim, torch.float32, "int8")
    assert (f32, bf16, i8) == (2 * layers * heads * dim * 4, 2 * layers * heads * dim * 2, 2 * layers * heads * (dim + 4))
    assert f32 / i8 == pytest.approx(256 / 68) and bf16 / i8 == pytest.approx(128 / 68)


def test_engine_sizes_the_pool_for_int8_and_picks_torch_attention(llama_dir):
    plain = Engine(llama_dir, kv_memory_gb=0.01)
    quant = Engine(llama_dir, kv_memory_gb=0.01, kv_dtype="int8")
    cfg = plain.loaded.config
    dim = cfg.head_dim
    assert quant.pool.capacity_tokens / plain.pool.capacity_tokens == pytest.approx(4 * dim / (dim + 4), rel=1e-3)
    assert isinstance(quant.runner.attention, TorchAttention)
    with pytest.raises(BadRequestError) as e:
        Engine(llama_dir, kv_cache_tokens=256, kv_dtype="int8", attention="flashinfer")
    assert e.value.field == "attention"
    with pytest.raises(BadRequestError) as e:
        Engine(llama_dir, kv_cache_tokens=256, kv_dtype="fp4")
    assert e.value.field == "kv_dtype"


def test_engine_end_to_end_with_int8_kv(llama_dir):
    """Prefix hits, chunked prefill and preemption with int8 KV; greedy stays close to the
    unquantized cache (the first token agrees on most prompts: the error is a fraction of a %)."""
    shared = random_prompts([200], seed=1)[0]
    prompts = [shared + p for p in random_prompts([5, 40, 90, 13, 60, 25, 70, 8], seed=2)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    ref = Engine(llama_dir, kv_cache_tokens=8192).generate(prompts, sp)
    with Engine(llama_dir, kv_cache_tokens=420, kv_dtype="int8", max_prefill_chunk=64, debug_checks=True) as e:
        outs = e.generate(prompts, sp)
        stats = e.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)
    first = sum(o.token_ids[0] == r.token_ids[0] for o, r in zip(outs, ref))
    assert first >= 6, [(o.token_ids[:4], r.token_ids[:4]) for o, r in zip(outs, ref)]
    # where the first token agrees, its logprob moved by little
    for o, r in zip(outs, ref):
        if o.token_ids[0] == r.token_ids[0]:
            assert abs(o.logprobs[0].logprob - r.logprobs[0].logprob) < 0.05


def test_cli_has_kv_dtype():
    import json

    from radixserve.cli import _engine_config, build_parser
    from radixserve.config import WorkerConfig
    from radixserve.serve.launch import worker_command

    args = build_parser().parse_args(["generate", "--kv-dtype", "int8", "hi"])
    assert args.kv_dtype == "int8"
    # ...and it reaches the workers serve starts (their config travels as JSON)
    assert json.loads(worker_command(WorkerConfig(engine=_engine_config(args), router="tcp://127.0.0.1:1"))[-1])["engine"]["kv_dtype"] == "int8"
