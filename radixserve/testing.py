"""Helpers for tests, benchmarks and examples: tiny random checkpoints, and a live server.

- :func:`make_tiny_model_dir` builds a tiny random checkpoint of each supported architecture
  (:data:`TINY_ARCHS`) in ordinary Hugging Face format, locally, with no download; the tests'
  fixtures and the transformers oracle load it like any real model.
- :func:`spawn_server` starts ``radixserve serve`` as a subprocess, reads its addresses from the
  lines it prints, waits until its workers are up, and hands back a :class:`ServerProcess` that
  stops it cleanly (also as a context manager).

Nothing here is used by the serving path itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from radixserve.model.builtin import build_tokenizer, dtype_kwargs, save_model_dir

__all__ = ["TINY_ARCHS", "ServerProcess", "make_tiny_model_dir", "spawn_server", "tiny_config"]

# --------------------------------------------------------------------------------------
# tiny models
# --------------------------------------------------------------------------------------

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

_TINY_BASE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def tiny_config(arch: str, **overrides):
    """Config of a tiny model of ``arch`` (see :data:`TINY_ARCHS`).

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128,
    vocab 512, 1024 positions, fp32. qwen2 keeps HF's q/k/v bias, qwen3 its q/k norm;
    mistral gets ``sliding_window=None`` unless overridden. ``overrides`` go straight
    to the config (``tie_word_embeddings``, ``rope_scaling``, ``rope_theta``, ``dtype``
    / ``torch_dtype`` ...).
    """
    import transformers

    arch = arch.lower()
    if arch not in _ARCH_CLASSES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_ARCHS}")
    cfg_name, model_name = _ARCH_CLASSES[arch]
    kw: dict[str, Any] = dict(_TINY_BASE)
    kw.update(bos_token_id=0, eos_token_id=1, pad_token_id=2, architectures=[model_name])
    if arch == "mistral":
        kw["sliding_window"] = None
    dtype = overrides.pop("dtype", None)
    dtype = overrides.pop("torch_dtype", dtype)
    if dtype is not None and not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    kw.update(dtype_kwargs(dtype or "float32"))
    kw.update(overrides)
    return getattr(transformers, cfg_name)(**kw)


def make_tiny_model_dir(path: str | os.PathLike, arch: str = "llama", *, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
    """Create a tiny random checkpoint of ``arch`` at ``path`` and return it.

    Weights are drawn in fp32 from ``seed``; a non-fp32 ``dtype`` override is applied
    when saving (tensors cast to it, config records it). With ``tokenizer=True`` a
    :func:`~radixserve.model.builtin.build_tokenizer` of the config's vocab size is saved alongside.
    """
    config = tiny_config(arch, **overrides)
    path = Path(path)
    tok = None
    if tokenizer:
        tok = build_tokenizer(config.vocab_size, model_max_length=config.max_position_embeddings)
        config.bos_token_id, config.eos_token_id, config.pad_token_id = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    return save_model_dir(path, config, seed=seed, tokenizer=tok)


# --------------------------------------------------------------------------------------
# a live server
# --------------------------------------------------------------------------------------

_LISTENING = "listening on "
_WORKERS_AT = "workers connect to "
_HTTP = "HTTP API on "


class ServerProcess:
    """A running ``radixserve serve`` subprocess (see :func:`spawn_server`).

    ``address``: the router's ZMQ address for the SDK (a wildcard host rewritten to 127.0.0.1);
    ``worker_address``: where remote workers connect; ``http_url``: the OpenAI API base
    (``http://HOST:PORT/v1``) when started with ``http=True``, else None; ``lines``: the stdout
    lines read so far. Only the lines needed for those are read: the rest of stdout is the
    caller's to read (``proc.stdout``).
    """

    def __init__(self, proc: subprocess.Popen, lines: list[str], http: bool):
        self.proc = proc
        self.lines = lines
        listening = next(ln for ln in lines if _LISTENING in ln)
        self.address = _loopback(listening.split(_LISTENING, 1)[1].split()[0])
        self.worker_address = listening.split(_WORKERS_AT, 1)[1].split(";")[0] if _WORKERS_AT in listening else ""
        self.http_url = next(ln for ln in lines if _HTTP in ln).split(_HTTP, 1)[1].split()[0] if http else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (serve drains and stops its workers), then SIGKILL to the whole process group
        after ``timeout`` seconds; returns the exit status."""
        return _stop(self.proc, timeout)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop(proc: subprocess.Popen, timeout: float) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
    return proc.returncode


def _loopback(address: str) -> str:
    return address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")


def spawn_server(
    model: str | os.PathLike | None = None,
    *args: str,
    workers: int = 1,
    port: int = 0,
    http: bool = False,
    env: Mapping[str, str] | None = None,
    log_level: str = "WARNING",
    ready_timeout: float = 120.0,
    wait_workers: bool = True,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """Start ``radixserve serve [--model MODEL] --workers N --port PORT [--http-port 0] ARGS...``.

    It runs as ``python -P -m radixserve.cli`` (the working directory cannot shadow the package)
    in a session of its own (a forced stop reaches its workers too), with ``env`` over this
    process's environment (``TOKENIZERS_PARALLELISM=false`` unless given). Returns once the router
    printed its address (and, with ``http=True``, the HTTP gateway its URL) and, with
    ``wait_workers``, once ``workers`` workers are live (asked over the SDK); the whole start
    is bounded by ``ready_timeout`` seconds. A server that exits or stays silent meanwhile is
    stopped and :class:`RuntimeError` says what it printed. ``preexec_fn`` runs in the child
    before serve starts (e.g. to set a resource limit, as ``prlimit`` does).
    """
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "radixserve.cli",
        "--log-level",
        log_level,
        "serve",
        *(["--model", str(model)] if model is not None else []),
        "--workers",
        str(workers),
        "--port",
        str(port),
        *(["--http-port", "0"] if http else []),
        *args,
    ]
    full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env, start_new_session=True, preexec_fn=preexec_fn)
    lines: list[str] = []
    done = threading.Event()

    def needed() -> bool:
        return any(_LISTENING in ln for ln in lines) and (not http or any(_HTTP in ln for ln in lines))

    def read() -> None:
        assert proc.stdout is not None
        try:
            while not needed():
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=read, name="spawn-server-stdout", daemon=True).start()
    if not done.wait(ready_timeout) or not needed():
        _stop(proc, 10.0)
        raise RuntimeError(f"radixserve serve did not start (exit {proc.returncode}): {''.join(lines)!r}")
    server = ServerProcess(proc, lines, http)
    if wait_workers and workers:
        from radixserve.client import Client

        try:
            with Client(server.address, timeout=10) as c:
                c.wait_ready(workers, timeout=max(1.0, ready_timeout - (time.monotonic() - t0)))
        except BaseException:
            server.stop()
            raise
    return server
