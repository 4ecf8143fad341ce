"""OpenAI-compatible HTTP gateway in front of the router (``radixserve serve --http-port 8000``).

Starlette app served by uvicorn (on uvloop when installed) on its own thread and event loop in the
router's process, so HTTP parsing never delays the router's message handling. It forwards every
request to the router over the same ZMQ protocol as the SDK (one shared
:class:`~radixserve.client.AsyncClient`).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``:
server-sent events ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` and ``GET /metrics`` (Prometheus text of the router's stats plus the gateway's
own request counters).

Decisions (see the README's "HTTP API" section):

- Unknown top-level fields are ignored, like vLLM (the OpenAI API itself rejects them; tools that
  speak to many providers send extras) — each ignored name is logged once and listed in the
  ``X-Radixserve-Ignored-Fields`` response header. Known OpenAI fields this server cannot honour
  (``logit_bias``, ``tools``, ``suffix``, ``echo``, ``best_of > n``, ...) are refused with 400
  naming the field rather than silently dropped.
- Structured output: chat's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` (both endpoints) become
  ``SamplingParams.structured`` (xgrammar token masks in the worker's sampler).
- Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad field
  (the prompt longer than the context: 400 ``context_length_exceeded``, as OpenAI does), 401
  missing/wrong key, 404 unknown model or route, 405, 413 body over ``max_body_bytes``, 503 with
  ``Retry-After`` when the fleet is overloaded, shutting down or has no live worker, 500 else.
- Tenants: each API key maps to a tenant; a tenant's requests carry the namespace
  ``HMAC-SHA256(server secret, tenant)`` so tenants never share cached prefixes (no TTFT probing
  of another tenant's prompts). The secret is random per process unless
  ``RADIXSERVE_TENANT_SECRET`` is set (set it to keep namespaces stable across restarts or
  gateway replicas). The client cannot choose its namespace (``user`` is accepted and ignored).
  Without configured keys every request is the default tenant (namespace ``None``, the SDK's).
- ``n > 1`` runs n requests; with a ``seed``, choice i uses ``seed + i`` (reproducible, yet the
  choices differ). Usage counts each prompt once (``cached_tokens``: the smallest over its choices).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from radixserve import protocol as P
from radixserve.errors import (BadRequestError, OverloadedError, RadixServeError, RequestTimeoutError,
                               ShuttingDownError, TooLongError, WorkerLostError)
from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve.http")

DEFAULT_TENANT = "default"
MAX_CHOICES = 64  # prompts x n per request


# ------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    text = f"{param}: {message}" if param else message
    return APIError(400, text, param=param, code=code)


def api_error_from(exc: BaseException, prompt_param: str = "prompt") -> APIError:
    """Map an SDK / router error to the HTTP error a client of OpenAI expects."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TooLongError):
        return APIError(400, exc.message, param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, BadRequestError):
        param = getattr(exc, "field", None) or None
        if param in ("prompt", "token_ids"):
            param = prompt_param
        return APIError(400, exc.message, param=param, code=None)
    if isinstance(exc, OverloadedError):
        return APIError(503, exc.message, type="server_error", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, ShuttingDownError):
        return APIError(503, exc.message, type="server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(exc, WorkerLostError):
        return APIError(503, exc.message, type="server_error", code="worker_lost", headers={"Retry-After": "1"})
    if isinstance(exc, RequestTimeoutError):
        return APIError(503, f"the router did not answer: {exc.message}", type="server_error",
                        code="router_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, RadixServeError):
        return APIError(500, exc.message, type="server_error", code=getattr(exc, "code", "internal") or "internal")
    log.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


# ------------------------------------------------------------------------------------ tenants
def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def tenant_for_key(key: str) -> str:
    """Tenant id of a key given without one (``--api-key``): derived from the key, not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def load_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """Keys file: a JSON object ``{"KEY": "TENANT", ...}``, or lines ``KEY [TENANT]`` (``#``
    comments; a key without a tenant is its own tenant)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: a JSON keys file maps key strings to tenant strings")
        return {k: v for k, v in data.items() if k}
    keys: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{path}: expected 'KEY [TENANT]' per line, got {len(parts)} fields")
        keys[parts[0]] = parts[1] if len(parts) == 2 else tenant_for_key(parts[0])
    return keys


class Tenants:
    """API keys -> tenants -> cache namespaces (salts derived on the server)."""

    def __init__(self, keys: dict[str, str] | None = None, secret: bytes | None = None):
        self._by_digest = {_key_digest(k): t for k, t in (keys or {}).items()}
        env = os.environ.get("RADIXSERVE_TENANT_SECRET")
        self._secret = secret or (env.encode() if env else os.urandom(32))
        self._ns: dict[str, str | None] = {}

    @property
    def auth_required(self) -> bool:
        return bool(self._by_digest)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; raises 401."""
        if not self._by_digest:
            return DEFAULT_TENANT
        if not authorization:
            raise APIError(401, "You didn't provide an API key. Send 'Authorization: Bearer YOUR_KEY'.",
                           code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = authorization.strip().partition(" ")
        tenant = self._by_digest.get(_key_digest(key.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:  # lookup by digest: no timing signal about the stored keys
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def namespace(self, tenant: str) -> str | None:
        if tenant == DEFAULT_TENANT and not self._by_digest:
            return None
        ns = self._ns.get(tenant)
        if ns is None:
            ns = "t-" + hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            self._ns[tenant] = ns
        return ns


# ------------------------------------------------------------------------------------ config
@dataclass
class GatewayConfig:
    router: str  # the router's ZMQ address
    model_names: list[str] = field(default_factory=lambda: ["radixserve"])
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 2**20
    max_n: int = 16
    limits: P.Limits = field(default_factory=P.Limits)


# ------------------------------------------------------------------------------------ params
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream",
           "stream_options", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "user", "ignore_eos", "stop_token_ids", "logit_bias", "best_of",
           "guided_json", "guided_regex", "guided_choice"}
_COMPLETION_FIELDS = _COMMON | {"prompt", "suffix", "echo"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "functions", "function_call", "parallel_tool_calls", "response_format",
                          "metadata", "store", "service_tier", "modalities", "reasoning_effort"}


def _sampling(body: dict, chat: bool, limits: P.Limits) -> tuple[dict, int]:
    """SamplingParams keyword arguments and ``n`` from an OpenAI request body (400 on bad fields)."""
    kw: dict[str, Any] = {}
    get = body.get

    def opt_int(name, lo=None, hi=None):
        v = get(name)
        if v is None:
            return None
        if not _is_int(v):
            raise bad(name, f"must be an integer, got {type(v).__name__}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(name, f"must be in [{lo}, {hi}], got {v}" if hi is not None else f"must be >= {lo}, got {v}")
        return v

    def opt_num(name, lo=None, hi=None, lo_open=False):
        v = get(name)
        if v is None:
            return None
        if not _is_num(v):
            raise bad(name, f"must be a number, got {type(v).__name__}")
        if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
            rng = (f"{'>' if lo_open else '>='} {lo}" if hi is None
                   else f"in {'(' if lo_open else '['}{lo}, {hi}]")
            raise bad(name, f"must be {rng}, got {v}")
        return float(v)

    max_tokens = opt_int("max_completion_tokens", 1, limits.max_tokens) if chat else None
    if max_tokens is None:
        max_tokens = opt_int("max_tokens", 1, limits.max_tokens)
    # OpenAI: completions default to 16 tokens; chat to "as many as fit" (the engine stops at the context).
    kw["max_tokens"] = max_tokens if max_tokens is not None else (limits.max_tokens if chat else 16)
    for name, lo, hi, lo_open in (("temperature", 0.0, None, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                                  ("frequency_penalty", -2.0, 2.0, False), ("repetition_penalty", 0.0, None, True)):
        v = opt_num(name, lo, hi, lo_open)
        if v is not None:
            kw[name] = v
    top_k = opt_int("top_k")
    if top_k is not None:
        if top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (disabled) or >= 1, got {top_k}")
        kw["top_k"] = -1 if top_k == 0 else top_k
    seed = opt_int("seed")
    if seed is not None:
        kw["seed"] = seed
    stop = get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "must be a string or a list of strings")
        if len(stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in stop):
            raise bad("stop", f"at most {limits.max_stop} strings of at most {limits.max_stop_chars} characters")
        stop = [s for s in stop if s]
        if stop:
            kw["stop"] = stop
    ids = get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        kw["stop_token_ids"] = ids
    ignore_eos = get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad("ignore_eos", "must be a boolean")
        kw["ignore_eos"] = ignore_eos
    # logprobs: chat has logprobs: bool + top_logprobs: 0..20; completions logprobs: 0..5 (we allow 20)
    if chat:
        lp = get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad("logprobs", "must be a boolean")
        top = opt_int("top_logprobs", 0, SamplingParams.MAX_LOGPROBS)
        if top is not None and not lp:
            raise bad("top_logprobs", "requires logprobs: true")
        if lp:
            kw["logprobs"] = top or 0
    else:
        lp = opt_int("logprobs", 0, SamplingParams.MAX_LOGPROBS)
        if lp is not None:
            kw["logprobs"] = lp
    n = opt_int("n", 1, None)
    n = 1 if n is None else n
    best_of = opt_int("best_of", 1, None)
    if best_of is not None and best_of != n:
        raise bad("best_of", "is not supported (only best_of == n)")
    logit_bias = get("logit_bias")
    if logit_bias:
        raise bad("logit_bias", "is not supported by this server")
    user = get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "must be a string")
    structured = _structured(body, chat)
    if structured is not None:
        kw["structured"] = structured
    try:
        params = SamplingParams(**kw)
        params.validate(vocab_size=1 << 31)
    except BadRequestError as exc:
        raise bad(exc.field, exc.message.split(": ", 1)[-1]) from None
    return kw, n


def _structured(body: dict, chat: bool):
    """Structured output from OpenAI's ``response_format`` (chat: ``json_object``, ``json_schema``)
    or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` (both endpoints)."""
    from radixserve.engine.structured import StructuredOutput

    found = []
    rf = body.get("response_format") if chat else None
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", StructuredOutput(json_object=True)))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format", "json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
            found.append(("response_format", StructuredOutput(json_schema=schema)))
        elif kind != "text":
            raise bad("response_format", "type must be text, json_object or json_schema")
    gj, gr, gc = body.get("guided_json"), body.get("guided_regex"), body.get("guided_choice")
    if gj is not None:
        if not isinstance(gj, (dict, str)):
            raise bad("guided_json", "must be a JSON schema (an object or its JSON text)")
        found.append(("guided_json", StructuredOutput(json_schema=gj)))
    if gr is not None:
        if not isinstance(gr, str):
            raise bad("guided_regex", "must be a string")
        found.append(("guided_regex", StructuredOutput(regex=gr)))
    if gc is not None:
        if not isinstance(gc, list) or not all(isinstance(c, str) for c in gc):
            raise bad("guided_choice", "must be a list of strings")
        found.append(("guided_choice", StructuredOutput(choice=gc)))
    if len(found) > 1:
        raise bad(found[1][0], "give only one of response_format, guided_json, guided_regex, guided_choice")
    return found[0][1] if found else None


def _unsupported(body: dict, chat: bool) -> None:
    """Known OpenAI features this server cannot honour: refuse rather than ignore."""
    if chat:
        if body.get("tools"):
            raise bad("tools", "tool calling is not supported by this server")
        if body.get("functions"):
            raise bad("functions", "function calling is not supported by this server")
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise bad("tool_choice", "tool calling is not supported by this server")
        if body.get("function_call") not in (None, "none", "auto"):
            raise bad("function_call", "function calling is not supported by this server")
        mod = body.get("modalities")
        if mod is not None and mod != ["text"]:
            raise bad("modalities", "only [\"text\"] is supported")
    else:
        if body.get("suffix"):
            raise bad("suffix", "is not supported by this server")
        if body.get("echo"):
            raise bad("echo", "is not supported by this server")




# ------------------------------------------------------------------------------------ gateway
class Gateway:
    """The Starlette app and its state (router client, tokenizer, tenants, counters)."""

    def __init__(self, config: GatewayConfig, tokenizer=None, tenants: Tenants | None = None, client=None):
        self.config = config
        self.tokenizer = tokenizer
        self.tenants = tenants or Tenants()
        self.client = client  # AsyncClient, created on the serving loop when None
        self.created = int(time.time())
        self.counters: dict[tuple[str, int], int] = {}
        self.inflight = 0
        self._warned: set[str] = set()
        self._max_model_len: int | None = None
        self._tok_lock = threading.Lock()
        self.app = self._build_app()

    # -- app ---------------------------------------------------------------------------------------
    def _build_app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

        async def on_http(request, exc: HTTPException):
            msg = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
            return self._error(APIError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}
                                        .get(exc.status_code)), route="other")

        async def on_any(request, exc: Exception):
            return self._error(api_error_from(exc), route="other")

        return Starlette(routes=routes, exception_handlers={HTTPException: on_http, Exception: on_any})

    def _count(self, route: str, status: int) -> None:
        self.counters[(route, status)] = self.counters.get((route, status), 0) + 1

    def _json(self, data, status: int = 200, headers: dict | None = None, route: str = "other"):
        from starlette.responses import Response

        self._count(route, status)
        return Response(msgspec.json.encode(data), status_code=status, headers=headers,
                        media_type="application/json")

    def _error(self, err: APIError, route: str = "other", headers: dict | None = None):
        return self._json(err.body(), err.status, {**(headers or {}), **err.headers}, route)

    # -- request plumbing ---------------------------------------------------------------------------
    async def _read_json(self, request) -> dict:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise bad(None, "invalid Content-Length")
            if int(length) > limit:
                raise APIError(413, f"request body is {length} bytes; the limit is {limit}",
                               code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw:
            raise bad(None, "the request body is empty; send a JSON object")
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise bad(None, f"the request body is not valid JSON ({exc})") from None
        except RecursionError:
            raise bad(None, "the request body nests too deeply") from None
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict) -> str:
        model = body.get("model")
        names = self.config.model_names
        if model is None:
            return names[0]
        if not isinstance(model, str):
            raise bad("model", "must be a string")
        if model not in names:
            raise APIError(404, f"The model '{model}' does not exist; this server serves {names[0]!r}",
                           param="model", code="model_not_found")
        return model

    def _ignored(self, body: dict, known: set[str]) -> list[str]:
        extra = sorted(k for k in body if k not in known)
        for k in extra:
            if k not in self._warned and len(self._warned) < 1000:
                self._warned.add(k)
                log.warning("ignoring unknown request field %r", k)
        return extra

    async def _with_disconnect(self, request, coro):
        """Run ``coro``; cancel it (aborting its router requests) if the client goes away."""
        task = asyncio.ensure_future(coro)

        async def gone():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                # Wait for the cancellation to land: reading the result of a task that is still
                # cancelling raised InvalidStateError (a logged 500 for a client that left).
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise APIError(499, "client closed the request", code="client_closed")
        return task.result()

    async def _ensure_client(self):
        if self.client is None:
            from radixserve.client import AsyncClient

            self.client = AsyncClient(self.config.router, timeout=None,
                                      max_frame_bytes=self.config.limits.max_frame_bytes)
        return self.client

    # -- prompts -----------------------------------------------------------------------------------
    def _prompts(self, body: dict) -> list[str | list[int]]:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("prompt", "is required")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p)) for p in prompt):
            prompts = list(prompt)
        else:
            raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of lists of token ids")
        for p in prompts:
            if not p:
                raise bad("prompt", "is empty")
        return prompts

    def _render_chat(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "must be a non-empty list of messages")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", "must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise bad(f"messages[{i}].role", f"must be system, developer, user, assistant or tool, got {role!r}")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad(f"messages[{i}].content", "only text content parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            elif content is None and role == "assistant":
                content = ""
            elif not isinstance(content, str):
                raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
            rendered.append({"role": "system" if role == "developer" else role, "content": content})
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad("messages", "this model has no chat template; use /v1/completions")
        total = sum(len(m["content"]) for m in rendered)
        if total > self.config.limits.max_prompt_chars:
            raise bad("messages", f"have {total} characters; the limit is {self.config.limits.max_prompt_chars}")
        with self._tok_lock:  # a HF fast tokenizer must not be used from two threads at once
            try:
                text = tok.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # template errors (e.g. roles must alternate) are the caller's
                raise bad("messages", f"the chat template refused them: {exc}") from None
            # Templates that write BOS themselves must not get a second one from the tokenizer.
            bos = getattr(tok, "bos_token", None)
            add_special = not (bos and text.startswith(bos))
            ids = tok(text, add_special_tokens=add_special)["input_ids"]
        if len(ids) > self.config.limits.max_prompt_tokens:
            raise APIError(400, f"messages: {len(ids)} tokens; the limit is {self.config.limits.max_prompt_tokens}",
                           param="messages", code="context_length_exceeded")
        return ids

    # -- running requests --------------------------------------------------------------------------
    def _jobs(self, prompts: list, kw: dict, n: int) -> list[tuple[int, Any, dict]]:
        jobs = []
        for pi, prompt in enumerate(prompts):
            for i in range(n):
                sp = dict(kw)
                if n > 1 and "seed" in sp:
                    sp["seed"] = sp["seed"] + i
                jobs.append((pi * n + i, prompt, sp))
        return jobs

    async def _run_all(self, jobs, namespace) -> list:
        client = await self._ensure_client()
        tasks = [asyncio.ensure_future(client.generate(p, namespace=namespace, timeout=None, **sp))
                 for _, p, sp in jobs]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()

    @staticmethod
    def _usage(outs: list, n: int) -> dict:
        prompt = cached = completion = 0
        for start in range(0, len(outs), n):
            group = outs[start:start + n]
            prompt += group[0].usage.prompt_tokens
            cached += min(o.usage.cached_tokens for o in group)
            completion += sum(o.usage.completion_tokens for o in group)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _logprobs(self, lps, chat: bool):
        """OpenAI logprobs object from the protocol's per-token (token_id, logprob, top) triples."""
        if not lps:
            return None
        tok = self.tokenizer

        def text(t):
            return tok.decode([t]) if tok is not None else str(t)

        lps = [(lp.token_id, lp.logprob, lp.top) if hasattr(lp, "token_id") else tuple(lp) for lp in lps]

        if chat:
            return {"content": [{"token": text(lp[0]), "logprob": lp[1], "bytes": list(text(lp[0]).encode()),
                                 "top_logprobs": [{"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                                                  for a, b in lp[2]]} for lp in lps], "refusal": None}
        return {"tokens": [text(lp[0]) for lp in lps], "token_logprobs": [lp[1] for lp in lps],
                "top_logprobs": [{text(a): b for a, b in lp[2]} for lp in lps], "text_offset": None}

    async def _prepare(self, request, chat: bool):
        route = "chat" if chat else "completions"
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        body = await self._read_json(request)
        model = self._check_model(body)
        ignored = self._ignored(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS)
        _unsupported(body, chat)
        kw, n = _sampling(body, chat, self.config.limits)
        if n > self.config.max_n:
            raise bad("n", f"must be at most {self.config.max_n}, got {n}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "must be a boolean")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
            raise bad("stream_options", "must be an object like {\"include_usage\": true}")
        include_usage = bool(opts and opts.get("include_usage"))
        if chat:
            ids = await asyncio.to_thread(self._render_chat, body.get("messages"))
            prompts = [ids]
        else:
            prompts = self._prompts(body)
        if len(prompts) * n > MAX_CHOICES:
            raise bad("n", f"prompts x n must be at most {MAX_CHOICES}")
        headers = {"X-Radixserve-Ignored-Fields": ",".join(ignored)[:1000]} if ignored else {}
        return route, model, self._jobs(prompts, kw, n), n, stream, include_usage, self.tenants.namespace(tenant), headers

    async def _handle(self, request, chat: bool):
        route = "chat" if chat else "completions"
        prompt_param = "messages" if chat else "prompt"
        self.inflight += 1
        streaming = False
        try:
            try:
                route, model, jobs, n, stream, include_usage, ns, headers = await self._prepare(request, chat)
                if stream:
                    response = await self._stream(request, route, model, jobs, n, include_usage, ns, headers, chat)
                    streaming = True  # the stream's generator ends the in-flight count
                    return response
                outs = await self._with_disconnect(request, self._run_all(jobs, ns))
            except Exception as exc:
                return self._error(api_error_from(exc, prompt_param), route)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            choices = []
            for (index, _, _), out in zip(jobs, outs):
                lps = self._logprobs(getattr(out, "logprobs", None), chat)
                if chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": out.text,
                                                                "refusal": None},
                                    "logprobs": lps, "finish_reason": out.finish_reason})
                else:
                    choices.append({"index": index, "text": out.text, "logprobs": lps,
                                    "finish_reason": out.finish_reason})
            data = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": model, "choices": choices, "usage": self._usage(outs, n), "system_fingerprint": None}
            return self._json(data, headers=headers, route=route)
        finally:
            if not streaming:
                self.inflight -= 1

    async def _stream(self, request, route, model, jobs, n, include_usage, ns, headers, chat):
        from starlette.responses import StreamingResponse

        client = await self._ensure_client()
        queue: asyncio.Queue = asyncio.Queue()

        async def one(index, prompt, sp):
            try:
                async for item in client.stream(prompt, namespace=ns, timeout=None, **sp):
                    queue.put_nowait((index, item, None))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                queue.put_nowait((index, None, exc))

        tasks = [asyncio.ensure_future(one(i, p, sp)) for i, p, sp in jobs]
        try:  # an error before the first token gets a real HTTP status
            first = await self._with_disconnect(request, queue.get())
            if first[2] is not None:
                raise first[2]
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        from radixserve.client import Completion

        def event(choices, usage=None) -> bytes:
            data = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                    "system_fingerprint": None}
            if usage is not None:
                data["usage"] = usage
            return b"data: " + msgspec.json.encode(data) + b"\n\n"

        async def gen():
            finals: dict[int, Any] = {}
            try:
                if chat:
                    for i, _, _ in jobs:
                        yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                item = first
                while True:
                    index, msg, exc = item
                    if exc is not None:
                        err = api_error_from(exc, "messages" if chat else "prompt")
                        yield b"data: " + msgspec.json.encode(err.body()) + b"\n\n"
                        break
                    if isinstance(msg, Completion):
                        finals[index] = msg
                        choice = {"index": index, "logprobs": None, "finish_reason": msg.finish_reason}
                        choice.update({"delta": {}} if chat else {"text": ""})
                        yield event([choice])
                        if len(finals) == len(jobs):
                            if include_usage:
                                outs = [finals[i] for i, _, _ in jobs]
                                yield event([], self._usage(outs, n))
                            break
                    elif msg.text or getattr(msg, "logprobs", None):
                        lps = self._logprobs(getattr(msg, "logprobs", None), chat)
                        choice = {"index": index, "logprobs": lps, "finish_reason": None}
                        choice.update({"delta": {"content": msg.text}} if chat else {"text": msg.text})
                        yield event([choice])
                    item = await queue.get()
                yield b"data: [DONE]\n\n"
            finally:
                self.inflight -= 1
                for t in tasks:
                    if not t.done():
                        t.cancel()

        self._count(route, 200)
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    # -- endpoints ---------------------------------------------------------------------------------
    async def completions(self, request):
        return await self._handle(request, chat=False)

    async def chat_completions(self, request):
        return await self._handle(request, chat=True)

    async def _model_len(self) -> int | None:
        if self._max_model_len is None:
            try:
                client = await self._ensure_client()
                stats = await client.stats(timeout=2.0)
                lens = [w.get("max_model_len", 0) for w in stats.get("workers", {}).values() if w.get("alive")]
                lens = [x for x in lens if x]
                self._max_model_len = min(lens) if lens else None
            except RadixServeError:
                return None
        return self._max_model_len

    def _model_card(self, name: str, max_len: int | None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "radixserve",
                "max_model_len": max_len}

    async def models(self, request):
        try:
            self.tenants.authenticate(request.headers.get("authorization"))
        except APIError as err:
            return self._error(err, "models")
        max_len = await self._model_len()
        return self._json({"object": "list", "data": [self._model_card(self.config.model_names[0], max_len)]},
                          route="models")

    async def model(self, request):
        try:
            self.tenants.authenticate(request.headers.get("authorization"))
            name = request.path_params["model"]
            if name not in self.config.model_names:
                raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        except APIError as err:
            return self._error(err, "models")
        return self._json(self._model_card(name, await self._model_len()), route="models")

    async def health(self, request):
        try:
            client = await self._ensure_client()
            h = await client.health(timeout=2.0)
        except RadixServeError as exc:
            return self._json({"status": "unavailable", "error": exc.message}, 503, {"Retry-After": "5"}, "health")
        ok = h["status"] == "ok"
        return self._json(h, 200 if ok else 503, None if ok else {"Retry-After": "5"}, "health")

    async def metrics(self, request):
        from starlette.responses import Response

        from radixserve.serve.metrics import prometheus_text

        try:
            client = await self._ensure_client()
            stats = await client.stats(timeout=5.0)
        except RadixServeError as exc:
            return self._error(api_error_from(exc), "metrics")
        text = prometheus_text(stats) + self._own_metrics()
        self._count("metrics", 200)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _own_metrics(self) -> str:
        lines = ["# HELP radixserve_http_requests_total HTTP requests answered by the gateway",
                 "# TYPE radixserve_http_requests_total counter"]
        for (route, status), v in sorted(self.counters.items()):
            lines.append(f'radixserve_http_requests_total{{route="{route}",status="{status}"}} {v}')
        lines += ["# HELP radixserve_http_inflight HTTP completion requests in progress",
                  "# TYPE radixserve_http_inflight gauge", f"radixserve_http_inflight {self.inflight}"]
        return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ server
def _guarded_h11(header_timeout_s: float, max_connections: int):
    """uvicorn's h11 protocol with two guards uvicorn lacks: a connection must complete each
    request head within ``header_timeout_s`` (slowloris), and connections beyond
    ``max_connections`` are closed at once."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("HTTP connection cap (%d) reached; closing a new connection", max_connections)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # still no complete request head

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                self._arm()  # part of a request head: it has header_timeout_s to finish
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


class GatewayServer:
    """uvicorn serving a :class:`Gateway` on a thread with its own (uvloop) event loop.
    ``header_timeout_s``: time a connection has to send a complete request head;
    ``max_connections``: open connections at most (beyond: closed at once)."""

    def __init__(self, gateway: Gateway, host: str, port: int, *, header_timeout_s: float = 10.0,
                 max_connections: int = 1024):
        import uvicorn

        self.gateway = gateway
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))  # here, so a busy port fails `serve` at once
        self.sock.listen(2048)
        self.sock.setblocking(False)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.config = uvicorn.Config(gateway.app, lifespan="off", log_level="warning", access_log=False,
                                     timeout_keep_alive=15, timeout_graceful_shutdown=3,
                                     http=_guarded_h11(header_timeout_s, max_connections),
                                     h11_max_incomplete_event_size=64 * 1024)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self._run, name="radixserve-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        async def main():
            try:
                await self.server.serve(sockets=[self.sock])
            finally:
                if self.gateway.client is not None:
                    await self.gateway.client.close()

        try:
            import uvloop

            uvloop.run(main())
        except ImportError:
            asyncio.run(main())

    def start(self) -> "GatewayServer":
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_gateway(args, router_address: str, limits: P.Limits, tokenizer=None) -> GatewayServer:
    """Start the gateway for ``radixserve serve`` (``args``: its parsed options)."""
    keys: dict[str, str] = {}
    for key in getattr(args, "api_key", None) or []:
        keys[key] = tenant_for_key(key)
    if getattr(args, "api_keys_file", None):
        try:
            keys.update(load_keys_file(args.api_keys_file))
        except (OSError, ValueError) as exc:
            raise RadixServeError(f"--api-keys-file: {exc}") from None
    if tokenizer is None:
        from radixserve.serve.router import load_tokenizer

        tokenizer = load_tokenizer(args.model)  # its own instance: this runs on another thread
    model = str(args.model)
    names = [Path(model).name or model, model]
    config = GatewayConfig(router=router_address, model_names=names, host=args.host, port=args.http_port,
                           max_body_bytes=limits.max_frame_bytes, limits=limits)
    try:
        server = GatewayServer(Gateway(config, tokenizer, Tenants(keys)), args.host, args.http_port,
                               header_timeout_s=getattr(args, "http_header_timeout", 10.0),
                               max_connections=getattr(args, "http_max_connections", 1024)).start()
    except OSError as exc:
        raise RadixServeError(f"--http-port {args.http_port}: cannot listen on {args.host}: {exc}") from None
    print(f"radixserve: HTTP API on {server.url}/v1 (model {names[0]!r}; "
          f"{f'{len(keys)} API keys' if keys else 'no API key required'})", flush=True)
    return server
