"""Client-facing requests: admission of generate and choose calls (validated, tokenized off the
loop when long, then dispatched or queued, or refused ``overloaded``), aborts, health and stats."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import time

from radixserve import protocol as P
from radixserve.errors import RadixServeError, TooLongError, UnauthorizedError
from radixserve.limits import check_prompt_tokens
from radixserve.serve.router.base import RouterBase
from radixserve.serve.router.state import Job

log = logging.getLogger("radixserve.router")


class ClientFront(RouterBase):
    """The handlers of client requests (the client socket)."""

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_chars = longest_token_chars(tokenizer)

    def prompt_char_limit(self) -> int:
        """Prompts longer than this (characters) cannot fit the context: refused untokenized."""
        cfg = self.config
        limit = cfg.limits.max_prompt_chars
        if cfg.max_prompt_chars is not None:
            return min(limit, cfg.max_prompt_chars)
        context = self._context()
        if context:
            limit = min(limit, context * self._token_chars)
        return limit

    def _accepting(self, identity: bytes, msg) -> tuple | None:
        """The job key for a new client call, or None after replying why it can't be taken."""
        if self.shutting_down:
            self._reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            return None
        key = (identity, msg.id)
        if key in self.jobs or key in self._tokenizing:
            self._reply_error(identity, msg.id, P.BAD_REQUEST, f"id: {msg.id!r} is already in flight on this connection")
            return None
        return key

    def _authorize(self, identity: bytes, msg: P.Generate | P.Choose | P.Stats) -> tuple[str, str | None]:
        """``(tenant, namespace)`` of a client request; raises :class:`UnauthorizedError`.

        ``tenant`` is whose share of the queue the request takes; ``namespace`` the cache
        namespace it runs in. With keys configured it is the key's tenant's, derived here (a
        client's own ``namespace`` only subdivides it: ``T/NAME``), so no client can reach
        another tenant's cache. The in-process HTTP gateway authenticates with
        :attr:`gateway_key`: it checked its tenants' keys itself and names their namespaces.
        Without keys the namespace is the client's and its share is its connection's."""
        key = msg.api_key
        if key is not None and hmac.compare_digest(key.encode("utf-8", "surrogatepass"), self.gateway_key.encode()):
            if identity not in self._trusted:
                if len(self._trusted) >= 64:  # reconnects: forget the old ones
                    self._trusted.clear()
                self._trusted.add(identity)
            return f"http:{msg.namespace or ''}", msg.namespace
        if not self.tenants.required:
            return f"conn:{identity.hex()}", msg.namespace
        tenant = self.tenants.tenant(key)
        if tenant is None:
            raise UnauthorizedError(("this server requires an API key: pass Client(..., api_key=KEY) or set "
                                     "RADIXSERVE_API_KEY") if not key else "unknown API key")
        ns = self.tenants.namespace(tenant)
        return f"key:{tenant}", f"{ns}/{msg.namespace}" if msg.namespace else ns

    def _on_generate(self, identity: bytes, worker, msg: P.Generate) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            tenant, namespace = self._authorize(identity, msg)
            P.validate_generate(msg, self.config.limits)  # exactly one of prompt, token_ids
            msg.namespace = namespace
            if msg.prompt is not None:
                if self.tokenizer is None:
                    raise P.DecodeError("this router has no tokenizer; send token_ids", msg.id)
                self._check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        if msg.token_ids is not None:
            self._admit_generate(key, identity, msg, msg.token_ids, tenant)
        else:
            prompt = msg.prompt or ""  # validate_generate: exactly one of prompt, token_ids
            self._tokenize(key, identity, msg, lambda: (self.tokenizer.encode(prompt),),
                           lambda ids: self._admit_generate(key, identity, msg, ids, tenant), len(prompt), tenant)

    def _check_prompt_chars(self, n: int) -> None:
        limit = self.prompt_char_limit()
        if n > limit:
            raise TooLongError("prompt", f"has {n} characters; no prompt longer than {limit} characters can fit "
                                         f"the model's context")

    def _tokenize(self, key, identity: bytes, msg, compute, then, chars: int, tenant: str) -> None:
        """Run ``compute()`` (tokenizer calls on ``chars`` characters) off the loop when that is
        long, then ``then(*result)`` on the loop; answers overloaded when too many are in the pool,
        or when the pool is half full and ``tenant`` holds a quarter of it (others keep room)."""
        if chars <= self.config.inline_tokenize_chars:
            then(*compute())
            return
        cap = self.config.max_tokenizing
        busy, mine = len(self._tokenizing), self._tokenizing_by[tenant]
        if busy >= cap or (busy >= cap // 2 and mine >= max(1, cap // 4)):
            self.counters["overloaded"] += 1
            self._reply_error(identity, msg.id, P.OVERLOADED,
                              f"{busy} long prompts are being tokenized ({mine} of them yours); retry later")
            return
        if self._tok_pool is None:
            self._tok_pool = concurrent.futures.ThreadPoolExecutor(self.config.tokenize_threads,
                                                                   thread_name_prefix="tokenize")
        self._tokenizing[key] = False
        self._tokenizing_by[tenant] += 1
        future = asyncio.get_running_loop().run_in_executor(self._tok_pool, compute)

        def done(fut) -> None:
            aborted = self._tokenizing.pop(key, False)
            self._tokenizing_by[tenant] -= 1
            if self._tokenizing_by[tenant] <= 0:
                del self._tokenizing_by[tenant]
            try:
                if fut.cancelled():
                    raise RuntimeError("tokenizing was cancelled")
                result = fut.result()
            except Exception as exc:
                self._reply_error(identity, msg.id, P.INTERNAL, f"tokenizing failed: {type(exc).__name__}: {exc}")
                return
            if aborted:
                self._reply_error(identity, msg.id, P.BAD_REQUEST, "aborted by the client")
            elif self.shutting_down:
                self._reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            else:
                try:
                    then(*result)
                except Exception:  # a bug must not leave the call without a reply
                    log.exception("router failed admitting a tokenized request")
                    self._reply_error(identity, msg.id, P.INTERNAL, "router error admitting the request")

        future.add_done_callback(done)

    def _admit_generate(self, key, identity: bytes, msg: P.Generate, ids, tenant: str) -> None:
        try:
            check_prompt_tokens(ids, self.config.limits)
            if not ids:
                raise P.DecodeError("prompt tokenizes to nothing", msg.id)
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.counters["requests"] += 1
        now = time.monotonic()
        job = Job(n=next(self._n), client=identity, cid=msg.id, token_ids=list(ids), params=msg.params,
                  namespace=msg.namespace, stream=msg.stream, arrival=now, tenant=tenant)
        self._admit(key, job)

    def _on_choose(self, identity: bytes, worker, msg: P.Choose) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            tenant, namespace = self._authorize(identity, msg)
            P.validate_choose(msg, self.config.limits)
            msg.namespace = namespace
            if self.tokenizer is None:
                raise P.DecodeError("this router has no tokenizer; choose needs one", msg.id)
            if msg.prompt is not None:
                self._check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        tok = self.tokenizer

        def compute():
            ids = msg.token_ids if msg.token_ids is not None else tok.encode(msg.prompt)
            return ids, [tok.encode(c, add_special_tokens=False) for c in msg.choices]

        # The choices are tokenized with the prompt, off the loop when they are long together
        # (token_ids or a short prompt with megabytes of choices stalled the loop for seconds).
        chars = len(msg.prompt or "") + sum(map(len, msg.choices))
        self._tokenize(key, identity, msg, compute,
                       lambda ids, cids: self._admit_choose(key, identity, msg, ids, cids, tenant), chars, tenant)

    def _context(self) -> int:
        """The model's context in tokens (0 while no worker has told it)."""
        cfg = self.config
        return cfg.max_model_len or max((w.info.get("max_model_len", 0) for w in self.workers.values()), default=0)

    def _admit_choose(self, key, identity: bytes, msg: P.Choose, ids, choice_ids, tenant: str) -> None:
        try:
            check_prompt_tokens(ids, self.config.limits)
            if not ids or not all(choice_ids):
                raise P.DecodeError("prompt or a choice tokenizes to nothing", msg.id)
            n = sum(map(len, choice_ids))
            limit, name = self.config.limits.max_choice_tokens, "max_choice_tokens"
            if 0 < self._context() < limit:
                limit, name = self._context(), "the model's context"
            if n > limit:  # every choice token is scored on top of the prompt: work like a prompt's
                raise TooLongError("choices", f"have {n} tokens in all; the limit is {limit} ({name}): "
                                              f"send fewer or shorter choices")
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.counters["requests"] += 1
        self.counters["choose_requests"] += 1
        now = time.monotonic()
        job = Job(n=next(self._n), client=identity, cid=msg.id, token_ids=list(ids), params=None,
                  namespace=msg.namespace, stream=False, arrival=now, tenant=tenant,
                  choose=dict(choices=msg.choices, choice_ids=choice_ids, normalize=msg.normalize,
                              temperature=msg.temperature, seed=msg.seed))
        self._admit(key, job)

    def _admit(self, key, job: Job) -> None:
        identity = job.client
        self.hist["queue_depth_at_arrival"].observe(len(self.queue))
        candidates = self._candidates()
        if candidates:
            self.jobs[key] = job
            self._dispatch(job, candidates)
        elif len(self.queue) < self.config.max_queue or self._push_out(job.tenant):
            self.jobs[key] = job
            job.queued_at = job.arrival
            self.queue.append(job)
        else:
            self.counters["overloaded"] += 1
            self._reply_error(identity, job.cid, P.OVERLOADED,
                              f"all {len(self._alive())} workers are at their in-flight cap and the router queue "
                              f"is full ({self.config.max_queue}); retry later or add workers")

    def _push_out(self, tenant: str) -> bool:
        """Room in the full queue for a job of ``tenant``, by refusing the newest job of the tenant
        holding the most of it (if that holds at least two more than ``tenant``)."""
        out = self.queue.push_out(tenant)
        if out is None:
            return False
        self.counters["overloaded"] += 1
        self.counters["queue_pushed_out"] += 1
        self.jobs.pop((out.client, out.cid), None)
        self._reply_error(out.client, out.cid, P.OVERLOADED,
                          f"the router queue is full ({self.config.max_queue}) and your requests hold the most of it; "
                          f"retry later")
        return True

    def _on_abort(self, identity: bytes, worker, msg: P.Abort) -> None:
        if (identity, msg.id) in self._tokenizing:
            self._tokenizing[(identity, msg.id)] = True  # answered when tokenizing ends
            return
        job = self.jobs.get((identity, msg.id))
        if job is None:
            return
        if job.worker is None:  # still queued here
            try:
                self.queue.remove(job)
            except ValueError:
                pass
            self._finish(job, None)
            if job.choose is not None:
                self._reply_error(job.client, job.cid, P.BAD_REQUEST, "aborted by the client")
                return
            self._send(job.client, P.Final(id=job.cid, token_ids=[], text="", finish_reason="abort",
                                           usage=P.Usage(prompt_tokens=len(job.token_ids), cached_tokens=0, completion_tokens=0),
                                           timings=P.Timings(queue_s=time.monotonic() - job.arrival, ttft_s=0.0,
                                                             e2e_s=time.monotonic() - job.arrival)))
            self.counters["aborted"] += 1
        else:
            self._wsend(job.worker.identity, P.Abort(id=job.work_id))

    def _on_health(self, identity: bytes, worker, msg: P.Health) -> None:
        alive = len(self._alive())
        status = "shutting_down" if self.shutting_down else ("ok" if alive else "degraded")
        self._send(identity, P.HealthReply(id=msg.id, status=status, workers=len(self.workers), workers_alive=alive))

    def _on_stats(self, identity: bytes, worker, msg: P.Stats) -> None:
        try:
            _, namespace = self._authorize(identity, msg)
            if msg.namespace is not None and len(msg.namespace) > self.config.limits.max_namespace_chars:
                raise P.BadRequestError("namespace", f"must be at most {self.config.limits.max_namespace_chars} characters")
        except RadixServeError as exc:
            self._reply_error(identity, msg.id, exc.code, str(exc))
            return
        probe = None
        if msg.probe is not None:
            # a text probe is tokenized on the loop: only its first 65536 characters (milliseconds)
            text = msg.probe[: min(self.prompt_char_limit(), 65536)] if isinstance(msg.probe, str) else ""
            ids = msg.probe if isinstance(msg.probe, list) else (self.tokenizer.encode(text) if self.tokenizer else [])
            ids = ids[: self.config.limits.max_probe_tokens]
            probe = {w.name: w.index.tree.peek(ids, namespace) for w in self.workers.values()}
        self._send(identity, P.StatsReply(id=msg.id, stats=self.stats(probe)))


def longest_token_chars(tokenizer, cap: int = 64) -> int:
    """Characters in the vocabulary's longest token (at least 4, at most ``cap``): a prompt of
    more than ``context x this`` characters cannot fit the context."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max(len(t) for t in vocab) if vocab else cap
    except Exception:
        longest = cap
    return max(4, min(cap, longest))
