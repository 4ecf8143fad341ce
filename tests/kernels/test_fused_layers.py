"""The fused decoder-layer ops (csrc/layers.cpp via radixserve/kernels/layers.py) equal their torch
references, in place where they should be; the fused qkv_proj/gate_up_proj load from Hugging Face
names and shard right under tensor parallelism."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from radixserve.kernels import layers as fused
from radixserve.model.loader import load_model
from radixserve.model.parallel import shard_model
from radixserve.testing import TINY_ARCHS

ops = fused.kernels()
TOOLCHAIN = shutil.which(os.environ.get("CXX", "c++")) is not None and not os.environ.get("RADIXSERVE_NO_EXT")
needs_kernels = pytest.mark.skipif(ops is None and not TOOLCHAIN, reason="no C++ compiler (or RADIXSERVE_NO_EXT)")
# fp32: the kernels do the reference's arithmetic (sums of squares in another order); bf16: one
# rounding at the end where torch rounds after every op.
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@needs_kernels
def test_the_layer_kernels_are_built_where_a_compiler_exists():
    assert ops is not None, "csrc/layers.cpp did not build or register although a C++ compiler is present"


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(fused, "_ops", [None])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 512), (3, 7), (37, 513), (130, 64), (5, 1)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_reference(dtype, rows, hidden, with_residual):
    x = randn(rows, hidden, dtype=dtype, seed=1, scale=3.0)
    res = randn(rows, hidden, dtype=dtype, seed=2) if with_residual else None
    w = randn(hidden, dtype=dtype, seed=3)
    x_ref = x.clone()
    want = fused.add_rms_norm_reference(x_ref, res, w, 1e-5)
    got = fused.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, x_ref)  # the in-place residual add rounds as torch's add_ does
    if not with_residual:
        assert torch.equal(x, randn(rows, hidden, dtype=dtype, seed=1, scale=3.0))  # x only read


@needs_kernels
def test_add_rms_norm_epsilon_and_strided_rows():
    x = torch.zeros(4, 16)  # all-zero rows: the result is 0, not NaN, thanks to eps
    assert torch.equal(fused.add_rms_norm(x, None, torch.ones(16), 1e-6), torch.zeros(4, 16))
    tiny = torch.full((2, 8), 1e-3)
    torch.testing.assert_close(
        fused.add_rms_norm(tiny, None, torch.ones(8), 1.0), fused.add_rms_norm_reference(tiny.clone(), None, torch.ones(8), 1.0), atol=1e-7, rtol=1e-6
    )
    base = randn(6, 3, 10, seed=4)
    view = base[:, 1]  # rows with a stride of 30: normed without a copy, the residual added in place
    res = randn(6, 10, seed=5)
    want_base = base.clone()
    want = fused.add_rms_norm_reference(want_base[:, 1], res, torch.ones(10), 1e-5)
    got = fused.add_rms_norm(view, res, torch.ones(10), 1e-5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(base, want_base)  # only the viewed rows changed
    heads = randn(5, 3, 8, seed=6)[:, :2]  # Qwen3's q-norm over a strided [T, H, D] view
    torch.testing.assert_close(
        fused.add_rms_norm(heads, None, torch.ones(8), 1e-6), fused.add_rms_norm_reference(heads.clone(), None, torch.ones(8), 1e-6), **TOL[torch.float32]
    )


def _qkv(tokens, hq, hk, dim, dtype, seed):
    qkv = randn(tokens, (hq + 2 * hk) * dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    return qkv, q.view(tokens, hq, dim), k.view(tokens, hk, dim), v


def _tables(tokens, dim, dtype, seed):
    angle = randn(tokens, dim // 2, seed=seed, scale=20.0)
    return angle.cos().to(dtype), angle.sin().to(dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,dim", [(1, 8, 4, 64), (3, 5, 1, 6), (67, 4, 2, 128), (2, 1, 1, 2)])
def test_rope_in_place_equals_reference(dtype, tokens, hq, hk, dim):
    qkv, q, k, v = _qkv(tokens, hq, hk, dim, dtype, seed=7)
    ref_qkv, ref_q, ref_k, _ = _qkv(tokens, hq, hk, dim, dtype, seed=7)
    cos, sin = _tables(tokens, dim, dtype, seed=8)
    v_before = v.clone()
    fused.rope_(q, k, cos, sin)
    fused.rope_reference_(ref_q, ref_k, cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(v, v_before)  # v, between k and the next token's q, untouched


@needs_kernels
def test_rope_fp32_is_bit_identical_and_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    qkv, q, k, _ = _qkv(9, 4, 2, 64, torch.float32, seed=9)
    cos, sin = _tables(9, 64, torch.float32, seed=10)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    fused.rope_(q, k, cos, sin)
    assert torch.equal(q, hf_q[0].transpose(0, 1)) and torch.equal(k, hf_k[0].transpose(0, 1))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1408), (3, 17), (70, 1), (33, 257)])
def test_silu_and_mul_equals_reference(dtype, rows, inter):
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=11, scale=6.0)
    before = gate_up.clone()
    got = fused.silu_and_mul(gate_up)
    want = fused.silu_and_mul_reference(gate_up)
    assert got.shape == (rows, inter) and torch.equal(gate_up, before)
    torch.testing.assert_close(got, want, **TOL[dtype])


@needs_kernels
def test_silu_and_mul_extremes():
    g = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.0, 100.0, 1e4])
    gate_up = torch.cat([g, torch.full_like(g, 2.0)])[None]
    torch.testing.assert_close(fused.silu_and_mul(gate_up), F.silu(g)[None] * 2.0, atol=1e-6, rtol=1e-6)


def _argmax_rows(cols: int) -> torch.Tensor:
    """Rows that argmax must break right: ties (the first wins), NaNs (the first NaN wins, even
    before a larger value), infinities, all -inf, and -0.0 beside 0.0, at each position class
    (first, in a 16-lane block, in the tail)."""
    rows = [randn(cols, seed=20), torch.full((cols,), float("-inf")), torch.zeros(cols)]
    for at in sorted({0, cols // 3, cols - 1, min(16, cols - 1)}):
        r = randn(cols, seed=21 + at)
        r[at] = 9.0
        r[(at + 5) % cols] = 9.0  # a tie: the first of the two wins
        rows.append(r)
        n = randn(cols, seed=40 + at)
        n[at] = float("nan")
        n[(at + 7) % cols] = float("nan")
        n[(at + 3) % cols] = float("inf")
        rows.append(n)
        z = torch.full((cols,), -1.0)
        z[at] = -0.0
        z[(at + 2) % cols] = 0.0
        rows.append(z)
        i = randn(cols, seed=60 + at)
        i[at] = float("inf")
        rows.append(i)
    return torch.stack(rows)


@needs_kernels
@pytest.mark.parametrize("cols", [1, 2, 15, 16, 17, 33, 1000, 32000])
def test_argmax_equals_torch_max_indices(cols):
    x = _argmax_rows(cols)
    assert torch.equal(fused.argmax(x), x.max(dim=-1).indices)
    wide = torch.cat([x, torch.full((x.shape[0], 3), 1e9)], dim=1)[:, :cols]  # rows with a stride > cols
    assert wide.stride(0) == cols + 3 and torch.equal(fused.argmax(wide), x.max(dim=-1).indices)
    big = randn(70, cols, seed=80, scale=4.0)  # enough rows to split over the threads
    assert torch.equal(fused.argmax(big), big.max(dim=-1).indices)


def test_fallbacks_are_the_references(no_kernels):
    x, res, w = randn(4, 9, seed=12), randn(4, 9, seed=13), randn(9, seed=14)
    x2 = x.clone()
    assert torch.equal(fused.add_rms_norm(x, res, w, 1e-5), fused.add_rms_norm_reference(x2, res, w, 1e-5))
    assert torch.equal(x, x2)
    gate_up = randn(3, 10, seed=15)
    assert torch.equal(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :5]) * gate_up[:, 5:])
    _, q, k, _ = _qkv(3, 2, 1, 8, torch.float32, seed=16)
    _, rq, rk, _ = _qkv(3, 2, 1, 8, torch.float32, seed=16)
    cos, sin = _tables(3, 8, torch.float32, seed=17)
    fused.rope_(q, k, cos, sin)
    rot = lambda x: torch.cat([-x[..., 4:], x[..., :4]], -1)  # noqa: E731 - transformers' rotate_half
    c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    assert torch.equal(q, rq * c + rot(rq) * s) and torch.equal(k, rk * c + rot(rk) * s)
    x = _argmax_rows(20)
    assert torch.equal(fused.argmax(x), x.max(dim=-1).indices)


def _hf_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fused_weights_load_from_hf_names(tiny_models, arch):
    loaded = load_model(tiny_models[arch])
    hf = _hf_tensors(tiny_models[arch])
    views = loaded.model.checkpoint_tensors()
    assert set(views) == set(hf) - ({"lm_head.weight"} if loaded.model.tie_word_embeddings else set())
    for name, tensor in views.items():
        assert torch.equal(tensor, hf[name]), name
    attn, mlp = loaded.model.model.layers[1].self_attn, loaded.model.model.layers[1].mlp
    p = "model.layers.1."
    for leaf in ("weight", "bias") if arch == "qwen2" else ("weight",):
        want = torch.cat([hf[f"{p}self_attn.{n}_proj.{leaf}"] for n in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, leaf), want)
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]]))
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp_shards_take_each_ranks_heads_of_q_k_v_and_halves_of_gate_up(tiny_models, arch):
    loaded = load_model(tiny_models[arch])
    hf = _hf_tensors(tiny_models[arch])
    cfg, world = loaded.config, 2
    dim = cfg.hidden_size // cfg.num_attention_heads if not getattr(cfg, "head_dim", None) else cfg.head_dim
    nq, nk, inter = cfg.num_attention_heads * dim // world, cfg.num_key_value_heads * dim // world, cfg.intermediate_size // world
    for rank in range(world):
        model = copy.deepcopy(loaded.model)
        shard_model(model, rank, world)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        p = "model.layers.0."
        for leaf in ("weight", "bias") if arch == "qwen2" else ("weight",):
            q, k, v = (hf[f"{p}self_attn.{n}_proj.{leaf}"] for n in "qkv")
            want = torch.cat([q[rank * nq : (rank + 1) * nq], k[rank * nk : (rank + 1) * nk], v[rank * nk : (rank + 1) * nk]])
            assert torch.equal(getattr(attn.qkv_proj, leaf), want)
        gate, up = hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[rank * inter : (rank + 1) * inter], up[rank * inter : (rank + 1) * inter]]))
        assert attn.qkv_sizes() == [nq, nk, nk] and mlp.gate_up_proj.out_features == 2 * inter


def test_bench_layers_runs_and_the_modes_agree():
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "layers",
            "--tokens",
            "1,5",
            "--repeats",
            "1",
            "--hidden",
            "48",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "12",
            "--intermediate",
            "40",
            "--threads",
            "1",
            "--json",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert set(res["ms"]) == {"1", "5"} and all(v > 0 for r in res["ms"].values() for v in r.values())
    assert res["max_abs_diff_vs_old"]["5"]["fused-torch"] <= 1e-6  # the same torch ops, only the GEMMs fused
    assert all(d < 1e-5 for r in res["max_abs_diff_vs_old"].values() for d in r.values())


def _prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Our model's logits for every position of one fresh prompt (torch attention backend)."""
    from radixserve.attention.metadata import build_metadata
    from radixserve.attention.torch_backend import TorchAttention
    from radixserve.kv.pool import KVPool
    from radixserve.model.llama import ForwardBatch, head_dim_of

    cfg, page, n = loaded.config, 4, len(ids)
    pool = KVPool(
        num_layers=cfg.num_hidden_layers,
        num_pages=-(-n // page) + 1,
        page_size=page,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim_of(cfg),
        dtype=loaded.dtype,
        device="cpu",
    )
    attention = TorchAttention(pool, head_dim_of(cfg) ** -0.5)
    attention.plan(build_metadata([list(range(-(-n // page)))], [n], [n], page))
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(n), attention=attention, logits_rows=torch.arange(n))
    return loaded.model(batch)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_equal_transformers(tiny_models, arch, kernels_on, monkeypatch):
    from transformers import AutoModelForCausalLM

    if not kernels_on:
        monkeypatch.setattr(fused, "_ops", [None])
    ids = torch.randint(7, 512, (23,), generator=torch.Generator().manual_seed(18)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = _prefill_logits(load_model(tiny_models[arch]), ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
