"""The built-in stand-in model and the tiny test models: created offline, deterministic,
loadable by transformers like any real checkpoint."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the hub

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from radixserve.model import builtin  # noqa: E402
from radixserve.model.builtin import (  # noqa: E402
    BUILTIN_VERSION,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    builtin_config,
    default_cache_dir,
    default_model_path,
    save_model_dir,
)
from radixserve.testing import TINY_ARCHS, make_tiny_model_dir  # noqa: E402

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> Path:
    return default_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(default_dir):
    return AutoTokenizer.from_pretrained(default_dir)


# ---------------------------------------------------------------------------------------
# default model
# ---------------------------------------------------------------------------------------


def test_default_model_dir_layout(default_dir):
    assert default_dir.name == BUILTIN_VERSION
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (default_dir / f).is_file(), f
    # no temp dirs left next to it
    assert [p.name for p in default_dir.parent.iterdir()] == [BUILTIN_VERSION]
    tc = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_default_model_loads_with_transformers(default_dir, tokenizer):
    config = AutoConfig.from_pretrained(default_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers) == (256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.intermediate_size == 704
    assert config.max_position_embeddings == 4096
    assert config.tie_word_embeddings is True
    assert config.rms_norm_eps == 1e-5
    assert config.vocab_size == 4096
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == 10000.0
    raw = json.loads((default_dir / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0  # legacy key for transformers 4.x / hand-rolled loaders

    assert len(tokenizer) == config.vocab_size
    assert tokenizer.bos_token_id == config.bos_token_id == 0
    assert tokenizer.eos_token_id == config.eos_token_id == 1
    assert tokenizer.pad_token_id == 2
    assert tokenizer.model_max_length == config.max_position_embeddings
    gen = json.loads((default_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, tokenizer.convert_tokens_to_ids("<|end|>")]

    model = AutoModelForCausalLM.from_pretrained(default_dir, dtype=torch.float32)
    model.eval()
    ids = tokenizer("1. e4 e5 2. Nf3", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()
    # random weights at std 0.02: close to uniform but not degenerate
    assert logits.std() > 0


def test_default_model_is_deterministic(default_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve"):
        other = default_model_path(tmp_path)
    assert "creating the built-in stand-in model" in caplog.text
    assert str(other) in caplog.text
    assert other != default_dir
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (other / f).read_bytes() == (default_dir / f).read_bytes(), f


def test_default_model_reused_not_rebuilt(default_dir, monkeypatch, caplog):
    def boom(*a, **k):
        raise AssertionError("should not rebuild")

    monkeypatch.setattr(builtin, "save_model_dir", boom)
    with caplog.at_level(logging.INFO, logger="radixserve"):
        assert default_model_path(default_dir.parent) == default_dir
    assert "creating" not in caplog.text


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "env"))
    assert default_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert default_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("RADIXSERVE_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "radixserve"


# ---------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------


def test_build_tokenizer_deterministic_and_exact_size():
    a = build_tokenizer(4096)
    b = build_tokenizer(4096)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) == 4096
    for n in (300, 777, 1000):
        assert len(build_tokenizer(n)) == n
    with pytest.raises(ValueError):
        build_tokenizer(100)


def test_special_tokens(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tokenizer.unk_token is None
    # special tokens in text map to their single ids
    ids = tokenizer("<|user|>hi<|end|>", add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|end|>")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1. e4 e5 2. Nf3 Nc6 3. Bb5 a6",
        "rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 0 1",
        "장기는 한국의 전통 보드게임입니다. 將棋 / 象棋 ♔♕♖♗♘♙ 🐉🀄️ café naïve",
        "  leading and  double  spaces\n\ttabs\r\n and trailing  ",
        "\x00\x01 control \u200b zero-width \ufeff bom",
        "<|extra_5|> looks like an added token",
    ],
)
def test_tokenizer_round_trip_examples(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


if given is not None:

    @settings(max_examples=200, deadline=None, database=None)
    @given(text=st.text())
    def test_tokenizer_round_trip_any_unicode(tokenizer, text):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text


def test_every_id_decodes(tokenizer):
    ids = list(range(len(tokenizer)))
    text = tokenizer.decode(ids)
    assert isinstance(text, str) and text
    assert tokenizer.convert_ids_to_tokens(len(tokenizer) - 1).startswith("<|extra_")
    # padding tokens are ordinary added tokens: visible even with skip_special_tokens
    assert "<|extra_0|>" in tokenizer.decode([tokenizer.convert_tokens_to_ids("<|extra_0|>")], skip_special_tokens=True)


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "You play janggi."},
        {"role": "user", "content": "Your move?"},
        {"role": "assistant", "content": "c4c5"},
        {"role": "user", "content": "And now?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|system|>You play janggi.<|end|><|user|>Your move?<|end|><|assistant|>c4c5<|end|><|user|>And now?<|end|><|assistant|>")
    assert tokenizer.apply_chat_template(messages, tokenize=False).endswith("<|end|>")
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if not isinstance(out, list) else out  # v5 returns a BatchEncoding
    assert ids == tokenizer(text, add_special_tokens=False).input_ids
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


# ---------------------------------------------------------------------------------------
# tiny models of each architecture
# ---------------------------------------------------------------------------------------


def _keys(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_each_arch(tmp_path, arch):
    path = make_tiny_model_dir(tmp_path / arch, arch)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
        config.max_position_embeddings,
    ) == (64, 2, 4, 2, 16, 128, 512, 1024)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == config.vocab_size
    assert tok.unk_token is None
    # NFC text only: transformers 5 loads model_type "qwen2" with Qwen2Tokenizer, which
    # swaps in Qwen's own NFC normalizer and pre-tokenizer regardless of tokenizer.json.
    text = "1. e4 e5 장기 café 🐉\n\tend"
    ids = tok(text, add_special_tokens=False).input_ids
    assert max(ids) < config.vocab_size and tok.decode(ids) == text
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[0, 10, 20, 30]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()

    keys = _keys(path)
    has_bias = "model.layers.0.self_attn.q_proj.bias" in keys
    has_qk_norm = "model.layers.0.self_attn.q_norm.weight" in keys
    assert has_bias == (arch == "qwen2")
    assert has_qk_norm == (arch == "qwen3")
    assert "lm_head.weight" in keys  # untied by default


def test_tiny_model_overrides(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    path = make_tiny_model_dir(tmp_path / "m", "llama", seed=3, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=rope, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(path)
    assert config.tie_word_embeddings is True
    params = getattr(config, "rope_parameters", None) or {**config.rope_scaling, "rope_theta": config.rope_theta}
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert params["rope_theta"] == 500000.0
    keys = _keys(path)
    assert "lm_head.weight" not in keys
    from safetensors.torch import load_file

    assert load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits.float()).all()


def test_tiny_model_seed(tmp_path):
    a = make_tiny_model_dir(tmp_path / "a", "qwen3", seed=0)
    b = make_tiny_model_dir(tmp_path / "b", "qwen3", seed=0)
    c = make_tiny_model_dir(tmp_path / "c", "qwen3", seed=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tiny_model_bad_arch(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model_dir(tmp_path / "x", "gpt2")


# ---------------------------------------------------------------------------------------
# save_model_dir: atomic, idempotent
# ---------------------------------------------------------------------------------------


def test_save_model_dir_concurrent_and_idempotent(tmp_path):
    tok = build_tokenizer(512)
    config = builtin_config(512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    target = tmp_path / "m"
    results, errors = [], []

    def work():
        try:
            results.append(save_model_dir(target, config, seed=0, tokenizer=tok))
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results == [target] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # temp dirs cleaned up
    AutoModelForCausalLM.from_pretrained(target)

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert save_model_dir(target, config, seed=1) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime


def test_save_model_dir_replaces_stale_non_model_dir(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "junk.txt").write_text("half-written by something else")
    config = builtin_config(512, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    assert save_model_dir(target, config, seed=0) == target
    assert (target / "config.json").is_file() and not (target / "junk.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# ---------------------------------------------------------------------------------------
# bench helpers
# ---------------------------------------------------------------------------------------


def test_bench_config_and_reexport():
    models = pytest.importorskip("bench.models")
    assert models.make_tiny_model_dir is make_tiny_model_dir
    c = models.bench_config()
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
    ) == (512, 8, 8, 4, 64, 1408, 32000, 8192)
    assert c.tie_word_embeddings is True
    assert len(getattr(c, "layer_types", None) or [None] * 8) == 8
