"""radixserve.runtime: the OpenMP wait default its own processes set, and what a benchmark's other
engine is spared."""

from __future__ import annotations

import os

from radixserve import runtime


def test_default_omp_wait_sets_a_short_spin_only_where_the_user_chose_nothing(monkeypatch):
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # recorded, so teardown restores what was there
        monkeypatch.setenv(key, "")
    monkeypatch.setattr(runtime, "_DEFAULTED", {})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    runtime.default_omp_wait()
    assert os.environ["GOMP_SPINCOUNT"] == str(runtime.OMP_SPIN_COUNT)
    assert runtime.defaulted_env() == {"GOMP_SPINCOUNT": str(runtime.OMP_SPIN_COUNT)}
    for user in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        monkeypatch.setattr(runtime, "_DEFAULTED", {})
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        for key, value in user.items():
            monkeypatch.setenv(key, value)
        runtime.default_omp_wait()
        assert {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} == {
            "OMP_WAIT_POLICY": user.get("OMP_WAIT_POLICY"),
            "GOMP_SPINCOUNT": user.get("GOMP_SPINCOUNT"),
        }
        assert runtime.defaulted_env() == {}  # the user's choice: passed on to every child


class _FakeLibc:
    """A libc whose mallopt records its calls (a plain function: ctypes sets argtypes on it)."""

    def __init__(self, result: int = 1):
        self.calls: list[tuple[int, int]] = []

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return result

        self.mallopt = mallopt


def test_default_malloc_keeps_freed_memory_mapped_unless_the_user_chose(monkeypatch):
    for key in runtime._MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(runtime.platform, "libc_ver", lambda: ("glibc", "2.36"))
    libc = _FakeLibc()
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: libc)
    assert runtime.default_malloc() is True
    # M_MMAP_THRESHOLD (-3), M_TRIM_THRESHOLD (-1), M_TOP_PAD (-2) of glibc's malloc.h
    assert dict(libc.calls) == {-3: runtime.MALLOC_MMAP_THRESHOLD, -1: runtime.MALLOC_TRIM_THRESHOLD, -2: runtime.MALLOC_TOP_PAD}
    assert runtime.MALLOC_MMAP_THRESHOLD <= 32 << 20  # glibc refuses more (half its 64 MiB heap)
    refused = _FakeLibc(result=0)
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: refused)
    assert runtime.default_malloc() is False and len(refused.calls) == 3  # each one tried, failure reported
    for key in runtime._MALLOC_ENV:  # the user's malloc settings stand: nothing is called
        monkeypatch.setenv(key, "0")
        untouched = _FakeLibc()
        monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name, libc=untouched: libc)
        assert runtime.default_malloc() is False and untouched.calls == []
        monkeypatch.delenv(key)
    monkeypatch.setattr(runtime.platform, "libc_ver", lambda: ("", ""))  # musl, macOS: glibc's knobs do not exist
    assert runtime.default_malloc() is False


def test_default_malloc_applies_on_this_glibc():
    """The real mallopt accepts every setting here (a fresh process: this one's malloc is left alone)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        import pytest

        pytest.skip("not a glibc system")
    env = {k: v for k, v in os.environ.items() if k not in runtime._MALLOC_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", "from radixserve.runtime import default_malloc; print(default_malloc())"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
