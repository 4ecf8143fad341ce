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
            "OMP_WAIT_POLICY": user.get("OMP_WAIT_POLICY"), "GOMP_SPINCOUNT": user.get("GOMP_SPINCOUNT")}
        assert runtime.defaulted_env() == {}  # the user's choice: passed on to every child
