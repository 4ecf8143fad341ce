"""llama.cpp as the peer of ``python -m bench peers --peer llamacpp --llama-server PATH``.

Both engines serve the same GGUF over HTTP, one after the other: llama.cpp's ``llama-server``
(started here from the binary you built; this installs nothing) and radixserve's HTTP gateway
(``radixserve serve --model FILE.gguf --http-port 0``, one worker). The workload driver of
:mod:`bench.peers` sends each request as token ids, greedy, ``ignore_eos``, one thread per
request in flight:

* llama-server: ``POST /completion`` with ``prompt`` (ids), ``n_predict``, ``cache_prompt: true``,
  ``return_tokens: true``, not streamed; its ``timings`` give the prompt tokens computed
  (``prompt_n``) and taken from its cache (``cache_n``);
* radixserve: ``POST /v1/completions`` with ``max_tokens`` and ``return_token_ids: true``,
  streamed; the usage event gives ``prompt_tokens_details.cached_tokens``.

llama-server is not streamed because its streams lose token ids: a token that ends inside a
UTF-8 character is never sent as an event of its own, and the final event carries no ids (on
SmolLM2 a fleet lost ids in its first turns), while the fleet must send each turn's exact output ids
back. Its TTFT is therefore the time to its answer less its own decode time (``predicted_ms``:
from the prompt's last batch, which samples the first token, to the last token); radixserve's
is the time to the first streamed token id. Both start when the request is sent.
llama-server gets ``-np`` = the workload's max running (its slots), ``-c`` = that many slots of the
longest sequence and ``-t`` = the threads, nothing else; radixserve the same max running, step
token budget, KV pool and threads as ``bench peers`` gives it in-process. The page faults and
system CPU seconds printed are those of the server processes (and their children) during the
timed part, read from /proc.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from radixserve.runtime import defaulted_env
from radixserve.testing import spawn_server

START_TIMEOUT = 600.0  # seconds a server may take to load (radixserve converts a GGUF on its first use)
LOG_TAIL = 20  # lines of a server's log shown when it does not start


class ServerStartError(RuntimeError):
    """A server that did not start: the message is one line, then the tail of its log."""


def check_binary(path: str | None) -> str | None:
    """What is wrong with ``--llama-server PATH``, or None."""
    if not path:
        return "--peer llamacpp needs --llama-server PATH (bench/README.md says how to build llama-server)"
    p = Path(path).expanduser()
    if not p.is_file():
        return f"--llama-server {path}: no such file (bench/README.md says how to build llama-server)"
    if not os.access(p, os.X_OK):
        return f"--llama-server {path}: not executable"
    return None


def requests_at_once(spec: dict) -> int:
    """The most requests a workload has in flight: every agent, or the whole GSP burst."""
    return spec["agents"] if spec["workload"] == "fleet" else spec["groups"] * spec["prompts"]


def llama_server_command(spec: dict, port: int) -> list[str]:
    """llama-server's flags: -np slots = max running, -c = that many of the longest sequence, -t threads."""
    slots = spec["max_running"]
    return [
        str(Path(spec["llama_server"]).expanduser()),
        "-m",
        spec["gguf"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * spec["max_model_len"]),
        "-t",
        str(spec["threads"]),
    ]


def radixserve_flags(spec: dict) -> list[str]:
    """``radixserve serve`` flags with the sizes ``bench peers`` gives the in-process engine; every
    request of the workload is let through to the engine (its scheduler sees them all, as in-process)."""
    return [
        "--dtype",
        spec["dtype"],
        "--max-running",
        str(spec["max_running"]),
        "--max-batched-tokens",
        str(spec["max_batched_tokens"]),
        "--kv-cache-tokens",
        str(spec["kv_tokens"]),
        "--worker-threads",
        str(spec["threads"]),
        "--max-inflight",
        str(requests_at_once(spec)),
        "--max-queue",
        "100000",
    ]


def process_usage(pid: int) -> tuple[int, float]:
    """Minor page faults and system CPU seconds so far of a process and its descendants (/proc)."""
    faults, ticks, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            faults, ticks = faults + int(fields[7]), ticks + int(fields[12])  # minflt (10th), stime (15th)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, IndexError, ValueError):
            continue
    return faults, ticks / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(resp) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, until ``[DONE]`` or its end; an error event raises."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("error:"):
            raise RuntimeError(f"the server streamed an error: {line[6:].strip()[:500]}")
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"the server streamed an error: {json.dumps(event['error'])[:500]}")
        yield event


