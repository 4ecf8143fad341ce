"""Issue 13 item 6: `radixserve serve` as a new user meets it: clear one-line errors, fail fast,
a ready line, a second Ctrl-C exits, workers immune to a shadowing working directory."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from radixserve import Engine, __version__
from radixserve.client import Client
from radixserve.errors import ModelLoadError

from serve_cluster import ENV

pytestmark = pytest.mark.timeout(180)

CLI = [sys.executable, "-P", "-m", "radixserve.cli"]


def _run(args, timeout=120, cwd=None):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip() and " WARNING " not in ln and " INFO " not in ln]


def test_version():
    out = _run(["--version"])
    assert out.returncode == 0 and out.stdout.strip() == f"radixserve {__version__}"


def test_bad_model_path_is_one_line(tmp_path):
    out = _run(["serve", "--model", str(tmp_path / "nope"), "--port", "0"])
    assert out.returncode == 2
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "no such directory" in lines[0], out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(llama_dir):
    out = _run(["serve", "--model", llama_dir, "--port", "0", "--device", "cuda"])
    assert out.returncode == 2
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "--device cuda" in lines[0], out.stderr


def test_busy_port_is_one_line(llama_dir):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        out = _run(["serve", "--model", llama_dir, "--port", str(busy.getsockname()[1])])
    finally:
        busy.close()
    assert out.returncode == 2
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "cannot bind" in lines[0] and "in use" in lines[0].lower(), out.stderr


@pytest.mark.skipif(importlib.util.find_spec("chess") is None, reason="the demo needs the games extra")
def test_demo_takes_a_port_and_says_when_it_is_busy(llama_dir):
    """Issue 49 item 7: `demo` had no --port. The port reaches its server: a busy one makes the
    server say so (naming it), and the demo exits 2 without a traceback."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        out = _run(["demo", "--model", llama_dir, "--port", str(port)], timeout=120)
    finally:
        busy.close()
    assert out.returncode == 2, out.stderr
    assert f"cannot bind the client socket to tcp://127.0.0.1:{port}" in out.stderr, out.stderr
    assert "pick another --port" in out.stderr and "Traceback" not in out.stderr, out.stderr
    bad = _run(["demo", "--port", "70000"], timeout=60)
    assert bad.returncode == 2 and "'70000' is not a port" in bad.stderr, bad.stderr


