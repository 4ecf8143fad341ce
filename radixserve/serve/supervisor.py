"""Local worker processes of ``radixserve serve``: spawn, watch, restart with backoff.

A worker that exits after it had registered is restarted, after 0.5 s, then 1, 2, 4 ... up to
30 s between tries (the delay resets once a worker stayed up 60 s). A worker that exits before
it ever registered failed at start-up (a bad model path, a busy device, an import error): it is
not restarted, since it would fail the same way again; when every local worker failed at
start-up, :attr:`Supervisor.fatal` holds the last worker's error and serve exits non-zero.

Workers are spawned with ``python -P`` (3.11+; otherwise from a neutral working directory), so a
folder that happens to be named ``radixserve`` in the caller's working directory cannot shadow
the installed package. Their stderr is passed through to ours and its last lines are kept, so a
start-up failure can be reported in one line.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("radixserve.supervisor")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # up this long: the next failure starts the backoff from the beginning


def python_argv() -> list[str]:
    """The interpreter command for a worker: ``-P`` keeps the cwd off ``sys.path``."""
    return [sys.executable, "-P"] if sys.version_info >= (3, 11) else [sys.executable]


@dataclass(eq=False)
class LocalWorker:
    name: str
    cmd: list[str]
    env: dict[str, str]
    proc: Any = None
    registered: bool = False  # registered at least once since its last spawn
    ever_registered: bool = False
    started_at: float = 0.0
    restarts: int = 0
    failures_in_row: int = 0
    restart_at: float | None = None
    failed_at_startup: bool = False
    last_error: str = ""
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))


class Supervisor:
    def __init__(self, *, restart: bool = True, stderr=None):
        self.workers: dict[str, LocalWorker] = {}
        self.restart = restart
        self.fatal: str | None = None
        self._stderr = stderr if stderr is not None else sys.stderr
        self._cwd = None if sys.version_info >= (3, 11) else tempfile.gettempdir()

    # -- processes --------------------------------------------------------------------------
    def add(self, name: str, args: list[str], env: dict[str, str]) -> LocalWorker:
        w = LocalWorker(name=name, cmd=python_argv() + args, env=env)
        self.workers[name] = w
        self._spawn(w)
        return w

    def _spawn(self, w: LocalWorker) -> None:
        w.proc = subprocess.Popen(w.cmd, env=w.env, cwd=self._cwd, stderr=subprocess.PIPE, start_new_session=True)  # Ctrl-C reaches the router only
        w.proc.worker_name = w.name
        w.started_at = time.monotonic()
        w.registered = False
        w.restart_at = None
        threading.Thread(target=self._pump_stderr, args=(w, w.proc), daemon=True, name=f"stderr-{w.name}").start()

    def _pump_stderr(self, w: LocalWorker, proc) -> None:
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            w.tail.append(line.rstrip("\n"))
            try:
                self._stderr.write(line)
                self._stderr.flush()
            except (OSError, ValueError):
                pass
        proc.stderr.close()

    @property
    def procs(self) -> list[Any]:
        return [w.proc for w in self.workers.values() if w.proc is not None]

    def proc_of(self, name: str):
        w = self.workers.get(name)
        return w.proc if w is not None else None

    def on_registered(self, name: str, pid: int) -> None:
        w = self.workers.get(name)
        if w is not None and w.proc is not None and w.proc.pid == pid:
            w.registered = w.ever_registered = True

    # -- the watch ------------------------------------------------------------------------------
    def tick(self, now: float | None = None, *, shutting_down: bool = False) -> list[str]:
        """Restart what is due; returns the names of workers that exited since the last tick."""
        now = time.monotonic() if now is None else now
        exited = []
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is not None and w.restart_at is None and not w.failed_at_startup:
                exited.append(w.name)
                w.last_error = self.error_of(w)
                if not w.registered and not w.ever_registered:  # a restart that dies early is retried
                    w.failed_at_startup = True
                    log.error("worker %s exited with status %s before it registered: %s", w.name, w.proc.returncode, w.last_error)
                    continue
                if now - w.started_at >= STABLE_S:
                    w.failures_in_row = 0
                delay = self._backoff(w, now)
                log.warning("worker %s exited with status %s; restarting it in %.1f s", w.name, w.proc.returncode, delay)
            if w.restart_at is not None and now >= w.restart_at and not shutting_down and self.restart:
                try:
                    self._spawn(w)
                except OSError as exc:  # e.g. EMFILE (out of file descriptors): try again later
                    log.error("cannot restart worker %s: %s; trying again in %.1f s", w.name, exc, self._backoff(w, now))
                else:
                    w.restarts += 1
        if self.workers and all(w.failed_at_startup for w in self.workers.values()):
            last = max(self.workers.values(), key=lambda w: w.started_at)
            self.fatal = f"every local worker failed at start-up; {last.name}: {last.last_error}"
        return exited

    @staticmethod
    def _backoff(w: LocalWorker, now: float) -> float:
        """Schedule ``w``'s next start after the next backoff delay; returns the delay."""
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**w.failures_in_row)
        w.failures_in_row += 1
        w.restart_at = now + delay
        return delay

    @staticmethod
    def error_of(w: LocalWorker) -> str:
        """The most telling line of a worker's stderr: its 'error:' line, else the last line."""
        lines = [ln for ln in w.tail if ln.strip()]
        for ln in reversed(lines):
            if "error:" in ln.lower() or ln.split(":", 1)[0].endswith(("Error", "Exception")):
                return ln.strip()
        return lines[-1].strip() if lines else f"exit status {w.proc.returncode if w.proc else '?'}"

    def stop(self, timeout: float = 5.0) -> None:
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            if w.proc is None:
                continue
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def stats(self) -> dict[str, dict[str, Any]]:
        return {w.name: {"restarts": w.restarts, "failed_at_startup": w.failed_at_startup, "pid": w.proc.pid if w.proc else 0} for w in self.workers.values()}


def env_with_threads(env: dict[str, str], threads: int | None) -> dict[str, str]:
    out = dict(env, TOKENIZERS_PARALLELISM="false")
    if threads:
        out["OMP_NUM_THREADS"] = str(threads)
    return out


def default_threads(workers: int) -> int:
    """Torch threads per local worker: the cores divided among the workers (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, workers))
