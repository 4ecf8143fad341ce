"""The Starlette app of the OpenAI gateway: routes, request handling, streaming.

Every request goes to the router over the same ZMQ protocol as the SDK (one shared
:class:`~radixserve.client.AsyncClient`). ``n > 1`` runs n requests; with a ``seed``, choice i uses
``seed + i`` (reproducible, yet the choices differ). Usage counts each prompt once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from radixserve import protocol as P
from radixserve.errors import OverloadedError, RadixServeError
from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.serve.metrics import GatewayMetrics, prometheus_text
from radixserve.serve.openai import responses as R
from radixserve.serve.openai.errors import APIError, api_error_from, bad
from radixserve.serve.openai.plumbing import gather_all, read_json, start_all, with_disconnect
from radixserve.serve.openai.prompts import chat_chars, chat_ids, chat_messages, completion_prompts
from radixserve.serve.openai.schema import (
    ChatRequest,
    chat_tools,
    known_fields,
    max_tokens_field,
    parse_request,
    refuse_unsupported,
    sampling_params,
    structured_field,
)
from radixserve.serve.openai.shed import Shedder
from radixserve.serve.openai.tenants import Tenants
from radixserve.serve.router.core import shareable
from radixserve.tools.chat import ToolRequest

log = logging.getLogger("radixserve.http")

MAX_CHOICES = 64  # prompts x n per request


@dataclass
class GatewayConfig:
    router: str  # the router's ZMQ address
    model_names: list[str] = field(default_factory=lambda: ["radixserve"])
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 2**20
    max_n: int = 16
    limits: P.Limits = field(default_factory=P.Limits)
    # Chats are tokenized here (the router gets token ids): short ones on the loop (microseconds),
    # longer ones in a pool of tokenize_threads, at most max_tokenizing at once (beyond: 503).
    inline_tokenize_chars: int = 8192
    tokenize_threads: int = 2
    max_tokenizing: int = 32
    # The key the gateway's requests carry to the router (serve passes auth.gateway_key): the
    # router then trusts the namespaces the gateway derived from its HTTP tenants' keys.
    router_key: str | None = None


@dataclass
class Prepared:
    """A checked completion request, ready to run: one job (index, prompt, SamplingParams) per choice."""

    chat: bool
    model: str
    jobs: list[tuple[int, Any, SamplingParams]]
    n: int
    stream: bool
    include_usage: bool
    namespace: str | None
    headers: dict[str, str]
    return_token_ids: bool = False
    tools: ToolRequest | None = None  # chat with tools: the output is parsed for calls
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens (chat: maybe max_completion_tokens)

    @property
    def route(self) -> str:
        return "chat" if self.chat else "completions"

    def response(self, choices: list, usage: R.Usage | None = None, chunk: bool = False, rid: str | None = None, created: int | None = None) -> R.Response:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return R.Response(
            id=rid or self.new_id(),
            object=obj,
            created=created or int(time.time()),
            model=self.model,
            choices=choices,
            usage=R.UNSET if usage is None else usage,
        )

    def new_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def _jobs(prompts: list, params: SamplingParams, n: int) -> list[tuple[int, Any, SamplingParams]]:
    """One job per prompt and choice; with a seed, choice i of a prompt uses ``seed + i``, wrapped
    to 0 past the top of a seed's range (2**64 - 1)."""
    jobs = []
    for pi, prompt in enumerate(prompts):
        for i in range(n):
            sp = params
            if n > 1 and params.seed is not None:
                seed = params.seed + i
                sp = msgspec.structs.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)
            jobs.append((pi * n + i, prompt, sp))
    return jobs


