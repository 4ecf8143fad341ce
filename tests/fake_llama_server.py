"""A stand-in for llama.cpp's llama-server (and radixserve's gateway) in the bench tests: the
subset of HTTP that ``bench peers --peer llamacpp`` uses, with canned answers.

``python fake_llama_server.py --port P [any llama-server flags]`` serves ``GET /health``,
``POST /completion`` (llama-server's token-id completion, not streamed: ``tokens``,
``timings.cache_n`` / ``prompt_n`` / ``predicted_ms``) and ``POST /v1/completions`` (radixserve's gateway, streamed,
ids only with ``return_token_ids``; likewise llama-server's with ``return_tokens``). The output ids depend on the prompt only, so every engine it plays gives
the same tokens; the cached count is the longest prefix shared with an earlier prompt + output
(at most the prompt minus one), as an ideal cache would give. ``--version`` prints a version line.
With ``FAKE_LLAMA_LOG`` set, it appends one JSON line with its argv, then one per completion.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SEEN: list[list[int]] = []
LOCK = threading.Lock()


def log(record: dict) -> None:
    path = os.environ.get("FAKE_LLAMA_LOG")
    if path:
        with LOCK, open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def complete(prompt: list[int], n: int) -> tuple[list[int], int]:
    """The output ids and the cached prompt tokens of one request."""
    out = [7 + (sum(prompt) + i) % 50 for i in range(n)]
    with LOCK:
        cached = max((_common(prompt, s) for s in SEEN), default=0)
        SEEN.append(prompt + out)
    return out, min(cached, len(prompt) - 1)


def _common(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path not in ("/completion", "/v1/completions") or not isinstance(body.get("prompt"), list):
            self._answer(404, {"error": {"message": f"no {self.path} with that body"}})
            return
        llama = self.path == "/completion"
        n = body["n_predict"] if llama else body["max_tokens"]
        out, cached = complete(body["prompt"], n)
        log({"path": self.path, "body": body, "out": out, "cached": cached})
        prompt = len(body["prompt"])
        if llama:  # (bench peers does not stream llama-server)
            time.sleep(0.002 * n)
            self._answer(
                200,
                {
                    "content": "x" * n,
                    "tokens": out if body.get("return_tokens") else [],
                    "stop": True,
                    "tokens_predicted": n,
                    "timings": {"cache_n": cached, "prompt_n": prompt - cached, "predicted_n": n, "predicted_ms": 2.0 * (n - 1)},
                },
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for t in out:
            time.sleep(0.002)
            ids = {"token_ids": [t]} if body.get("return_token_ids") else {}
            self._event({"choices": [{"index": 0, "text": "x", "finish_reason": None, **ids}]})
        self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        self._event({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n, "prompt_tokens_details": {"cached_tokens": cached}}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()

    def _answer(self, status: int, data: dict) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def main(argv: list[str]) -> None:
    if "--version" in argv:
        print("version: 0 (fake)", file=sys.stderr)
        return
    log({"argv": argv})
    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
