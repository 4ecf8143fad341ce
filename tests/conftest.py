"""Shared fixtures: tiny random models built locally (no downloads) and transformers references."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from radixserve.testing import TINY_ARCHS, make_tiny_model_dir

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_sessionstart(session):
    """Build the csrc/ extension (or load it from its cache) once, before any test. A fresh
    checkout's first build takes a minute or two; left to whichever test came first, it could
    fall to the worker processes of a test cluster, whose wait for them to be ready it outlasts,
    and inside a test it would count against that test's timeout. Where it cannot be built, the
    torch paths run instead (one warning)."""
    from radixserve.attention import cpu_ext

    cpu_ext.load()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """One tiny random checkpoint per supported architecture (fp32)."""
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model_dir(root / arch, arch, seed=7)) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> str:
    return tiny_models["llama"]


def random_prompts(lengths, *, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ids >= 7 skip the special tokens (bos/eos/...), so no prompt contains an EOS.
    return [torch.randint(7, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' generate, greedy, fp32, CPU, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos=True
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(p):].tolist())
    return out
