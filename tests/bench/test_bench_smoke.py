"""Smoke tests of ``python -m bench``: the commands run end to end on a tiny model and print
well-formed JSON with sane values. Speed is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.testing import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("bench") / "m", "llama"))


def run_bench(*args: str, timeout: float = 300) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--json", "--threads", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"--json must print exactly one line on stdout, got {len(lines)}"
    return json.loads(lines[0])


def test_fleet_quick(tiny_model):
    res = run_bench("fleet", "--quick", "--model", tiny_model)
    assert res["command"] == "fleet" and res["quick"] is True

    fleet = res["fleet"]
    cfg = fleet["config"]
    on, off = fleet["runs"]["cache_on"], fleet["runs"]["cache_off"]
    assert fleet["kv_cache_tokens"] >= fleet["working_set_tokens"]
    for run in (on, off):
        assert run["requests"] == cfg["agents"] * cfg["turns"]
        assert run["output_tokens"] == run["requests"] * cfg["output_tokens"]
        assert run["finish_reasons"] == ["length"]
        assert 0.0 <= run["hit_rate"] <= run["ideal_hit_rate"] <= 1.0
        assert run["wall_s"] > 0 and run["req_per_s"] > 0 and run["tok_per_s"] > 0
        assert 0 <= run["ttft_p50_ms"] <= run["ttft_p99_ms"]
        assert run["prefilled_tokens"] == run["prompt_tokens"] - run["cached_tokens"]
    assert off["hit_rate"] == 0.0 and off["cached_tokens"] == 0
    assert on["hit_rate"] > off["hit_rate"]
    assert on["pct_of_ideal"] >= 90  # the shared system prompt and every earlier turn hit
    assert fleet["speedup"] > 0

    gsp = res["gsp"]
    g = gsp["config"]
    assert set(gsp["runs"]) == {"lpm", "lpm_no_aging", "fcfs"}
    # Ideal: every prompt but each group's first hits the whole prefix.
    ideal = g["groups"] * (g["prompts"] - 1) * g["prefix_tokens"] / (g["groups"] * g["prompts"] * (g["prefix_tokens"] + g["question_tokens"]))
    for name, run in gsp["runs"].items():
        assert run["requests"] == g["groups"] * g["prompts"], name
        assert run["ideal_hit_rate"] == pytest.approx(ideal, abs=0.01), name
        assert 0.0 <= run["hit_rate"] <= run["ideal_hit_rate"] + 1e-9, name
    assert gsp["runs"]["lpm_no_aging"]["hit_rate"] > gsp["runs"]["fcfs"]["hit_rate"]


def test_throughput_tiny(tiny_model):
    res = run_bench("throughput", "--concurrency", "1,4", "--gen-len", "4", "--prompt-len", "8", "--repeats", "1", "--no-hf", "--model", tiny_model)
    assert res["command"] == "throughput" and res["serial"] is None
    rows = {r["concurrency"]: r for r in res["engine"]}
    assert set(rows) == {1, 4}
    assert rows[1]["ratio_vs_c1"] == pytest.approx(1.0)
    for c, r in rows.items():
        assert r["aggregate_tok_s"] > 0 and r["wall_s"] > 0
        assert r["per_stream_tok_s"] == pytest.approx(r["aggregate_tok_s"] / c)
        assert r["decode_phase_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert 0 < r["prefill_phase_s"] <= r["wall_s"]
    assert res["config"]["prefix_hit_tokens"] == 0  # prefix cache off


def test_throughput_serial_baseline(tiny_model):
    res = run_bench("throughput", "--concurrency", "1,2", "--gen-len", "3", "--prompt-len", "8", "--repeats", "1", "--hf-sample", "1", "--model", tiny_model)
    serial = {s["concurrency"]: s for s in res["serial"]}
    assert set(serial) == {1, 2}
    assert serial[2]["extrapolated"] and serial[2]["prompts_timed"] == 1
    assert all(s["tok_s"] > 0 for s in serial.values())
    assert all(r["ratio_vs_serial"] > 0 for r in res["engine"])


def test_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "throughput" in proc.stdout and "fleet" in proc.stdout


def test_kernels_cold_and_shuffled():
    # one decode case, the csrc/ kernel (or, where it does not build, the torch backend alone)
    out = run_bench("kernels", "--cases", "decode1x2200", "--modes", "kernel,torch", "--repeats", "2", "--cold-mib", "8", "--shuffle-pages", "--page-size", "1")
    assert out["cold_mib"] == 8 and out["shuffle_pages"] is True and out["page_size"] == 1
    case = out["cases"]["decode1x2200"]
    assert "torch" in case and set(case) <= {"kernel", "torch"}
    for timing in case.values():
        assert timing["ms"] > 0 and timing["gflops"] > 0


def test_cascade_with_its_floor():
    out = run_bench("cascade", "--batch", "4", "--prefix", "64", "--suffix", "8", "--layers", "1", "--repeats", "1", "--floor")
    assert out["flat_s"] > 0 and out["cascade_s"] > 0 and out["gemm_gflop_per_s"] > 0
    assert out["gflop"] == pytest.approx(4 * 4 * (64 + 8 + 1) * 64 * 8 * 1 / 1e9)  # 4 x requests x keys x dim x heads x layers
    assert out["cascade_over_floor"] == pytest.approx(out["cascade_s"] / out["floor_s"])


def test_structured_mask_steps_every_mode(tiny_model):
    out = run_bench("structured", "--model", tiny_model, "--batch", "2", "--skip-steps", "--mask-reps", "3")
    modes = out["batches"]["2"]
    assert set(modes) == {"plain", "regex", "json", "choice", "tools"}
    assert all(modes[m]["mask_ms"] > 0 for m in ("regex", "json", "choice", "tools"))


def test_kernels_against_another_build():
    # --against: another csrc/ (here this checkout's own, built again under a name of its own) timed
    # next to these kernels in one process; each mode but torch gets an @against column and a ratio
    from radixserve.kernels import attention as attention_ops

    if attention_ops.ops() is None:
        pytest.skip("the csrc/ kernels do not build here")
    out = run_bench("kernels", "--cases", "extend7x128/130", "--modes", "kernel,torch", "--repeats", "3", "--against", str(ROOT / "csrc"), timeout=600)
    assert out["against"] == str(ROOT / "csrc")
    case = out["cases"]["extend7x128/130"]
    assert set(case) == {"kernel", "kernel@against", "torch"}
    assert case["kernel"]["vs_against"] > 0 and case["kernel@against"]["ms"] > 0
    assert "vs_against" not in case["torch"]


@pytest.mark.parametrize("name, new_tokens, own_keys", [("cascade8x128/1024+128", 128, 128), ("cascade8x1/1024+136", 1, 136)])
def test_kernels_cascade_case_is_planned_as_one_group(name, new_tokens, own_keys):
    # the cascade cases run the engine's shared-prefix path (level 0 against the prefix, level 1
    # against each member's own keys, merged), and the GEMM path computes what the torch backend does
    import torch

    from bench.kernels import CASES, SHARED, _case
    from radixserve.attention.cpu_backend import CpuAttention
    from radixserve.attention.torch_backend import TorchAttention
    from radixserve.kernels import attention as attention_ops

    pool, meta, q, k, v, flops = _case(CASES[name], torch.float32, 16, SHARED[name], cascade=True)
    assert meta.cascade is not None and meta.cascade.groups == ((0, 8, 1024),)
    assert meta.cascade.decodes_only == (new_tokens == 1)
    n = new_tokens
    assert flops == 8 * 4 * 8 * 64 * (n * (1024 + own_keys - n) + n * (n + 1) // 2)
    ref = TorchAttention(pool, 64**-0.5)
    ref.plan(meta)
    want = ref.forward(q, k, v, 0)
    ext = attention_ops.ops()
    if ext is None:
        pytest.skip("the csrc/ kernels do not build here")
    got = CpuAttention(pool, 64**-0.5, ext)
    got.plan(meta)
    torch.testing.assert_close(got.forward(q, k, v, 0), want, atol=1e-5, rtol=1e-4)


def test_kernels_rejects_unknown_case():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench", "kernels", "--cases", "nope"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown case or mode nope" in proc.stderr


def test_peers_rounds_alternate_and_report_medians(monkeypatch):
    """--rounds N: every round runs both engines next to each other, alternating which goes first;
    the entry holds each round and the medians, the ratio being the median of the rounds' own
    ratios (not a ratio of medians), and the table prints every round before the medians."""
    from bench import peers

    walls = {"radixserve": [3.0, 9.0, 4.0], "vllm": [6.0, 10.0, 5.0]}  # round ratios 0.5, 0.9, 0.8
    calls = []

    def fake_child(python, engine, spec, timeout):
        k = sum(e == engine for e in calls)
        calls.append(engine)
        reqs = {f"r{i}": {"tokens": [1, 2] if engine == "vllm" or i else [1, 3], "prompt": 10, "cached": 4, "ttft_s": walls[engine][k] / 10} for i in range(2)}
        return {"requests": reqs, "wall_s": walls[engine][k], "backend": engine, "page_faults": 1, "system_s": 0.0}

    monkeypatch.setattr(peers, "run_child", fake_child)
    monkeypatch.setattr(
        peers,
        "specs",
        lambda args, model: {
            "gsp": {"workload": "gsp", "groups": 1, "prompts": 2, "prefix_tokens": 4, "question_tokens": 2, "output_tokens": 2, "max_running": 2}
        },
    )
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "0.32.0\n", ""))
    out = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: out.append(" ".join(map(str, a))))
    parser = peers.argparse.ArgumentParser()
    peers.add_arguments(parser)
    assert peers.run(parser.parse_args(["--model", "m", "--workloads", "gsp", "--rounds", "3", "--json"])) == 0
    assert calls == ["radixserve", "vllm", "vllm", "radixserve", "radixserve", "vllm"]
    entry = json.loads(out[-1])["workloads"]["gsp"]
    assert [round(r["ratios"]["wall"], 3) for r in entry["rounds"]] == [0.5, 0.9, 0.8]
    assert entry["ratios"]["wall"] == pytest.approx(0.8)  # (a ratio of the median walls would be 0.667)
    assert entry["engines"]["radixserve"]["wall_s"] == 4.0 and entry["engines"]["vllm"]["wall_s"] == 6.0
    assert entry["equal_requests"] == "1/2"
    table = peers.render(json.loads(out[-1]))
    assert "round 3: radixserve 4.00 s, vllm 5.00 s; wall 0.80x" in table
    assert "medians over 3 rounds" in table and "wall 0.80x" in table.splitlines()[-1]
    out.clear()
    assert peers.run(parser.parse_args(["--model", "m", "--rounds", "0"])) == 2

    # --floor: `bench floor` after each round (faked: 2, 4, 2 s), each wall over it, it over vLLM's
    floors = iter([2.0, 4.0, 2.0])
    asked = []

    def fake_floor(args, model, workload):
        asked.append((args.dtype, args.max_batched_tokens, workload))
        return {"floor_s": next(floors), "gemm_gflop_per_s": 100.0}

    monkeypatch.setattr(peers, "measure_floor", fake_floor)
    calls.clear()
    out.clear()
    assert peers.run(parser.parse_args(["--model", "m", "--workloads", "gsp", "--rounds", "3", "--floor", "--json"])) == 0
    assert asked == [("float32", 2048, "gsp")] * 3
    entry = json.loads(out[-1])["workloads"]["gsp"]
    assert [r["floor"]["radixserve_over_floor"] for r in entry["rounds"]] == [1.5, 2.25, 2.0]
    assert [r["floor"]["floor_over_vllm"] for r in entry["rounds"]] == [pytest.approx(1 / 3), 0.4, 0.4]
    assert entry["floor"] == {"floor_s": 2.0, "gemm_gflop_per_s": 100.0, "radixserve_over_floor": 2.0, "vllm_over_floor": 2.5, "floor_over_vllm": 0.4}
    table = peers.render(json.loads(out[-1]))
    assert "round 2: radixserve 9.00 s, vllm 10.00 s; wall 0.90x, TTFT p50 0.90x, equal tokens 1/2; floor 4.00 s, floor / vLLM 0.40x" in table
    assert (
        "compute floor (bench floor, medians: 100 GFLOP/s GEMM rate): 2.00 s; radixserve / floor 2.00x, "
        "vllm / floor 2.50x; floor / vLLM 0.40x (the 0.67x target is 1.68x the floor)"
    ) in table


def test_peers_radixserve_alone(tiny_model):
    """`bench peers --engines radixserve` (no vLLM needed): both workloads run in a child process
    and report wall time, TTFT and computed prompt tokens; the backend column names the attention
    backend and the GEMM backend the load chose. --breakdown's steps account for every computed
    token (each prompt token not cached, and every output token but the last of each request)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "peers",
            "--engines",
            "radixserve",
            "--model",
            tiny_model,
            "--threads",
            "1",
            "--agents",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "48",
            "--private-tokens",
            "8",
            "--output-tokens",
            "3",
            "--gsp-groups",
            "2",
            "--gsp-prompts",
            "2",
            "--gsp-prefix",
            "40",
            "--gsp-question",
            "6",
            "--gsp-output",
            "2",
            "--breakdown",
            "--floor",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert res["command"] == "peers" and "vllm_version" not in res
    for workload, requests in (("fleet", 4), ("gsp", 4)):
        entry = res["workloads"][workload]
        assert "ratios" not in entry  # one engine: nothing to compare
        r = entry["engines"]["radixserve"]
        assert r["requests"] == requests and r["wall_s"] > 0 and r["out_tok_per_s"] > 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["page_faults"] >= 0 and r["system_s"] >= 0  # of the timed part, from getrusage
        floor = entry["floor"]  # (--floor: `bench floor` in a child process, this workload's row)
        assert floor["floor_s"] > 0 and floor["gemm_gflop_per_s"] > 0 and "floor_over_vllm" not in floor
        assert floor["radixserve_over_floor"] == pytest.approx(r["wall_s"] / floor["floor_s"])
        attention, gemm = r["backend"].split("/")
        assert attention in ("CpuAttention", "TorchAttention") and gemm in ("mkl", "onednn", "none")
        kinds = entry["breakdown"]
        outputs = entry["config"]["output_tokens"]
        assert sum(b["tokens"] for b in kinds.values()) == r["computed_prompt_tokens"] + requests * (outputs - 1)
        assert kinds["prompt"]["steps"] > 0 and 0 < kinds["prompt"]["attention_s"] < kinds["prompt"]["s"]
        assert kinds["prompt"]["attention_gflop_per_s"] > 0 and kinds["prompt"]["linear_gflop_per_s"] > 0
        assert sum(b["s"] for b in kinds.values()) <= r["wall_s"]
        if attention == "CpuAttention":  # each kernel call timed: together, the prompt steps' attention
            calls = kinds["prompt"]["attention_calls"]
            assert set(calls) <= {"cascade prefix", "cascade suffix", "chunks", "decode kernel", "other"}
            assert 0 < sum(c["s"] for c in calls.values()) <= kinds["prompt"]["attention_s"]
            prompt_gflop = kinds["prompt"]["attention_gflop_per_s"] * kinds["prompt"]["attention_s"]
            assert sum(c["gflop"] for c in calls.values()) == pytest.approx(prompt_gflop, rel=1e-9)
    fleet = res["workloads"]["fleet"]["engines"]["radixserve"]
    assert 0 < fleet["computed_prompt_tokens"] < fleet["prompt_tokens"]  # turn 2 reuses turn 1's KV


