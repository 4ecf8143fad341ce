"""The client front: generate and choose calls are authenticated (API keys -> tenants ->
cache namespaces), validated and tokenized (off the loop when long, in a bounded pool shared
fairly between tenants), then handed to the dispatcher as jobs; and aborts."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import logging
import time
from typing import Any

from radixserve import protocol as P
from radixserve.errors import RadixServeError, TooLongError, UnauthorizedError
from radixserve.limits import check_prompt_tokens
from radixserve.serve.router.admission import http_tenant
from radixserve.serve.router.dispatch import Dispatcher
from radixserve.serve.router.jobs import JobKey, JobTable
from radixserve.serve.router.registry import WorkerRegistry
from radixserve.serve.router.sockets import Transport
from radixserve.serve.router.state import Job, Metrics, RouterConfig
from radixserve.serve.tenants import TenantKeys

log = logging.getLogger("radixserve.router")


class ClientFront:
    """The handlers of client calls that become jobs. Owns the tokenizer and its thread pool, and
    the calls being tokenized (per tenant)."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any,
        tenants: TenantKeys,
        gateway_key: str,
        *,
        registry: WorkerRegistry,
        jobs: JobTable,
        dispatcher: Dispatcher,
        transport: Transport,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.tenants = tenants  # API keys -> tenants -> cache namespaces (empty: a keyless server)
        self.gateway_key = gateway_key  # what the in-process HTTP gateway authenticates with
        self.registry = registry
        self.jobs = jobs
        self.dispatcher = dispatcher
        self.transport = transport
        self.metrics = metrics
        self.tokenizer: Any = None  # a Hugging Face tokenizer, or None: clients must send token ids
        self._token_chars = 64
        self.set_tokenizer(tokenizer)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._tokenizing: dict[JobKey, bool] = {}  # key -> aborted while tokenizing
        self._tokenizing_by: collections.Counter[str] = collections.Counter()  # tenant -> its prompts being tokenized

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_chars = longest_token_chars(tokenizer)

    def prompt_char_limit(self) -> int:
        """Prompts longer than this (characters) cannot fit the context: refused untokenized."""
        cfg = self.config
        limit = cfg.limits.max_prompt_chars
        if cfg.max_prompt_chars is not None:
            return min(limit, cfg.max_prompt_chars)
        context = self.registry.context()
        if context:
            limit = min(limit, context * self._token_chars)
        return limit

    def _accepting(self, identity: bytes, msg: P.Generate | P.Choose) -> JobKey | None:
        """The job key for a new client call, or None after replying why it can't be taken."""
        if self.dispatcher.shutting_down:
            self.transport.reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            return None
        key = (identity, msg.id)
        if key in self.jobs or key in self._tokenizing:
            self.transport.reply_error(identity, msg.id, P.BAD_REQUEST, f"id: {msg.id!r} is already in flight on this connection")
            return None
        return key

    def authorize(self, identity: bytes, msg: P.Generate | P.Choose | P.Stats) -> tuple[str, str | None]:
        """``(tenant, namespace)`` of a client request; raises :class:`UnauthorizedError`.

        ``tenant`` is whose share of the queue the request takes; ``namespace`` the cache
        namespace it runs in. With keys configured it is the key's tenant's, derived here (a
        client's own ``namespace`` only subdivides it: ``T/NAME``), so no client can reach
        another tenant's cache. The in-process HTTP gateway authenticates with
        :attr:`gateway_key`: it checked its tenants' keys itself and names their namespaces.
        Without keys the namespace is the client's and its share is its connection's."""
        key = msg.api_key
        if key is not None and hmac.compare_digest(key.encode("utf-8", "surrogatepass"), self.gateway_key.encode()):
            self.transport.trust(identity)
            return http_tenant(msg.namespace), msg.namespace
        if not self.tenants.required:
            return f"conn:{identity.hex()}", msg.namespace
        tenant = self.tenants.tenant(key)
        if tenant is None:
            raise UnauthorizedError(
                ("this server requires an API key: pass Client(..., api_key=KEY) or set RADIXSERVE_API_KEY") if not key else "unknown API key"
            )
        ns = self.tenants.namespace(tenant)
        return f"key:{tenant}", f"{ns}/{msg.namespace}" if msg.namespace else ns

    def on_generate(self, identity: bytes, msg: P.Generate) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            tenant, namespace = self.authorize(identity, msg)
            P.validate_generate(msg, self.config.limits)  # exactly one of prompt, token_ids
            msg.namespace = namespace
            if msg.prompt is not None:
                if self.tokenizer is None:
                    raise P.DecodeError("this router has no tokenizer; send token_ids", msg.id)
                self.check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self.transport.reply_error(identity, msg.id, exc.code, str(exc))
            return
        if msg.token_ids is not None:
            self._admit_generate(key, identity, msg, msg.token_ids, tenant)
        else:
            prompt = msg.prompt or ""  # validate_generate: exactly one of prompt, token_ids
            self._tokenize(
                key,
                identity,
                msg,
                lambda: (self.tokenizer.encode(prompt),),
                lambda ids: self._admit_generate(key, identity, msg, ids, tenant),
                len(prompt),
                tenant,
            )

    def check_prompt_chars(self, n: int) -> None:
        limit = self.prompt_char_limit()
        if n > limit:
            raise TooLongError("prompt", f"has {n} characters; no prompt longer than {limit} characters can fit the model's context")

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
            self.metrics.count("overloaded")
            self.transport.reply_error(identity, msg.id, P.OVERLOADED, f"{busy} long prompts are being tokenized ({mine} of them yours); retry later")
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.config.tokenize_threads, thread_name_prefix="tokenize")
        self._tokenizing[key] = False
        self._tokenizing_by[tenant] += 1
        future = asyncio.get_running_loop().run_in_executor(self._pool, compute)

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
                self.transport.reply_error(identity, msg.id, P.INTERNAL, f"tokenizing failed: {type(exc).__name__}: {exc}")
                return
            if aborted:
                self.transport.reply_error(identity, msg.id, P.BAD_REQUEST, "aborted by the client")
            elif self.dispatcher.shutting_down:
                self.transport.reply_error(identity, msg.id, P.SHUTTING_DOWN, "the router is shutting down; retry elsewhere")
            else:
                try:
                    then(*result)
                except Exception:  # a bug must not leave the call without a reply
                    log.exception("router failed admitting a tokenized request")
                    self.transport.reply_error(identity, msg.id, P.INTERNAL, "router error admitting the request")
                finally:
                    self.dispatcher.publish()

        future.add_done_callback(done)

    def _admit_generate(self, key, identity: bytes, msg: P.Generate, ids, tenant: str) -> None:
        try:
            check_prompt_tokens(ids, self.config.limits)
            if not ids:
                raise P.DecodeError("prompt tokenizes to nothing", msg.id)
        except RadixServeError as exc:
            self.transport.reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.metrics.count("requests")
        job = Job(
            n=self.jobs.number(),
            client=identity,
            cid=msg.id,
            token_ids=list(ids),
            params=msg.params,
            namespace=msg.namespace,
            stream=msg.stream,
            arrival=time.monotonic(),
            tenant=tenant,
        )
        self.dispatcher.admit(job)

    def on_choose(self, identity: bytes, msg: P.Choose) -> None:
        key = self._accepting(identity, msg)
        if key is None:
            return
        try:
            tenant, namespace = self.authorize(identity, msg)
            P.validate_choose(msg, self.config.limits)
            msg.namespace = namespace
            if self.tokenizer is None:
                raise P.DecodeError("this router has no tokenizer; choose needs one", msg.id)
            if msg.prompt is not None:
                self.check_prompt_chars(len(msg.prompt))
        except RadixServeError as exc:
            self.transport.reply_error(identity, msg.id, exc.code, str(exc))
            return
        tok = self.tokenizer

        def compute():
            ids = msg.token_ids if msg.token_ids is not None else tok.encode(msg.prompt)
            return ids, [tok.encode(c, add_special_tokens=False) for c in msg.choices]

        # The choices are tokenized with the prompt, off the loop when they are long together
        # (token_ids or a short prompt with megabytes of choices stalled the loop for seconds).
        chars = len(msg.prompt or "") + sum(map(len, msg.choices))
        self._tokenize(key, identity, msg, compute, lambda ids, cids: self._admit_choose(key, identity, msg, ids, cids, tenant), chars, tenant)

    def _admit_choose(self, key, identity: bytes, msg: P.Choose, ids, choice_ids, tenant: str) -> None:
        try:
            check_prompt_tokens(ids, self.config.limits)
            if not ids or not all(choice_ids):
                raise P.DecodeError("prompt or a choice tokenizes to nothing", msg.id)
            n = sum(map(len, choice_ids))
            limit, name = self.config.limits.max_choice_tokens, "max_choice_tokens"
            if 0 < self.registry.context() < limit:
                limit, name = self.registry.context(), "the model's context"
            if n > limit:  # every choice token is scored on top of the prompt: work like a prompt's
                raise TooLongError("choices", f"have {n} tokens in all; the limit is {limit} ({name}): send fewer or shorter choices")
        except RadixServeError as exc:
            self.transport.reply_error(identity, msg.id, exc.code, str(exc))
            return
        self.metrics.count("requests")
        self.metrics.count("choose_requests")
        job = Job(
            n=self.jobs.number(),
            client=identity,
            cid=msg.id,
            token_ids=list(ids),
            params=None,
            namespace=msg.namespace,
            stream=False,
            arrival=time.monotonic(),
            tenant=tenant,
            choose=dict(choices=msg.choices, choice_ids=choice_ids, normalize=msg.normalize, temperature=msg.temperature, seed=msg.seed),
        )
        self.dispatcher.admit(job)

    def on_abort(self, identity: bytes, msg: P.Abort) -> None:
        key = (identity, msg.id)
        if key in self._tokenizing:
            self._tokenizing[key] = True  # answered when tokenizing ends
            return
        job = self.jobs.get(key)
        if job is not None:
            self.dispatcher.abort(job)


def longest_token_chars(tokenizer, cap: int = 64) -> int:
    """Characters in the vocabulary's longest token (at least 4, at most ``cap``): a prompt of
    more than ``context x this`` characters cannot fit the context."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max(len(t) for t in vocab) if vocab else cap
    except Exception:
        longest = cap
    return max(4, min(cap, longest))