class Gateway:
    """The Starlette app and its state (router client, tokenizer, tenants, metrics)."""

    def __init__(self, config: GatewayConfig, tokenizer=None, tenants: Tenants | None = None, client=None, admission: Callable[[str], bool] | None = None):
        """``admission(tenant)``: True when the router would certainly refuse a new job of that
        queue share ``overloaded`` (serve passes its in-process router's
        :meth:`~radixserve.serve.router.admission.AdmissionView.refuses`): such a completion is
        answered 503 before anything else is done with it. None: every request goes to the router."""
        self.config = config
        self.tokenizer = shareable(tokenizer)  # the loop and the pool's threads call it at once
        self._token_texts = R.TokenTexts(self.tokenizer)
        self.tenants = tenants or Tenants()
        self.client = client  # AsyncClient, created on the serving loop when None
        self.created = int(time.time())
        self.meters = GatewayMetrics(lambda: self.inflight)
        self.shedder = None if admission is None else Shedder(admission, self.tenants, self.meters.count)
        self.inflight = 0
        self._warned: set[str] = set()
        self._context: tuple[int, int] | None = None  # see _router_limits
        self._tok_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._tokenizing = 0
        self.app = self._build_app()

    @property
    def counters(self) -> Mapping[tuple[str, int], float]:
        """HTTP answers so far by (route, status): a live view of the Prometheus counter."""
        return self.meters.by_route()

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
            msg = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}.get(
                exc.status_code, exc.detail
            )
            return self._error(APIError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)), route="other")

        async def on_any(request, exc: Exception):
            return self._error(api_error_from(exc), route="other")

        app = Starlette(routes=routes, exception_handlers={HTTPException: on_http, Exception: on_any})
        return app if self.shedder is None else self.shedder.wrap(app)

    def _json(self, data, status: int = 200, headers: dict | None = None, route: str = "other"):
        from starlette.responses import Response

        self.meters.count(route, status)
        return Response(msgspec.json.encode(data), status_code=status, headers=headers, media_type="application/json")

    def _error(self, err: APIError, route: str = "other", headers: dict | None = None):
        return self._json(err.body(), err.status, {**(headers or {}), **err.headers}, route)

    # -- request plumbing ---------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> str:
        names = self.config.model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"The model '{model}' does not exist; this server serves {names[0]!r}", param="model", code="model_not_found")
        return model

    def _ignored(self, body: dict, chat: bool) -> list[str]:
        """The unknown fields of a request, which are ignored and listed in a response header: so
        their names must be printable ASCII (400 otherwise, before anything runs)."""
        known = known_fields(chat)
        extra = sorted(k for k in body if k not in known)
        for k in extra:
            if not (k.isascii() and k.isprintable()):
                raise APIError(
                    400,
                    f"unknown field {k!r}: an unknown field's name must be printable ASCII (unknown "
                    f"fields are ignored and listed in the X-Radixserve-Ignored-Fields header)",
                    param=k,
                )
            if k not in self._warned and len(self._warned) < 1000:
                self._warned.add(k)
                log.warning("ignoring unknown request field %r", k)
        return extra

    async def _ensure_client(self):
        if self.client is None:
            from radixserve.client import AsyncClient

            self.client = AsyncClient(self.config.router, timeout=None, api_key=self.config.router_key, max_frame_bytes=self.config.limits.max_frame_bytes)
        return self.client

    def _logprobs(self, lps, chat: bool):
        return R.logprobs(self._token_texts, lps, chat)

    # -- completions -------------------------------------------------------------------------------
    async def _prepare(self, request, chat: bool) -> Prepared:
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        body = await read_json(request, self.config.max_body_bytes)
        req = parse_request(body, chat)
        model = self._check_model(req.model)
        ignored = self._ignored(body, chat)
        refuse_unsupported(req)
        params, n = sampling_params(req)
        if n > self.config.max_n:
            raise bad("n", f"must be at most {self.config.max_n}, got {n}")
        prompts: list[str | list[int]]
        tools = None
        if isinstance(req, ChatRequest):  # parse_request gave a ChatRequest: chat
            tools = chat_tools(req, getattr(self.tokenizer, "chat_template", None))
            if tools is not None:
                params = self._with_tool_grammar(req, params, tools)
            prompts = [await self._chat_prompt(req, tools)]
        else:
            prompts = completion_prompts(req)
        if len(prompts) * n > MAX_CHOICES:
            raise bad("n", f"prompts x n must be at most {MAX_CHOICES}")
        headers = {"X-Radixserve-Ignored-Fields": ",".join(ignored)[:1000]} if ignored else {}
        return Prepared(
            chat=chat,
            model=model,
            jobs=_jobs(prompts, params, n),
            n=n,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            namespace=self.tenants.namespace(tenant),
            headers=headers,
            return_token_ids=req.return_token_ids,
            tools=tools,
            max_tokens_param=max_tokens_field(req),
        )

    @staticmethod
    def _with_tool_grammar(req: ChatRequest, params, tools: ToolRequest):
        """``params`` with the tools' grammar. Another grammar (``response_format``, ``guided_*``)
        goes only with ``tool_choice: "none"``, and then it alone applies."""
        other = structured_field(req)
        if other is not None:
            if tools.parses:
                raise bad(other, 'cannot be combined with tools unless tool_choice is "none"')
            return params
        return msgspec.structs.replace(params, structured=StructuredOutput(tool_calls=tools.spec))

    async def _chat_prompt(self, req: ChatRequest, tools: ToolRequest | None = None) -> list[int]:
        """The chat's token ids. A chat longer (in characters) than any prompt that fits the context
        is refused untokenized; a short one is tokenized on the loop, a longer one in the pool, so
        that one tenant's long chats never hold up another's short one."""
        messages, template_kwargs = chat_messages(req, self.tokenizer, tools)
        chars = chat_chars(messages, template_kwargs)
        limit = (await self._router_limits())[1]
        if chars > limit:
            raise APIError(
                400,
                f"messages: have {chars} characters; no prompt longer than {limit} characters can fit the model's context",
                param="messages",
                code="context_length_exceeded",
            )
        if chars <= self.config.inline_tokenize_chars:
            return chat_ids(messages, self.tokenizer, self.config.limits, template_kwargs)
        if self._tokenizing >= self.config.max_tokenizing:
            raise OverloadedError(f"{self._tokenizing} long chats are being tokenized; retry later")
        if self._tok_pool is None:
            self._tok_pool = concurrent.futures.ThreadPoolExecutor(self.config.tokenize_threads, thread_name_prefix="http-tokenize")
        self._tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tok_pool, chat_ids, messages, self.tokenizer, self.config.limits, template_kwargs)
        finally:
            self._tokenizing -= 1

    async def _handle(self, request, chat: bool):
        route = "chat" if chat else "completions"
        self.inflight += 1
        streaming = False
        prep: Prepared | None = None
        try:
            try:
                prep = await self._prepare(request, chat)
                if prep.stream:
                    response = await self._stream(request, prep)
                    streaming = True  # the stream's generator ends the in-flight count
                    return response
                tasks = start_all(await self._ensure_client(), prep.jobs, prep.namespace)
                try:
                    outs = await with_disconnect(request, gather_all(tasks))
                finally:  # also when the gathering was cancelled before it began
                    for t in tasks:
                        if not t.done():
                            t.cancel()
            except Exception as exc:
                max_tokens_param = prep.max_tokens_param if prep is not None else "max_tokens"
                return self._error(api_error_from(exc, "messages" if chat else "prompt", max_tokens_param), route)
            return self._json(await self._final_body(prep, outs), headers=prep.headers, route=route)
        finally:
            if not streaming:
                self.inflight -= 1

    async def _final_body(self, prep: Prepared, outs: list) -> msgspec.Raw:
        """The JSON of a finished completion; built off the loop when it carries logprobs (up to 64
        choices x their tokens x 21 alternatives: too long to keep other requests waiting)."""

        def build() -> msgspec.Raw:
            choices = [
                R.final_choice(
                    index,
                    out,
                    self._logprobs(getattr(out, "logprobs", None), prep.chat),
                    prep.chat,
                    out.token_ids if prep.return_token_ids else None,
                    prep.tools,
                )
                for (index, _, _), out in zip(prep.jobs, outs)
            ]
            return msgspec.Raw(msgspec.json.encode(prep.response(choices, R.usage(outs, prep.n))))

        if any(getattr(out, "logprobs", None) for out in outs):
            return await asyncio.to_thread(build)
        return build()

    async def _stream(self, request, prep: Prepared):
        from starlette.responses import StreamingResponse

        from radixserve.serve.openai.streaming import open_streams, sse_events

        async def gen(first):
            try:
                async for event in sse_events(prep, first, queue, self._logprobs):
                    yield event
            finally:
                self.inflight -= 1
                for t in tasks:
                    if not t.done():
                        t.cancel()

        queue, tasks = open_streams(await self._ensure_client(), prep.jobs, prep.namespace)
        try:  # an error before the first token gets a real HTTP status, and ends every choice
            first = await with_disconnect(request, queue.get())
            if first[2] is not None:
                raise first[2]
            response = StreamingResponse(
                gen(first), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **prep.headers}
            )
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        self.meters.count(prep.route, 200)
        return response

    # -- endpoints ---------------------------------------------------------------------------------
    async def completions(self, request):
        return await self._handle(request, chat=False)

    async def chat_completions(self, request):
        return await self._handle(request, chat=True)

    async def _router_limits(self) -> tuple[int | None, int]:
        """(The model's context in tokens, None while no worker is up; the longest prompt in
        characters worth tokenizing), from the router's stats, kept once a worker is up."""
        if self._context is None:
            chars = self.config.limits.max_prompt_chars
            try:
                stats = await (await self._ensure_client()).stats(timeout=2.0)
            except RadixServeError:
                return None, chars
            chars = stats.get("router", {}).get("max_prompt_chars", chars)
            lens = [w.get("max_model_len", 0) for w in stats.get("workers", {}).values() if w.get("alive")]
            lens = [x for x in lens if x]
            if not lens:
                return None, chars
            self._context = (min(lens), chars)
        return self._context

    async def _model_len(self) -> int | None:
        return (await self._router_limits())[0]

    async def close(self) -> None:
        """Close the router client and the tokenizing pool."""
        if self.client is not None:
            await self.client.close()
        if self._tok_pool is not None:
            self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def _model_card(self, name: str, max_len: int | None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "radixserve", "max_model_len": max_len}

    async def models(self, request):
        try:
            self.tenants.authenticate(request.headers.get("authorization"))
        except APIError as err:
            return self._error(err, "models")
        max_len = await self._model_len()
        return self._json({"object": "list", "data": [self._model_card(self.config.model_names[0], max_len)]}, route="models")

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
        """Prometheus text of the router's stats, then the gateway's own request metrics. With API
        keys configured it needs one too: the counters (cached tokens ...) are the fleet's."""
        from starlette.responses import Response

        try:
            self.tenants.authenticate(request.headers.get("authorization"))
            client = await self._ensure_client()
            stats = await client.stats(timeout=5.0)
        except (APIError, RadixServeError) as exc:
            return self._error(api_error_from(exc), "metrics")
        text = prometheus_text(stats) + self.meters.text()
        self.meters.count("metrics", 200)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
