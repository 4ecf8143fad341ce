"""Issue 13 items 1 and 6: the supervisor restarts dead local workers with backoff, and reports
a start-up failure with the worker's own error line."""

from __future__ import annotations

import io
import os
import time

from radixserve.serve import supervisor as S


def _wait_exit(w, timeout=20.0):
    deadline = time.monotonic() + timeout
    while w.proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.2)  # let the stderr pump read the last lines


def test_start_up_failure_is_fatal_with_the_error_line():
    sup = S.Supervisor(stderr=io.StringIO())
    w = sup.add(
        "w0",
        ["-c", "import sys; print('Traceback ...', file=sys.stderr); print('radixserve: error: --model /x: no such directory', file=sys.stderr); sys.exit(2)"],
        dict(os.environ),
    )
    _wait_exit(w)
    assert sup.tick() == ["w0"]
    assert w.failed_at_startup and w.restart_at is None
    assert sup.fatal and "no such directory" in sup.fatal
    assert sup.tick() == []  # reported once, never restarted


def test_registered_worker_that_dies_is_restarted_with_backoff():
    sup = S.Supervisor(stderr=io.StringIO())
    w = sup.add("w0", ["-c", "import time; time.sleep(0.3)"], dict(os.environ))
    first = w.proc.pid
    sup.on_registered("w0", first)
    _wait_exit(w)
    now = time.monotonic()
    assert sup.tick(now) == ["w0"] and w.restart_at == now + S.BACKOFF_FIRST_S
    assert w.proc.pid == first  # not before the delay
    sup.tick(now + S.BACKOFF_FIRST_S)
    assert w.proc.pid != first and w.restarts == 1 and sup.fatal is None
    sup.on_registered("w0", w.proc.pid)
    _wait_exit(w)
    now = time.monotonic()
    sup.tick(now)
    assert w.restart_at == now + 2 * S.BACKOFF_FIRST_S  # doubles
    sup.stop()


def test_a_restart_that_cannot_start_a_process_is_tried_again(monkeypatch):
    """Issue 49 item 8: Popen failing with EMFILE escaped tick() (and ended the router's ticker)."""
    sup = S.Supervisor(stderr=io.StringIO())
    w = sup.add("w0", ["-c", "pass"], dict(os.environ))
    first = w.proc.pid
    sup.on_registered("w0", first)
    _wait_exit(w)
    real = S.subprocess.Popen

    def out_of_fds(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(S.subprocess, "Popen", out_of_fds)
    now = time.monotonic()
    sup.tick(now)
    sup.tick(now + S.BACKOFF_FIRST_S)  # the restart is due: it fails, and is put off
    assert w.restarts == 0 and w.restart_at == now + 3 * S.BACKOFF_FIRST_S
    monkeypatch.setattr(S.subprocess, "Popen", real)
    sup.tick(now + 3 * S.BACKOFF_FIRST_S)
    assert w.restarts == 1 and w.restart_at is None and w.proc.pid != first
    sup.stop()


def test_default_threads_divide_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert S.default_threads(1) == cores and S.default_threads(cores * 4) == 1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_worker_exits_when_serve_died_while_its_model_loaded(llama_dir):
    """A local worker whose serve process is gone before the worker's engine exists still exits
    (it used to take the new parent, init, for serve and live on)."""
    import subprocess
    import sys

    import msgspec

    from radixserve.config import EngineConfig, WorkerConfig
    from radixserve.serve import auth

    cfg = WorkerConfig(
        engine=EngineConfig(model=llama_dir, attention="torch"),
        router="tcp://127.0.0.1:9",
        worker_id="w0",
        threads=1,
        exit_with_parent=True,
        heartbeat=0.2,
        router_timeout=5.0,
    )
    env = dict(os.environ, **{auth.ENV_SECRET: auth.new_secret()})
    # The "serve" process starts the worker (with its own pid in the config, as serve does) and
    # exits at once, long before the worker's model is loaded.
    starter = (
        "import os, subprocess, sys, msgspec\n"
        "from radixserve.config import WorkerConfig\n"
        "from radixserve.serve.launch import worker_command\n"
        f"cfg = msgspec.json.decode({msgspec.json.encode(cfg)!r}, type=WorkerConfig)\n"
        "cfg = msgspec.structs.replace(cfg, parent_pid=os.getpid())\n"
        "p = subprocess.Popen([sys.executable, '-P', *worker_command(cfg)], "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"
    )
    out = subprocess.run([sys.executable, "-c", starter], env=env, capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 120
    try:
        while not _gone(pid):
            assert time.monotonic() < deadline, "the orphaned worker is still running"
            time.sleep(0.2)
    finally:
        if not _gone(pid):
            os.kill(pid, 9)
