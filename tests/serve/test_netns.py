"""Real hosts on one machine: a router and two remote workers in their own network namespaces.

Topology (only addresses inside these namespaces are used)::

    R (router, load driver)        W1 (worker w1)       W2 (worker w2)
    lo  10.231.0.1/32
    vr1 10.231.1.1/24  <-- veth --> vw1 10.231.1.2/24
    vr2 10.231.2.1/24  <-- veth ---------------------> vw2 10.231.2.2/24

Under load, w1's link is cut (``ip link set vw1 down``) for longer than the router's heartbeat
timeout, then restored. Every request must end ok or with a coded error (none hung past its
deadline, none answered twice), traffic must move to w2 during the cut, w1 must rejoin and get
traffic again, and each worker's cache index in the router must equal the worker's own tree at
the end (it resynced after the cut). Needs root and iproute2 (CI has both): skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), RADIXSERVE_API_KEY="netns-key")
ROUTER_IP = "10.231.0.1"
CUT_AT, CUT_FOR, LOAD_FOR = 4.0, 7.0, 20.0  # seconds from the start of the load


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns add); CI runs as root"
    if shutil.which("ip") is None:
        return "needs iproute2 (apt-get install -y iproute2)"
    probe = f"rsprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@pytest.fixture
def hosts():
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = f"rs{os.getpid() % 100000}"
    ns = {"r": f"{tag}r", "w1": f"{tag}w1", "w2": f"{tag}w2"}
    procs: list[subprocess.Popen] = []
    try:
        for name in ns.values():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", ns["r"], "addr", "add", f"{ROUTER_IP}/32", "dev", "lo")
        for i in (1, 2):
            w = ns[f"w{i}"]
            _ip("link", "add", f"vr{i}", "netns", ns["r"], "type", "veth", "peer", "name", f"vw{i}", "netns", w)
            _ip("-n", ns["r"], "addr", "add", f"10.231.{i}.1/24", "dev", f"vr{i}")
            _ip("-n", w, "addr", "add", f"10.231.{i}.2/24", "dev", f"vw{i}")
            _ip("-n", ns["r"], "link", "set", f"vr{i}", "up")
            _ip("-n", w, "link", "set", f"vw{i}", "up")
            _ip("-n", w, "route", "add", f"{ROUTER_IP}/32", "via", f"10.231.{i}.1")
        yield ns, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in ns.values():
            _ip("netns", "del", name, check=False)


def _in(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=ENV, cwd=ROOT, **kw)


def test_link_cut_and_rejoin_across_hosts(hosts, llama_dir, tmp_path):
    ns, procs = hosts
    started = time.time()
    secret = tmp_path / "worker.secret"
    py = [sys.executable, "-m", "radixserve.cli", "--log-level", "WARNING"]
    router = _in(
        ns["r"],
        *py,
        "serve",
        "--model",
        llama_dir,
        "--workers",
        "0",
        "--host",
        ROUTER_IP,
        "--port",
        "7700",
        "--worker-secret-file",
        str(secret),
        "--api-key",
        "netns-key",
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(router)
    line = router.stdout.readline()
    assert f"tcp://{ROUTER_IP}:7700" in line, line
    for name in ("w1", "w2"):
        procs.append(
            _in(
                ns[name],
                *py,
                "worker",
                "--router",
                f"tcp://{ROUTER_IP}:7701",
                "--secret-file",
                str(secret),
                "--model",
                llama_dir,
                "--worker-id",
                name,
                "--threads",
                "1",
                "--kv-cache-tokens",
                "4096",
            )
        )
    # Both workers joined (the SDK, from the router's namespace).
    ready = _in(
        ns["r"],
        sys.executable,
        "-c",
        f"import sys; from radixserve.client import Client; c = Client('tcp://{ROUTER_IP}:7700', timeout=10); c.wait_ready(2, timeout=120); print('ready')",
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(ready)
    assert ready.communicate(timeout=130)[0].strip() == "ready"

    print(f"\nrouter and 2 workers ready in {time.time() - started:.1f} s")
    out = tmp_path / "load.json"
    driver = _in(
        ns["r"],
        sys.executable,
        str(ROOT / "tests" / "netns_load.py"),
        "--address",
        f"tcp://{ROUTER_IP}:7700",
        "--duration",
        str(LOAD_FOR),
        "--concurrency",
        "6",
        "--deadline",
        "20",
        "--out",
        str(out),
    )
    procs.append(driver)
    t0 = time.time()
    time.sleep(CUT_AT)
    cut = time.time()
    _ip("-n", ns["w1"], "link", "set", "vw1", "down")
    time.sleep(CUT_FOR)
    restored = time.time()
    _ip("-n", ns["w1"], "link", "set", "vw1", "up")
    _ip("-n", ns["w1"], "route", "replace", f"{ROUTER_IP}/32", "via", "10.231.1.1")  # down dropped it
    assert driver.wait(timeout=LOAD_FOR + 60) == 0
    result = json.loads(out.read_text())
    reqs = result["requests"]

    ok = [r for r in reqs if r["kind"] == "ok"]
    coded = [r for r in reqs if r["kind"] == "coded"]
    hung = [r for r in reqs if r["kind"] == "hung"]
    dup = [r for r in reqs if r["replies"] > 1]
    codes = sorted({r["code"] for r in coded})
    # Requests sent while w1 was unreachable and known dead (after the 3 s heartbeat timeout,
    # with a second of slack), and requests sent well after it came back (it rejoins within a
    # second or two of the link; 5 s of slack).
    during = [r for r in ok if cut + 4.5 <= r["sent"] <= restored]
    after = [r for r in ok if r["sent"] >= restored + 5.0]
    w1_after = [r for r in after if r["worker"] == "w1"]
    print(
        f"\nnetns link cut: {len(reqs)} requests: ok {len(ok)}, coded {len(coded)} {codes}, hung {len(hung)}, "
        f"duplicated {len(dup)}; during the cut {len(during)} ok, "
        f"{sum(r['worker'] == 'w2' for r in during)} on w2; after the rejoin {len(after)} ok, {len(w1_after)} on w1 "
        f"(load {LOAD_FOR:.0f} s, cut at {cut - t0:.1f} s for {restored - cut:.1f} s)"
    )
    assert not hung, hung[:3]
    assert not dup, dup[:3]
    assert set(codes) <= {"worker_lost"}, codes
    assert len(ok) >= 20
    assert during and all(r["worker"] == "w2" for r in during), during[:3]
    assert w1_after, "w1 got no traffic after its link came back"

    stats = result["stats"]
    counters = stats["router"]["counters"]
    assert counters["worker_deaths"] >= 1
    workers = stats["workers"]
    assert workers["w1"]["alive"] and workers["w2"]["alive"]
    for name in ("w1", "w2"):  # the router's mirror equals the worker's own tree (idle: no locks)
        w = workers[name]
        tree = w["engine"]["kv_evictable_tokens"] + w["engine"]["kv_locked_tokens"]
        assert w["index_synced"], name
        assert w["index_tokens"] == tree > 0, (name, w["index_tokens"], tree)

    # A worker that is stopped leaves at once: the router does not wait for a heartbeat timeout.
    procs[1].terminate()
    assert procs[1].wait(timeout=20) == 0
    probe = _in(
        ns["r"],
        sys.executable,
        "-c",
        "from radixserve.client import Client; "
        f"s = Client('tcp://{ROUTER_IP}:7700', timeout=10).stats(); "
        "print(s['workers']['w1']['alive'], s['router']['counters']['workers_left'])",
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(probe)
    assert probe.communicate(timeout=30)[0].split() == ["False", "1"]
