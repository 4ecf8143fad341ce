"""The Python SDK: talk to a radixserve router.

```python
from radixserve.client import Client

with Client("tcp://127.0.0.1:7700") as c:   # api_key="KEY" when serve has --api-key (or $RADIXSERVE_API_KEY)
    out = c.generate("Play e2e4 or d2d4?", max_tokens=8, temperature=0)
    print(out.text, out.usage.cached_tokens, out.timings.ttft_s)
    for chunk in c.stream("Tell me a story", max_tokens=32):
        print(chunk.text, end="", flush=True)
    move = c.generate("Your move:", structured={"choice": ["e2e4", "d2d4"]})  # or StructuredOutput(...)
    tok = radixserve.serve.router.load_tokenizer(None)  # the served model's tokenizer (chat template)
    out = c.chat([{"role": "user", "content": "Weather in Paris?"}], tokenizer=tok, tools=TOOLS,
                 tool_choice="required", max_tokens=64)
    print(out.tool_calls[0].name, out.tool_calls[0].arguments, out.finish_reason)  # ... "tool_calls"
```

:class:`AsyncClient` has the same methods as coroutines (``stream`` is an async iterator).
Errors are :class:`radixserve.errors.RadixServeError` subclasses carrying the wire ``code``
(``OverloadedError``, ``WorkerLostError``, ``BadRequestError`` ...); a timeout raises
:class:`RequestTimeoutError` and aborts the request on the server.

A lost router is detected by heartbeat: while calls are pending, the client sends a health probe
whenever the router has been quiet for ``heartbeat`` seconds; after ``router_timeout`` seconds
with no message at all, every pending call fails with :class:`RouterLostError` (code
``router_lost``), also calls made with ``timeout=None``. A router that refuses the connection at
its handshake (at its client cap, ``serve --max-clients``) fails the pending calls at once with
:class:`RouterRefusedError` (code ``router_refused``); the next call connects anew. No call waits
past its ``timeout``, sending included, and leaving a client never waits.

Concurrency: one DEALER socket per client, owned by one asyncio loop, with replies demultiplexed
by request id (:mod:`radixserve.connection`). ``AsyncClient`` is safe from many tasks of one loop; ``Client`` runs an
``AsyncClient`` on a background thread and is safe from many threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from types import EllipsisType

import msgspec

from radixserve import protocol as P
from radixserve.connection import Connection
from radixserve.errors import BadRequestError, RadixServeError, RequestTimeoutError
from radixserve.protocol import ChoiceUsage, Chunk, RankedChoice, Timings, Usage
from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.tools.chat import render_chat
from radixserve.tools.parser import ToolCall

DEFAULT_ADDRESS = "tcp://127.0.0.1:7700"
API_KEY_ENV = "RADIXSERVE_API_KEY"  # the api_key of a client made without one
Prompt = str | Sequence[int]
#: A call's ``timeout``: seconds, None (wait for ever) or ``...`` (the client's own ``timeout``).
Timeout = float | None | EllipsisType


class Completion(msgspec.Struct, kw_only=True):
    """The result of one generate call."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    timings: Timings
    worker: str = ""
    logprobs: list[P.TokenLogprob] | None = None  # when SamplingParams.logprobs was set


class Choice(msgspec.Struct, kw_only=True):
    """The result of one choose call: ``best`` (and its ``index`` in the choices), ``ranked``
    ``[(choice, logprob_sum, logprob_mean, n_tokens), ...]`` best first, ``usage`` (prompt and
    choice tokens; query and cached tokens over the prompt prefill and the per-choice scoring
    requests), ``timings`` and ``worker``."""

    request_id: str
    best: str
    index: int
    ranked: list[RankedChoice]
    usage: ChoiceUsage
    timings: Timings
    worker: str = ""


class ChatCompletion(msgspec.Struct, kw_only=True):
    """The result of one chat call: ``content`` (None when the model wrote only tool calls),
    ``tool_calls`` (parsed, each with an ``id``, ``name`` and ``arguments`` JSON text),
    ``finish_reason`` (``tool_calls`` when it called tools and stopped by itself) and the
    underlying ``completion`` (raw text, token ids, usage, timings)."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    completion: Completion


_SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)


def _params(params: SamplingParams | None, sampling: dict) -> SamplingParams:
    """A call's SamplingParams: ``params`` as given, or made of its keyword arguments."""
    if params is not None:
        if sampling:
            raise BadRequestError(sorted(sampling)[0], "cannot be given next to params= (set it in the SamplingParams)")
        return params
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise BadRequestError(sorted(unknown)[0], f"is not a sampling parameter; expected one of {sorted(_SAMPLING_FIELDS)}")
    return SamplingParams(**sampling)