def wait_healthy(host: str, port: int, proc: subprocess.Popen, timeout: float) -> str | None:
    """Poll ``GET /health`` until it answers 200; what happened instead, or None."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        conn = http.client.HTTPConnection(host, port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return None
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            return f"was not healthy after {timeout:.0f} s"
        time.sleep(0.25)
    return f"exited with status {proc.returncode}"


class HttpEngine:
    """An engine behind an HTTP server, driven as :func:`bench.peers.drive` drives one in-process:
    ``submit`` starts a request on a thread of its own, ``step`` waits for what the requests
    brought (a streamed token: ``(id, True, None)``; the end: ``(id, True, record)``). Subclasses
    start the server (setting ``host``, ``port``, ``pid``, ``command``) and say what to send
    (``body``) and how to read its answer or each streamed event (``read``)."""

    name = "server"
    path = "/"
    backend = "http"

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.events: queue.Queue = queue.Queue()
        self.host, self.port, self.pid = "127.0.0.1", 0, 0
        self.command: list[str] = []

    def body(self, ids: list[int], n: int) -> dict:
        raise NotImplementedError

    def read(self, event: dict, record: dict) -> list[int]:
        """The new token ids of one event (or answer); fills ``record["prompt"]`` / ``["cached"]``
        from the final one, and ``record["decode_s"]`` when the request is not streamed."""
        raise NotImplementedError

    def usage(self) -> tuple[int, float]:
        return process_usage(self.pid)

    def submit(self, rid: str, ids: list[int], n: int) -> None:
        threading.Thread(target=self._request, args=(rid, ids, n), name=f"request-{rid}", daemon=True).start()

    def _request(self, rid: str, ids: list[int], n: int) -> None:
        record: dict = {"tokens": [], "prompt": None, "cached": None}
        body = self.body(ids, n)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            sent = time.perf_counter()
            conn.request("POST", self.path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
            for event in sse_events(resp) if body["stream"] else [json.loads(resp.read())]:
                new = self.read(event, record)
                record["tokens"] += new
                if new and body["stream"]:
                    self.events.put((rid, True, None))
            if not body["stream"]:  # no token seen before the answer: the time to it less the server's decode time
                record["ttft_s"] = time.perf_counter() - sent - record.pop("decode_s")
            if record["prompt"] is None:
                raise RuntimeError("the stream ended without its usage / timings")
            if len(record["tokens"]) != n:
                raise RuntimeError(f"streamed {len(record['tokens'])} token ids, {n} were asked for")
            self.events.put((rid, True, record))
        except Exception as exc:  # (re-raised by step, on the driver's thread)
            self.events.put((rid, False, RuntimeError(f"{self.name}, request {rid}: {exc}")))
        finally:
            conn.close()

    def step(self):
        try:
            items = [self.events.get(timeout=self.timeout)]
        except queue.Empty:
            raise RuntimeError(f"{self.name}: nothing came back for {self.timeout:.0f} s") from None
        while not self.events.empty():
            items.append(self.events.get_nowait())
        for rid, has_token, final in items:
            if isinstance(final, Exception):
                raise final
            yield rid, has_token, final

    def close(self) -> None:
        raise NotImplementedError


class LlamaServer(HttpEngine):
    """llama-server on the GGUF, started here with :func:`llama_server_command`; its log goes to a
    temporary file, removed once it stopped (kept, and its tail shown, when it does not start)."""

    name = "llama-server"
    path = "/completion"
    backend = "llama-server"

    def __init__(self, spec: dict, timeout: float):
        super().__init__(timeout)
        self.port = free_port()
        self.command = llama_server_command(spec, self.port)
        print(f"llama-server: {shlex.join(self.command)}", file=sys.stderr, flush=True)
        fd, self.log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if k not in defaulted_env()}  # its own OpenMP defaults, not ours
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.pid = self.proc.pid
        problem = wait_healthy(self.host, self.port, self.proc, START_TIMEOUT)
        if problem:
            self.close(keep_log=True)
            tail = Path(self.log).read_text(errors="replace").splitlines()[-LOG_TAIL:]
            raise ServerStartError(f"llama-server did not start: it {problem}; the end of its log ({self.log}):\n" + "\n".join("  " + line for line in tail))

    def body(self, ids: list[int], n: int) -> dict:
        return {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": True, "stream": False, "return_tokens": True}

    def read(self, event: dict, record: dict) -> list[int]:
        t = event["timings"]
        record["prompt"], record["cached"] = int(t["cache_n"]) + int(t["prompt_n"]), int(t["cache_n"])
        record["decode_s"] = float(t["predicted_ms"]) / 1e3
        return list(event["tokens"])

    def close(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not keep_log:
            Path(self.log).unlink(missing_ok=True)


class RadixGateway(HttpEngine):
    """``radixserve serve`` on the GGUF with its HTTP gateway (one worker, :func:`radixserve_flags`)."""

    name = "radixserve"
    path = "/v1/completions"
    backend = "http gateway"

    def __init__(self, spec: dict, timeout: float):
        super().__init__(timeout)
        flags = radixserve_flags(spec)
        self.command = ["radixserve", "serve", "--model", spec["gguf"], "--workers", "1", "--http-port", "0", *flags]
        print(f"radixserve: {shlex.join(self.command)}", file=sys.stderr, flush=True)
        try:
            self.server = spawn_server(spec["gguf"], *flags, http=True, env={"OMP_NUM_THREADS": str(spec["threads"])}, ready_timeout=START_TIMEOUT)
        except RuntimeError as exc:
            raise ServerStartError(f"radixserve serve did not start (its log is above): {exc}") from None
        url = self.server.http_url.split("//", 1)[1].split("/", 1)[0]
        self.host, self.port, self.pid = url.rsplit(":", 1)[0], int(url.rsplit(":", 1)[1]), self.server.pid

    def body(self, ids: list[int], n: int) -> dict:
        return {
            "prompt": ids,
            "max_tokens": n,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    def read(self, event: dict, record: dict) -> list[int]:
        if event.get("usage"):
            u = event["usage"]
            record["prompt"], record["cached"] = u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
        return [t for c in event.get("choices") or [] for t in c.get("token_ids") or []]

    def close(self) -> None:
        self.server.stop()


def start(engine: str, spec: dict, timeout: float) -> HttpEngine:
    return (LlamaServer if engine == "llamacpp" else RadixGateway)(spec, timeout)


def version(path: str) -> str:
    """The first line ``llama-server --version`` prints (e.g. ``version: 1 (unknown)``), or ``?``."""
    try:
        proc = subprocess.run([str(Path(path).expanduser()), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0].strip() if lines else "?"