def test_bigmodel_on_a_tiny_shape_beside_a_fake_llama_bench(tmp_path):
    # a stand-in llama-bench (CI has none) that logs its arguments and prints llama-bench's JSON
    fake = tmp_path / "llama-bench"
    log = "open(sys.argv[0] + '.log', 'a').write(' '.join(sys.argv[1:]) + '\\n')"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n{log}\nprint(json.dumps([{{'avg_ts': 250.0}}]))\n")
    fake.chmod(0o755)
    res = run_bench(
        "bigmodel", "--shape", "tiny", "--mix", "q4_k_m", "--dir", str(tmp_path), "--tokens", "6", "--kv-cache-tokens", "256", "--llama-bench", str(fake)
    )
    assert Path(res["file"]).is_file() and res["file_bytes"] > 0
    assert res["plan_weight_bytes"] == res["held_weight_bytes"]  # plan counts what the engine holds
    assert len(res["load_s"]) == 2 and all(s > 0 for s in res["load_s"])
    assert 0 < res["rss_base"] <= res["rss_loaded"] <= res["rss_after"] and res["kv_bytes"] > 0
    assert res["decode_ms"] > 0 and res["floor_ms"] > 0 and res["read_bytes"] < res["file_bytes"]
    # one llama-bench run before each load, on the same file, tokens and threads; each round's ratio
    runs = (tmp_path / "llama-bench.log").read_text().splitlines()
    assert runs == [f"-m {res['file']} -n 6 -p 0 -t 1 -r 2 -o json"] * 2
    assert [r["llama_cpp_tok_s"] for r in res["llama_cpp_rounds"]] == [250.0, 250.0]
    assert all(r["ratio"] == pytest.approx(r["radixserve_tok_s"] / 250.0) for r in res["llama_cpp_rounds"])
    assert res["ratio_median"] == pytest.approx(
        sorted(r["ratio"] for r in res["llama_cpp_rounds"])[0] / 2 + sorted(r["ratio"] for r in res["llama_cpp_rounds"])[1] / 2
    )
    # qlinear --model: passes over that model's own quantized layers
    from radixserve.kernels import quant

    if quant.ops() is not None:
        out = run_bench("qlinear", "--model", res["file"], "--rows", "1,2", "--repeats", "3", "--impl", "int8" if quant.ops().has_int8() else "fp32")
        kinds = ["pass", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"]
        assert [(r["rows"], r["kind"]) for r in out["results"]] == [(m, kind) for m in (1, 2) for kind in kinds]
        for r in out["results"]:
            assert r["layers"] == (2 * 4 + 1 if r["kind"] == "pass" else 1 if r["kind"] == "lm_head" else 2) and r["this"]["gb_s"] > 0
        passes = [r for r in out["results"] if r["kind"] == "pass"]
        assert all(p["bytes"] <= res["read_bytes"] and p["bytes"] == sum(r["bytes"] for r in out["results"][1:6]) for p in passes)


# -- bench peers --peer llamacpp, against fake servers (CI has no llama-server) ----------------------
FAKE_SERVER = ROOT / "tests" / "fake_llama_server.py"
SMALL = [
    "--threads",
    "1",
    "--agents",
    "2",
    "--turns",
    "2",
    "--system-tokens",
    "24",
    "--private-tokens",
    "4",
    "--output-tokens",
    "3",
    "--max-running",
    "2",
    "--gsp-groups",
    "2",
    "--gsp-prompts",
    "2",
    "--gsp-prefix",
    "20",
    "--gsp-question",
    "5",
    "--gsp-output",
    "2",
    "--gsp-max-running",
    "3",
    "--json",
]


@pytest.fixture(scope="module")
def header_gguf(tmp_path_factory) -> str:
    """A GGUF with a llama config and no weights: all that `bench peers` reads of the file itself."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in (
        ("add_context_length", 512),
        ("add_embedding_length", 64),
        ("add_block_count", 2),
        ("add_feed_forward_length", 128),
        ("add_head_count", 4),
        ("add_head_count_kv", 2),
        ("add_vocab_size", 120),
    ):
        getattr(w, add)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _peers(args: list[str], capsys) -> tuple[int, str, str]:
    from bench import peers

    parser = peers.argparse.ArgumentParser()
    peers.add_arguments(parser)
    code = peers.run(parser.parse_args(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_peers_llamacpp_needs_a_runnable_llama_server(tmp_path, header_gguf, capsys):
    base = ["--peer", "llamacpp", "--model", header_gguf]
    plain = tmp_path / "llama-server"
    plain.write_text("#!/bin/sh\n")
    for extra, words in (
        ([], "needs --llama-server PATH"),
        (["--llama-server", str(tmp_path / "nope")], f"--llama-server {tmp_path / 'nope'}: no such file"),
        (["--llama-server", str(plain)], "not executable"),
        (["--llama-server", str(plain), "--model", str(plain)], "not a GGUF file"),
        (["--llama-server", str(plain), "--breakdown"], "--breakdown times radixserve in-process"),
        (["--llama-server", str(plain), "--engines", "radixserve,vllm"], "give radixserve and/or llamacpp"),
    ):
        code, out, err = _peers(base + extra, capsys)
        assert code == 2 and out == "", extra
        assert words in err and len(err.strip().splitlines()) == 1, (extra, err)


def test_peers_llamacpp_server_that_does_not_start(tmp_path, header_gguf, capsys):
    binary = _script(tmp_path / "llama-server", '#!/bin/sh\necho "llama_model_load: error loading model: bad magic"\nexit 1\n')
    code, out, err = _peers(["--peer", "llamacpp", "--llama-server", binary, "--model", header_gguf, "--engines", "llamacpp", *SMALL], capsys)
    assert code == 2 and out == ""
    assert "llama-server did not start: it exited with status 1" in err
    assert "error loading model: bad magic" in err  # the tail of its log


def test_peers_llamacpp_against_fake_servers(tmp_path, header_gguf, capsys, monkeypatch):
    """Both engines behind (fake) HTTP servers: llama-server's command line, the requests each gets
    (token ids, each fleet turn's prompt extended by the ids the server streamed for the previous
    one), and the summary built from what they streamed back (computed prompt tokens, ratios)."""
    import subprocess as sp

    from bench import llamacpp

    log = tmp_path / "llama.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    binary = _script(tmp_path / "llama-server", f'#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} "$@"\n')
    gateway_flags = []

    class FakeGateway:  # what radixserve.testing.spawn_server returns, for the fake in gateway mode
        def __init__(self, model, *flags, **kw):
            gateway_flags.append((model, flags, kw["http"]))
            self.port = llamacpp.free_port()
            self.proc = sp.Popen(
                [sys.executable, str(FAKE_SERVER), "--port", str(self.port)], env={**os.environ, "FAKE_LLAMA_LOG": str(tmp_path / "gateway.jsonl")}
            )
            self.pid, self.http_url = self.proc.pid, f"http://127.0.0.1:{self.port}/v1"
            assert llamacpp.wait_healthy("127.0.0.1", self.port, self.proc, 30) is None

        def stop(self):
            self.proc.kill()
            self.proc.wait()

    monkeypatch.setattr(llamacpp, "spawn_server", FakeGateway)
    code, out, err = _peers(["--peer", "llamacpp", "--llama-server", binary, "--model", header_gguf, *SMALL], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert res["peer"] == "llamacpp" and res["llama_server_version"] == "version: 0 (fake)"

    runs = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [k for k, r in enumerate(runs) if "argv" in r]
    assert len(starts) == 2  # one llama-server per workload
    for w, start, end in (("fleet", starts[0], starts[1]), ("gsp", starts[1], len(runs))):
        entry, cfg = res["workloads"][w], res["workloads"][w]["config"]
        argv = runs[start]["argv"]
        flag = {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1) if argv[i].startswith("-")}
        assert flag["-m"] == header_gguf and flag["-t"] == "1" and flag["-np"] == str(cfg["max_running"])
        assert int(flag["-c"]) == cfg["max_running"] * cfg["max_model_len"]
        llama, radix = entry["engines"]["llamacpp"], entry["engines"]["radixserve"]
        assert llama["command"].endswith(" ".join(argv)) and "--max-running" in radix["command"]
        timed = runs[start + 3 : end]  # (after the two warm-up requests)
        for r in timed:
            body = r["body"]
            assert body["cache_prompt"] and body["ignore_eos"] and body["return_tokens"] and not body["stream"]
            assert body["n_predict"] == cfg["output_tokens"]
        assert llama["requests"] == radix["requests"] == len(timed)
        assert llama["computed_prompt_tokens"] == sum(len(r["body"]["prompt"]) - r["cached"] for r in timed)
        assert radix["computed_prompt_tokens"] == llama["computed_prompt_tokens"]  # (the same fake cache)
        assert 0 < llama["ttft_p50_ms"] <= llama["ttft_p99_ms"] and llama["page_faults"] >= 0
        assert entry["equal_requests"] == f"{len(timed)}/{len(timed)}"
        assert entry["ratios"]["wall"] > 0 and entry["ratios"]["computed_prompt_tokens"] == 1.0
    fleet = runs[starts[0] + 3 : starts[1]]
    for first in fleet[:2]:  # each agent's second turn extends its first prompt by what was streamed
        later = [r for r in fleet if r is not first and r["body"]["prompt"][: len(first["body"]["prompt"])] == first["body"]["prompt"]]
        assert len(later) == 1 and later[0]["body"]["prompt"][len(first["body"]["prompt"]) :][:3] == first["out"]
    ((model, flags, http),) = gateway_flags[:1]
    assert model == header_gguf and http and flags[flags.index("--max-running") + 1] == "2"
    table = peers_render(res)
    print(table)
    assert "radixserve / llama.cpp: wall" in table and f"llama-server {binary} (version: 0 (fake))" in table
    assert f"  llamacpp: {binary} -m {header_gguf}" in table


def peers_render(res: dict) -> str:
    from bench import peers

    return peers.render(res)


def test_peers_fleet_through_the_gateway_completes(tmp_path):
    """radixserve's side of `bench peers --peer llamacpp` (the HTTP gateway, one router client
    carrying 32 streams) on a tiny GGUF: every request completes. A per-client send bound of the
    router once cut the gateway off here (its health probes unanswered, router_lost after 10 s)."""
    from radixserve.testing import make_tiny_model_dir
    from radixserve.testing_gguf import write_gguf

    hf = make_tiny_model_dir(tmp_path / "hf", "llama", seed=1, max_position_embeddings=4096)
    model = write_gguf(tmp_path / "tiny.gguf", hf, "llama", lambda name: 8)  # Q8_0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "peers",
            "--peer",
            "llamacpp",
            "--llama-server",
            "/bin/true",
            "--engines",
            "radixserve",
            "--workloads",
            "fleet",
            "--model",
            str(model),
            "--threads",
            "2",
            "--agents",
            "32",
            "--max-running",
            "32",
            "--system-tokens",
            "1024",
            "--rounds",
            "1",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["workloads"]["fleet"]["engines"]["radixserve"]
    assert run["requests"] == 32 * 4 and run["backend"] == "http gateway"


def test_qlinear_shapes_rows_and_types():
    # each shape x rows gets a time and a rate; weights of every int8 type (K-quants included)
    from radixserve.kernels import quant

    ops = quant.ops()
    if ops is None:
        pytest.skip("the csrc/ kernels do not build here")
    impl = "int8" if ops.has_int8() else "fp32"
    for qtype in ("q4_0", "q6_k"):
        out = run_bench("qlinear", "--shapes", "64x256,37x512", "--rows", "1,3", "--qtype", qtype, "--impl", impl, "--repeats", "3", "--mib", "1")
        assert (out["qtype"], out["impl"], out["against"]) == (qtype, impl, None)
        assert [(r["shape"], r["rows"]) for r in out["results"]] == [("64x256", 1), ("64x256", 3), ("37x512", 1), ("37x512", 3)]
        assert all(r["this"]["ms"] > 0 and r["this"]["gb_s"] > 0 and "against" not in r for r in out["results"])


def test_qlinear_against_stages_a_renamed_copy(tmp_path, monkeypatch):
    # --against builds another checkout's quant kernels under a namespace of their own: a quant.cpp
    # with the namespace macro gets it as a -D flag, an older one (no macro) is renamed in its staged
    # copy; the other sources are copied as they are (the build is mocked)
    import torch
    from torch.utils import cpp_extension

    from bench import qlinear
    from radixserve.kernels import build

    calls = []
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch, "ops", type("Ops", (), {"__getattr__": lambda self, name: name})())
    name = qlinear.build_against(ROOT / "csrc")
    tag = build._sources_tag(ROOT / "csrc")
    assert name == f"radixserve_quant_{tag}" and calls[0]["name"] == name
    assert f"-DRADIXSERVE_QUANT_NS={name}" in calls[0]["extra_cflags"]
    staged = Path(calls[0]["sources"][0]).parent
    assert (staged / "quant.cpp").read_text() == (ROOT / "csrc" / "quant.cpp").read_text()
    assert (staged / "quant_int8.cpp").read_text() == (ROOT / "csrc" / "quant_int8.cpp").read_text()
    assert (staged / "quant.h").is_file()
    old = tmp_path / "old"
    old.mkdir()
    (old / "quant.cpp").write_text("TORCH_LIBRARY(radixserve_quant, m) {}\n")
    (old / "quant_int8.cpp").write_text("\n")
    name = qlinear.build_against(old)
    staged = Path(calls[1]["sources"][0]).parent
    assert (staged / "quant.cpp").read_text() == f"TORCH_LIBRARY({name}, m) {{}}\n"
    with pytest.raises(SystemExit, match="no quant.cpp"):
        qlinear.build_against(tmp_path / "cache")