class AsyncClient:
    """asyncio client. ``timeout`` (seconds, None: wait forever) bounds each call end to end.
    ``api_key``: the key every call carries, required when the server has keys (``serve
    --api-key`` / ``--api-keys-file``); default ``$RADIXSERVE_API_KEY``. With keys the cache
    namespace is the key's tenant's, derived on the server; ``namespace=`` then only names a
    part of it (``namespace="agents"`` is this tenant's ``agents``, never another tenant's)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float | None = 60.0,
        max_frame_bytes: int = P.DEFAULT_LIMITS.max_frame_bytes,
        heartbeat: float = 1.0,
        router_timeout: float | None = 10.0,
        api_key: str | None = None,
    ):
        self.address = address
        # Sent with every generate, choose and stats call; required when the server has keys.
        self.api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        self.timeout = timeout
        self._conn = Connection(address, max_frame_bytes=max_frame_bytes, heartbeat=heartbeat, router_timeout=router_timeout)

    def _timeout(self, timeout: Timeout) -> float | None:
        return self.timeout if isinstance(timeout, EllipsisType) else timeout

    def _generate_msg(self, prompt: Prompt, params: SamplingParams, namespace: str | None, stream: bool) -> P.Generate:
        if isinstance(prompt, str):
            return P.Generate(id=self._conn.new_id(), prompt=prompt, params=params, namespace=namespace, stream=stream, api_key=self.api_key)
        if not isinstance(prompt, (list, tuple)):
            raise BadRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        return P.Generate(id=self._conn.new_id(), token_ids=list(prompt), params=params, namespace=namespace, stream=stream, api_key=self.api_key)

    # -- API -----------------------------------------------------------------------------------
    async def generate(
        self, prompt: Prompt, *, params: SamplingParams | None = None, namespace: str | None = None, timeout: Timeout = ..., **sampling
    ) -> Completion:
        """Complete one prompt (text or token ids); ``sampling``: SamplingParams fields, or
        ``params``: the SamplingParams whole."""
        timeout = self._timeout(timeout)
        msg = self._generate_msg(prompt, _params(params, sampling), namespace, stream=False)
        return await self._completion(msg, timeout)

    def start_generate(
        self, prompt: Prompt, *, params: SamplingParams | None = None, namespace: str | None = None, timeout: Timeout = ..., **sampling
    ) -> asyncio.Task[Completion]:
        """:meth:`generate` as a task, its request sent before this returns (not at the task's
        first step, after whatever else the loop has ready). The in-process HTTP gateway starts
        its requests so: the router then sees a burst's first ones while the gateway is still
        taking in the rest, and its refusals can be answered at once (RESULTS, HTTP overload)."""
        timeout = self._timeout(timeout)
        msg = self._generate_msg(prompt, _params(params, sampling), namespace, stream=False)
        opened = self._conn.open(msg)
        task = asyncio.ensure_future(self._completion(msg, timeout, opened))
        task.add_done_callback(lambda _: self._conn.forget(msg.id))
        return task

    async def _completion(self, msg: P.Generate, timeout: float | None, opened=None) -> Completion:
        final: P.Final | None = None
        async for reply in self._conn.events(msg, timeout, opened):
            final = reply if isinstance(reply, P.Final) else final
        if final is None:  # _events ends with a final message or raises
            raise RuntimeError(f"request {msg.id}: the reply stream ended without its result")
        return Completion(
            request_id=msg.id,
            text=final.text,
            token_ids=final.token_ids,
            finish_reason=final.finish_reason,
            usage=final.usage,
            timings=final.timings,
            worker=final.worker,
            logprobs=final.logprobs,
        )

    async def chat(
        self,
        messages: list[dict],
        *,
        tokenizer,
        tools: list[dict] | None = None,
        tool_choice=None,
        parallel_tool_calls: bool | None = None,
        namespace: str | None = None,
        timeout: Timeout = ...,
        **sampling,
    ) -> ChatCompletion:
        """One chat turn with OpenAI-style ``messages``, ``tools``, ``tool_choice`` (``none``,
        ``auto``, ``required`` or ``{"type": "function", "function": {"name": ...}}``) and
        ``parallel_tool_calls``, as the HTTP gateway serves them: rendered here with ``tokenizer``'s
        chat template (the served model's, e.g. ``radixserve.serve.router.load_tokenizer(model)``),
        generated under the tools' grammar, the calls parsed out (:mod:`radixserve.tools`).
        ``sampling``: SamplingParams fields; a ``structured`` grammar goes only with
        ``tool_choice="none"``."""
        prompt, req = render_chat(tokenizer, messages, tools, tool_choice, parallel_tool_calls)
        if req is not None and req.parses:
            if sampling.get("structured") is not None:
                raise BadRequestError("structured", 'cannot be combined with tools unless tool_choice is "none"')
            sampling["structured"] = StructuredOutput(tool_calls=req.spec)
        out = await self.generate(prompt, namespace=namespace, timeout=timeout, **sampling)
        if req is None:
            return ChatCompletion(content=out.text, tool_calls=[], finish_reason=out.finish_reason, completion=out)
        content, calls, reason = req.parse(out.text, out.finish_reason)
        return ChatCompletion(content=content, tool_calls=calls, finish_reason=reason, completion=out)

    async def choose(
        self,
        prompt: Prompt,
        choices: Sequence[str],
        *,
        normalize: str = "sum",
        temperature: float = 0.0,
        seed: int | None = None,
        namespace: str | None = None,
        timeout: Timeout = ...,
    ) -> Choice:
        """Rank ``choices`` as continuations of ``prompt`` by token log-probabilities (SGLang's
        ``select``): the prompt is prefilled once, every ``prompt + choice`` is scored on top of
        its cached KV. ``normalize``: ``sum`` or ``mean`` (per token); ``temperature > 0`` samples
        ``best`` from softmax(score / temperature), reproducibly with ``seed``."""
        timeout = self._timeout(timeout)
        if isinstance(prompt, str):
            msg = P.Choose(
                id=self._conn.new_id(),
                prompt=prompt,
                choices=list(choices),
                normalize=normalize,
                temperature=temperature,
                seed=seed,
                namespace=namespace,
                api_key=self.api_key,
            )
        elif isinstance(prompt, (list, tuple)):
            msg = P.Choose(
                id=self._conn.new_id(),
                token_ids=list(prompt),
                choices=list(choices),
                normalize=normalize,
                temperature=temperature,
                seed=seed,
                namespace=namespace,
                api_key=self.api_key,
            )
        else:
            raise BadRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        final: P.ChoiceFinal | None = None
        async for reply in self._conn.events(msg, timeout):
            final = reply
        if final is None:  # _events ends with a final message or raises
            raise RuntimeError(f"request {msg.id}: the reply stream ended without its result")
        return Choice(request_id=msg.id, best=final.best, index=final.index, ranked=final.ranked, usage=final.usage, timings=final.timings, worker=final.worker)

    async def stream(
        self, prompt: Prompt, *, params: SamplingParams | None = None, namespace: str | None = None, timeout: Timeout = ..., **sampling
    ) -> AsyncIterator[Chunk | Completion]:
        """Yield :class:`~radixserve.protocol.Chunk` (new token_ids, text) as they come, then one
        :class:`Completion`; ``sampling`` or ``params`` as for :meth:`generate`. Leaving early
        aborts the request."""
        timeout = self._timeout(timeout)
        msg = self._generate_msg(prompt, _params(params, sampling), namespace, stream=True)
        async for reply in self._conn.events(msg, timeout):
            if isinstance(reply, P.Final):
                yield Completion(
                    request_id=msg.id,
                    text=reply.text,
                    token_ids=reply.token_ids,
                    finish_reason=reply.finish_reason,
                    usage=reply.usage,
                    timings=reply.timings,
                    worker=reply.worker,
                    logprobs=reply.logprobs,
                )
            else:
                yield reply

    async def batch(
        self, prompts: Sequence[Prompt], *, namespace: str | None = None, return_exceptions: bool = False, timeout: Timeout = ..., **sampling
    ) -> list:
        """Complete many prompts concurrently; results in prompt order."""
        return await asyncio.gather(
            *(self.generate(p, namespace=namespace, timeout=timeout, **dict(sampling)) for p in prompts),
            return_exceptions=return_exceptions,
        )

    async def health(self, timeout: float | None = 5.0) -> dict:
        reply = await self._conn.call(P.Health(id=self._conn.new_id()), timeout)
        return {"status": reply.status, "workers": reply.workers, "workers_alive": reply.workers_alive}

    async def stats(self, *, probe: Prompt | None = None, namespace: str | None = None, timeout: float | None = 5.0) -> dict:
        probe = list(probe) if probe is not None and not isinstance(probe, str) else probe
        reply = await self._conn.call(P.Stats(id=self._conn.new_id(), probe=probe, namespace=namespace, api_key=self.api_key), timeout)
        return reply.stats

    async def wait_ready(self, workers: int = 1, timeout: float = 60.0) -> dict:
        """Wait until the router has ``workers`` live workers."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                h = await self.health(timeout=1.0)
                if h["workers_alive"] >= workers:
                    return h
            except RequestTimeoutError:
                pass
            if time.monotonic() > deadline:
                raise RequestTimeoutError(f"{self.address}: fewer than {workers} workers after {timeout} s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self._conn.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Client:
    """Blocking client, safe from many threads: an :class:`AsyncClient` on a private loop thread."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float | None = 60.0, **options):
        self.address = address
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-client", daemon=True)
        self._thread.start()
        self._async = self._run(self._make(address, timeout, options))
        self._closed = False

    @staticmethod
    async def _make(address, timeout, options) -> AsyncClient:
        return AsyncClient(address, timeout=timeout, **options)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt: Prompt, *, namespace: str | None = None, timeout: Timeout = ..., **sampling) -> Completion:
        return self._run(self._async.generate(prompt, namespace=namespace, timeout=timeout, **sampling))

    def chat(
        self,
        messages: list[dict],
        *,
        tokenizer,
        tools: list[dict] | None = None,
        tool_choice=None,
        parallel_tool_calls: bool | None = None,
        namespace: str | None = None,
        timeout: Timeout = ...,
        **sampling,
    ) -> ChatCompletion:
        return self._run(
            self._async.chat(
                messages,
                tokenizer=tokenizer,
                tools=tools,
                tool_choice=tool_choice,
                parallel_tool_calls=parallel_tool_calls,
                namespace=namespace,
                timeout=timeout,
                **sampling,
            )
        )

    def choose(
        self,
        prompt: Prompt,
        choices: Sequence[str],
        *,
        normalize: str = "sum",
        temperature: float = 0.0,
        seed: int | None = None,
        namespace: str | None = None,
        timeout: Timeout = ...,
    ) -> Choice:
        return self._run(self._async.choose(prompt, choices, normalize=normalize, temperature=temperature, seed=seed, namespace=namespace, timeout=timeout))

    def stream(self, prompt: Prompt, *, namespace: str | None = None, timeout: Timeout = ..., **sampling) -> Iterator[Chunk | Completion]:
        agen = self._async.stream(prompt, namespace=namespace, timeout=timeout, **sampling)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(agen.aclose())

    def batch(self, prompts: Sequence[Prompt], *, namespace: str | None = None, return_exceptions: bool = False, timeout: Timeout = ..., **sampling) -> list:
        return self._run(self._async.batch(prompts, namespace=namespace, return_exceptions=return_exceptions, timeout=timeout, **sampling))

    def health(self, timeout: float | None = 5.0) -> dict:
        return self._run(self._async.health(timeout))

    def stats(self, *, probe: Prompt | None = None, namespace: str | None = None, timeout: float | None = 5.0) -> dict:
        return self._run(self._async.stats(probe=probe, namespace=namespace, timeout=timeout))

    def wait_ready(self, workers: int = 1, timeout: float = 60.0) -> dict:
        return self._run(self._async.wait_ready(workers, timeout))

    def close(self) -> None:
        """Close the connection and stop the loop thread; bounded (the connection's close never
        waits, and a loop thread stuck elsewhere is left behind rather than waited for)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._async.close(), self._loop).result(timeout=5)
        except concurrent.futures.TimeoutError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort, never blocks (it may run at interpreter exit)
        try:
            if not self._closed:
                self._closed = True
                self._loop.call_soon_threadsafe(self._loop.stop)
        except Exception:
            pass


__all__ = ["Client", "AsyncClient", "ChatCompletion", "Completion", "Choice", "Chunk", "ToolCall", "Usage", "Timings", "RadixServeError"]
