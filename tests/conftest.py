"""Shared fixtures: tiny random models built locally (no downloads) and transformers references."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Builds of csrc/ (the session's, and the tests' and test servers' own) run two compilers at a
# time: each holds about 1 GB, and ninja's default (cores + 2) on a 2-core box held 4 GB.
os.environ.setdefault("MAX_JOBS", "2")

import pytest
import torch

from radixserve.testing import TINY_ARCHS, make_tiny_model_dir

torch.set_num_threads(min(2, os.cpu_count() or 1))


_collected_at_rss = 0


@pytest.fixture(autouse=True)
def _collect_dead_engines():
    """After a test that grew this process by 256 MiB or more, collect its garbage and hand the
    freed heap back to the kernel. An Engine and its engine thread refer to each other, so a
    dropped engine (its model, KV pages, buffers) waits for a full collection, which allocations
    of few, large tensors seldom trigger: the dead engines of one test file added up to gigabytes.
    And tests that run ``radixserve.cli.main`` in this process apply its malloc settings
    (radixserve/runtime.py: freed memory stays mapped, for the step loop's sake), so without a
    trim this process only grew. (Reading the RSS costs microseconds; a collection after the
    first engine froze the startup objects, and a trim, tens of milliseconds.)"""
    global _collected_at_rss
    yield
    import gc

    import psutil

    rss = psutil.Process().memory_info().rss
    if rss - _collected_at_rss >= 256 << 20:
        gc.collect()
        _malloc_trim()
        _collected_at_rss = psutil.Process().memory_info().rss


@pytest.fixture(scope="module", autouse=True)
def _release_a_modules_memory():
    """Once a test file is done (its module fixtures torn down: engines, models, clusters), the
    same collection and trim, whatever the growth."""
    global _collected_at_rss
    yield
    import gc

    import psutil

    gc.collect()
    _malloc_trim()
    _collected_at_rss = psutil.Process().memory_info().rss


def _malloc_trim() -> None:
    import ctypes
    import platform

    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


def _tree_rss() -> tuple[int, int]:
    """(this process's RSS, the summed RSS of it and all its descendants), in bytes."""
    import psutil

    me = psutil.Process()
    own = total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return own, total


class _MemLog:
    """Opt-in (RADIXSERVE_TEST_MEMLOG=FILE): samples the process tree's RSS every 0.2 s and
    appends one line per test to FILE: peak tree RSS, peak own RSS, own RSS after the test
    (MiB), node id. Used to find the tests and fixtures that hold the suite's memory."""

    def __init__(self, path: str):
        import threading

        self.path = path
        self.peak_own = self.peak_tree = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        import time

        while True:
            own, tree = _tree_rss()
            with self.lock:
                self.peak_own = max(self.peak_own, own)
                self.peak_tree = max(self.peak_tree, tree)
            time.sleep(0.2)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        with self.lock:
            self.peak_own, self.peak_tree = _tree_rss()
        yield
        own, tree = _tree_rss()
        with self.lock:
            peak_tree, peak_own = max(self.peak_tree, tree), max(self.peak_own, own)
        mib = 1 << 20
        with open(self.path, "a") as f:
            f.write(f"{peak_tree // mib}\t{peak_own // mib}\t{own // mib}\t{item.nodeid}\n")


def pytest_configure(config):
    path = os.environ.get("RADIXSERVE_TEST_MEMLOG")
    if path:
        config.pluginmanager.register(_MemLog(path), "radixserve-memlog")


def pytest_sessionstart(session):
    """Build the csrc/ extension (or load it from its cache) once, before any test. A fresh
    checkout's first build takes a minute or two; left to whichever test came first, it could
    fall to the worker processes of a test cluster, whose wait for them to be ready it outlasts,
    and inside a test it would count against that test's timeout. Where it cannot be built, the
    torch paths run instead (one warning), except under ``RADIXSERVE_REQUIRE_EXT=1`` (.ci/run sets it):
    there a build that fails stops the run, rather than letting the kernels' tests skip and the
    rest pass on the torch paths."""
    from radixserve.kernels import build

    if build.load() is None and os.environ.get("RADIXSERVE_REQUIRE_EXT") == "1":
        pytest.exit("RADIXSERVE_REQUIRE_EXT=1 and the csrc/ extension did not build (its error is logged above)", returncode=1)


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
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out
