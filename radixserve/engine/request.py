"""A request inside the engine (its typed parts) and the results handed back to users."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from radixserve.errors import BadRequestError, InvariantError, TooLongError
from radixserve.protocol import TokenLogprob  # a wire type: the engine's chunks carry it as they are
from radixserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one request produced. ``cached_tokens`` counts prompt tokens served from the prefix
    cache at admission (0 when none); recomputation after preemption never counts."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None  # stop | length | abort | error
    logprobs: list[TokenLogprob] | None = None
    queue_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    error: str | None = None
    score_logprobs: list[float] | None = None  # scoring requests: logprob of each scored token


class StreamChunk(msgspec.Struct, kw_only=True):
    """New tokens of a running request; the final chunk carries ``output``."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.output is not None


def check_prompt_ids(ids: list[int], given: bool, vocab_size: int, max_model_len: int, capacity_tokens: int) -> None:
    """Refuse an empty prompt (``given``: the caller's prompt was non-empty), token ids outside
    the vocabulary, and a prompt that leaves no room to generate."""
    if not ids or not given:
        raise BadRequestError("prompt", "is empty")
    # Every id a plain int (the common case): min and max bound them all, at C speed (a prompt of
    # 2,176 ids took 180 us in a generator, 105 us so). Anything else (bools, strings, floats) is
    # checked one by one.
    plain = set(map(type, ids)) == {int}
    if not plain or min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError("prompt", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    limit, what = _room(max_model_len, capacity_tokens)
    if len(ids) >= limit:
        raise TooLongError("prompt", f"has {len(ids)} tokens; the {what} holds {limit}, leaving no room to generate")


def fit_max_tokens(params: SamplingParams, prompt_tokens: int, max_model_len: int, capacity_tokens: int) -> SamplingParams:
    """The rule for ``max_tokens`` everywhere (CLI, SDK, HTTP all reach the engine here), as vLLM's:
    unset (None) generates until the context is full; set, the prompt plus it must fit the context
    (and the KV pool), else :class:`TooLongError` with the numbers. Never clipped silently."""
    limit, what = _room(max_model_len, capacity_tokens)
    if params.max_tokens is None:
        return msgspec.structs.replace(params, max_tokens=limit - prompt_tokens)
    if prompt_tokens + params.max_tokens > limit:
        raise TooLongError(
            "max_tokens",
            f"{params.max_tokens} + {prompt_tokens} prompt tokens exceeds the {what} ({limit} tokens); at most {limit - prompt_tokens} fit after this prompt",
        )
    return params


def _room(max_model_len: int, capacity_tokens: int) -> tuple[int, str]:
    """The most tokens one request can hold (prompt and output), and what bounds it, in words."""
    limit = min(max_model_len, capacity_tokens)
    return limit, "model's context" if limit == max_model_len else "KV pool (raise kv_cache_tokens)"


@dataclass(frozen=True, slots=True)
class RequestInput:
    """What the caller asked for; never changes."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None


@dataclass(eq=False, slots=True)
class DecodeSettings:
    """How tokens are chosen and when the request ends, beyond its SamplingParams; set before
    the request is queued."""

    generator: torch.Generator | None = None
    grammar: Any = None  # structured output: the request's xgrammar GrammarMatcher (see engine/structured.py)
    stream: bool = False  # detokenize every step (streaming consumers, stop strings)
    pin: bool = False  # on finish, keep the prompt's KV locked in the cache (Engine.pin)
    # Scoring mode (Engine.choose): no sampling; the request ends right after its prefill with the
    # logprob of every token at positions score_from .. end-1 (score_from == len: prefill only).
    score_from: int | None = None


@dataclass(eq=False, slots=True)
class OutputState:
    """What the request produced so far, and how much of it was streamed out."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    score_logprobs: list[float | None] = field(default_factory=list)
    text: str = ""  # detokenized output, stop strings applied
    emitted_tokens: int = 0  # how many output tokens were streamed out
    emitted_chars: int = 0
    finish_reason: str | None = None
    decoded_tokens: int = 0  # output_ids[:decoded_tokens] detokenize to decoded_text, whole characters
    decoded_text: str = ""


@dataclass(eq=False, slots=True)
class KVState:
    """The request's KV. ``pages[: cached_len // page_size]`` belong to the radix tree and are
    locked through ``node``; the rest are owned by the request. KV of tokens[: computed] is in
    the pages."""

    pages: list[int] = field(default_factory=list)
    computed: int = 0
    cached_len: int = 0
    node: Any = None
    cached_tokens: int | None = None  # prefix hit at first admission


@dataclass(eq=False, slots=True)
class Lifecycle:
    """Where the request is in the scheduler, and when things happened (monotonic seconds)."""

    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # arrival order at the scheduler
    admit_seq: int = 0  # admission order among running requests (preemption picks the newest)
    overtaken: int = 0  # later arrivals admitted ahead of this request while it waited (aging)
    preemptions: int = 0
    first_scheduled: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class Request:
    """One request inside the engine, in typed parts: :attr:`input` (immutable), :attr:`decode`
    (sampling and stop settings), :attr:`out` (output state), :attr:`kv` (KV and cache state),
    :attr:`life` (scheduling and timing). Each field has one name, through its part
    (``req.input.rid``, ``req.kv.pages``); the request itself adds only what spans parts."""

    __slots__ = ("input", "decode", "out", "kv", "life", "_tokens")

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: Hashable = None,
        *,
        generator: torch.Generator | None = None,
        grammar: Any = None,
        stream: bool = False,
        pin: bool = False,
        score_from: int | None = None,
    ):
        self.input = RequestInput(rid, prompt_ids, params, namespace)
        self.decode = DecodeSettings(generator, grammar, stream, pin, score_from)
        self.out = OutputState()
        self.kv = KVState()
        self.life = Lifecycle()
        self._tokens = list(prompt_ids)  # prompt + output, kept so hot paths never concatenate

    def __repr__(self) -> str:
        return f"Request({self.input.rid!r}, {self.life.status.value}, tokens={self.num_tokens}, computed={self.kv.computed})"

    @property
    def tokens(self) -> list[int]:
        """Prompt and output tokens so far (read-only: use :meth:`append`)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        self.out.output_ids.append(token)
        self._tokens.append(token)

    @property
    def scoring(self) -> bool:
        return self.decode.score_from is not None

    @property
    def match_limit(self) -> int:
        """Longest prefix the cache may serve: never the last token (its logits are needed), and
        for a scoring request never a scored position (their logits rows must be computed)."""
        score_from = self.decode.score_from
        if score_from is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, score_from - 1)

    @property
    def pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return len(self._tokens) - self.kv.computed

    @property
    def prefilling(self) -> bool:
        return self.pending > 1

    @property
    def finished(self) -> bool:
        return self.life.status is Status.FINISHED

    def to_output(self) -> RequestOutput:
        inp, life, out = self.input, self.life, self.out
        now = life.finished_at or time.monotonic()
        start = life.first_scheduled or now
        return RequestOutput(
            request_id=inp.rid,
            prompt_token_ids=inp.prompt_ids,
            token_ids=list(out.output_ids),
            text=out.text,
            prompt_tokens=len(inp.prompt_ids),
            cached_tokens=self.kv.cached_tokens or 0,
            finish_reason=out.finish_reason,
            logprobs=out.logprobs,
            queue_s=start - life.arrival,
            ttft_s=(life.first_token_at or now) - life.arrival,
            e2e_s=now - life.arrival,
            score_logprobs=_scored(inp.rid, out.score_logprobs) if self.scoring else None,
        )


def _scored(rid: str, values: list[float | None]) -> list[float]:
    """The logprobs of a finished scoring request: every scored position has one by then."""
    if any(x is None for x in values):
        raise InvariantError(f"scoring request {rid} finished with {values.count(None)} positions unscored")
    return [float(x) for x in values if x is not None]