@pytest.mark.parametrize("flag", ["--http-port", "--worker-port"])
def test_busy_http_or_worker_port_exits_at_once_with_one_line(llama_dir, flag):
    """Issue 49 item 1: the client socket was bound when these failed; its open sockets and the
    ZAP thread kept Context.term() (at exit) waiting forever, after two tracebacks."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        out = _run(["serve", "--model", llama_dir, "--port", "0", flag, str(busy.getsockname()[1])], timeout=60)
    finally:
        busy.close()
    assert out.returncode == 2
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "in use" in lines[0].lower(), out.stderr


@pytest.mark.parametrize(
    "secret, mode, expected",
    [
        ("0" * 64, 0o600, "the worker secret is weak"),
        (None, 0o644, "(mode 0644); whoever reads it can pose as a worker: run chmod 600"),
    ],
)
def test_weak_or_readable_secret_file_is_refused_in_one_line(llama_dir, tmp_path, secret, mode, expected):
    """Issue 49 item 14: an all-zero secret was accepted and a 0644 secret file only warned."""
    from radixserve.serve.auth import new_secret

    path = tmp_path / "worker.secret"
    path.write_text((secret or new_secret()) + "\n")
    path.chmod(mode)
    for cmd in (["serve", "--port", "0", "--worker-secret-file"], ["worker", "--router", "tcp://127.0.0.1:9", "--secret-file"]):
        out = _run(cmd + [str(path), "--model", llama_dir], timeout=60)
        assert out.returncode == 2, out.stderr[-3000:]
        lines = _error_lines(out.stderr)
        assert len(lines) == 1 and expected in lines[0], out.stderr[-3000:]


def _llama_gguf(path, head_count: int = 4, truncate: int | None = None):
    """A llama GGUF whose metadata gets as far as the config (one tensor; no tokenizer)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(head_count)
    w.add_vocab_size(512)
    w.add_tensor("token_embd.weight", np.zeros((512, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate is not None:
        os.truncate(path, truncate)  # head -c N
    return path


def _model_dir_with(llama_dir, tmp_path, config):
    path = tmp_path / "model"
    shutil.copytree(llama_dir, path)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("truncated.gguf", "not a readable GGUF file"),
        ("head_count_0.gguf", "llama.attention.head_count is 0"),
        ("empty_config", "unsupported architecture"),
        ("huge_context", "RoPE tables of a 1099511627776-token context"),
    ],
)
def test_bad_model_files_fail_serve_at_once_with_one_line(llama_dir, tmp_path, case, expected):
    """Issue 49 item 15: each of these hung serve in Context.term() after its error, or died in
    every worker with a traceback (a ZeroDivisionError, a 4 TiB RoPE table)."""
    config = json.loads((Path(llama_dir) / "config.json").read_text())
    model = {
        "truncated.gguf": lambda: _llama_gguf(tmp_path / case, truncate=2048),
        "head_count_0.gguf": lambda: _llama_gguf(tmp_path / case, head_count=0),
        "empty_config": lambda: _model_dir_with(llama_dir, tmp_path, {}),
        "huge_context": lambda: _model_dir_with(llama_dir, tmp_path, {**config, "max_position_embeddings": 2**40}),
    }[case]()
    env = dict(ENV, RADIXSERVE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run(CLI + ["serve", "--model", str(model), "--port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and expected in lines[0], out.stderr[-3000:]


def test_rope_tables_are_checked_against_the_memory_available(llama_dir, tmp_path, monkeypatch):
    from radixserve.model import checks
    from radixserve.model.loader import check_model

    model = _model_dir_with(llama_dir, tmp_path, {**json.loads((Path(llama_dir) / "config.json").read_text()), "max_position_embeddings": 2**20})
    monkeypatch.setattr(checks, "available_memory", lambda: 2**30)
    assert check_model(model)[1] == 2**20  # 16 dims x 2**20 positions: 256 MiB to build
    with pytest.raises(
        ModelLoadError,
        match=r"in each of 8 workers\) need 2\.0 GiB, more than the 1\.0 GiB .*"
        r"--max-model-len N",
    ):
        check_model(model, processes=8)
    monkeypatch.setattr(checks, "available_memory", lambda: 2**27)
    with pytest.raises(ModelLoadError, match=r"RoPE tables of a 1048576-token context need 0\.\d GiB"):
        check_model(model)
    assert check_model(model, max_model_len=2**16)[1] == 2**16  # what the error tells to do
    with pytest.raises(ModelLoadError, match="KV pages of 4194304 tokens need"):
        Engine(llama_dir, kv_cache_tokens=2**22)


def test_every_worker_dying_at_start_up_exits_nonzero_with_its_error(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = _run(["--log-level", "WARNING", "serve", "--model", str(broken), "--port", "0", "--workers", "2", "--worker-threads", "1"], timeout=150)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("radixserve: error: every local worker failed at start-up"), last
    assert "w0" in last or "w1" in last


def _serve_ready_line(proc: subprocess.Popen, timeout_s: float) -> tuple[list[str], str]:
    """Read ``serve``'s stdout (on a thread, into the returned list, which keeps growing) until its
    ``ready:`` line; that line. Fails if serve exits or takes longer than ``timeout_s``."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not any("ready:" in ln for ln in lines):
        assert proc.poll() is None and time.monotonic() < deadline, lines
        time.sleep(0.1)
    return lines, next(ln for ln in lines if "ready:" in ln)


def test_shadowing_cwd_ready_line_and_second_ctrl_c(llama_dir, tmp_path):
    """From a folder holding a broken `radixserve` package the workers still start (-P); serve
    prints a ready line; Ctrl-C twice stops it at once even with a long drain timeout."""
    shadow = tmp_path / "radixserve"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('shadowed by the working directory')\n")
    proc = subprocess.Popen(
        CLI
        + [
            "--log-level",
            "WARNING",
            "serve",
            "--model",
            llama_dir,
            "--port",
            "0",
            "--workers",
            "1",
            "--worker-threads",
            "1",
            "--drain-timeout",
            "120",
            "--heartbeat-timeout",
            "60",
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker_pid = None
    try:
        lines, ready = _serve_ready_line(proc, 120)
        assert "ready: 1/1 workers, ZMQ at tcp://127.0.0.1:" in ready
        address = lines[0].split("listening on ", 1)[1].split()[0]
        with Client(address, timeout=60) as c:
            assert c.generate([5, 6, 7], max_tokens=2, temperature=0.0).usage.completion_tokens == 2
        # Freeze the worker so the long call stays in flight whatever the speed of the kernels
        # (the heartbeat timeout above is longer than the test): the drain then has to wait.
        worker_pid = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)], text=True).split()[0])
        os.kill(worker_pid, signal.SIGSTOP)
        long = threading.Thread(target=_long_call, args=(address,), daemon=True)
        long.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)  # drains: would wait up to 120 s for the long call
        time.sleep(1.0)
        assert proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # the second one stops it now
        assert proc.wait(30) == 130
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if worker_pid is not None:
            try:
                os.kill(worker_pid, signal.SIGKILL)  # the frozen worker, if the supervisor left it
            except ProcessLookupError:
                pass


def _long_call(address: str) -> None:
    try:
        with Client(address, timeout=150) as c:
            c.generate([9] * 8, max_tokens=1000, temperature=0.0, ignore_eos=True)
    except Exception:
        pass


def test_serve_without_local_workers_is_ready_at_once(llama_dir, tmp_path):
    """`serve --workers 0` said "ready: 1/0 workers" when a remote worker joined, and nothing
    before: with no local worker to wait for it is ready at start, and says where workers join."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "--log-level", "WARNING", "serve", "--model", llama_dir, "--port", "0", "--workers", "0"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines, ready = _serve_ready_line(proc, 60)
        assert "ready: no local workers (remote ones join at tcp://127.0.0.1:" in ready and "/0 workers" not in ready
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_process_that_ran_an_engine_exits_without_leak_warnings(llama_dir):
    # The engine freezes the GC after the model loads. Objects still frozen at exit are never
    # freed, and nanobind extensions (triton: xgrammar pulls it in, and `import torch` imports
    # it) then print some 30 lines of "nanobind: leaked ..." as the process ends.
    out = _run(["--log-level", "WARNING", "generate", "--model", llama_dir, "hello", "--max-tokens", "2"])
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr, out.stderr[-3000:]


def test_the_gc_freeze_is_undone_at_exit():
    # the mechanism behind the test above, which needs no triton to fail: atexit runs handlers
    # last in, first out, so this report runs after the engine's own exit handler
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('at exit', gc.get_freeze_count()))\n"
        "from radixserve.engine.model_runner import _freeze_gc_once\n"
        "_freeze_gc_once()\n"
        "print('frozen', gc.get_freeze_count() > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["frozen True", "at exit 0"], out.stdout


# ---------------------------------------------------------------- issue 49 items 2 and 3: generate
def test_generate_refuses_an_empty_prompt_before_the_model_loads(tmp_path):
    out = _run(["generate", "--model", str(tmp_path / "nope"), ""])  # a missing model: it never loads
    assert out.returncode == 2
    assert _error_lines(out.stderr) == ["radixserve: error: prompt: is empty"], out.stderr


def test_generate_refuses_max_tokens_past_the_context_with_the_numbers(llama_dir):
    out = _run(["--log-level", "WARNING", "generate", "--model", llama_dir, "--raw", "--max-tokens", "100000", "hi"])
    assert out.returncode == 2 and out.stdout == "", out.stdout[-2000:]
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and "max_tokens: 100000 + " in lines[0], out.stderr
    assert "prompt tokens exceeds the model's context (1024 tokens)" in lines[0], lines


class _Writes:
    """A stdout that records each write."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def _generate(monkeypatch, capsys, llama_dir, *args) -> tuple[list[str], str]:
    """``radixserve generate`` in this process: (stdout's writes, stderr)."""
    from radixserve.cli import build_parser

    argv = ["generate", "--model", llama_dir, "--kv-cache-tokens", "2048", *args]
    args_ = build_parser().parse_args(argv)
    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    assert args_.func(args_) == 0
    return out.writes, capsys.readouterr().err


def test_generate_streams_the_text_as_it_comes(monkeypatch, capsys, llama_dir):
    """A long generation printed nothing until its end (234 s for 8,191 tokens); now its text is
    written as the tokens come, prompts in order, each followed by its stats line."""
    writes, err = _generate(monkeypatch, capsys, llama_dir, "--raw", "--max-tokens", "24", "hello", "world")
    text = "".join(writes)
    first, second = text.split("\n")[:2]
    pieces = [w for w in writes[: writes.index("\n")] if w]
    assert len(pieces) > 3 and "".join(pieces) == first  # the first answer came in pieces
    assert second and text == f"{first}\n{second}\n"
    assert err.count("generated, finish=") == 2


def test_generate_uses_the_chat_template_unless_raw(monkeypatch, capsys, llama_dir):
    """A plain prompt on an instruct model got no template and an empty answer; a model with a
    chat template now gets each prompt as a user message (as `ollama run` does); --raw opts out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    for flags, prompt in (([], chat), (["--chat"], chat), (["--raw"], "hi")):
        _, err = _generate(monkeypatch, capsys, llama_dir, *flags, "--max-tokens", "2", "hi")
        assert f"[{len(tok.encode(prompt))} prompt tokens," in err, (flags, err)
