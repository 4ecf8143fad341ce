"""A request's lifecycle state and the result handed back to users."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import msgspec
import torch

from radixserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n alternatives (token id, logprob), best first


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


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Hashable = None
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    generator: torch.Generator | None = None
    stream: bool = False  # detokenize every step (streaming consumers, stop strings)
    grammar: Any = None  # structured output: the request's xgrammar GrammarMatcher (see engine/structured.py)
    pin: bool = False  # on finish, keep the prompt's KV locked in the cache (Engine.pin)
    # Scoring mode (Engine.choose): no sampling; the request ends right after its prefill with the
    # logprob of every token at positions score_from .. end-1 (score_from == len: prefill only).
    score_from: int | None = None
    score_logprobs: list[float | None] = field(default_factory=list)

    # KV state. pages[: cached_len // page_size] belong to the radix tree and are locked through
    # `node`; the rest are owned by this request. KV of tokens[: computed] is in the pages.
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    cached_len: int = 0
    node: Any = None

    cached_tokens: int | None = None  # prefix hit at first admission
    admit_seq: int = 0  # admission order among running requests (preemption picks the newest)
    arrival_seq: int = 0  # arrival order at the scheduler
    overtaken: int = 0  # later arrivals admitted ahead of this request while it waited (aging)
    preemptions: int = 0
    first_scheduled: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    text: str = ""  # detokenized output, stop strings applied
    emitted_tokens: int = 0  # how many output tokens were streamed out
    emitted_chars: int = 0
    stop_at_char: int | None = None

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_ids)  # prompt + output, kept so hot paths never concatenate

    @property
    def tokens(self) -> list[int]:
        """Prompt and output tokens so far (read-only: use :meth:`append`)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self._tokens.append(token)

    @property
    def scoring(self) -> bool:
        return self.score_from is not None

    @property
    def match_limit(self) -> int:
        """Longest prefix the cache may serve: never the last token (its logits are needed), and
        for a scoring request never a scored position (their logits rows must be computed)."""
        if self.score_from is None:
            return self.num_tokens - 1
        return min(self.num_tokens - 1, self.score_from - 1)

    @property
    def pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.num_tokens - self.computed

    @property
    def prefilling(self) -> bool:
        return self.pending > 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def to_output(self) -> RequestOutput:
        now = self.finished_at or time.monotonic()
        start = self.first_scheduled or now
        return RequestOutput(
            request_id=self.rid,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text,
            prompt_tokens=len(self.prompt_ids),
            cached_tokens=self.cached_tokens or 0,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            queue_s=start - self.arrival,
            ttft_s=(self.first_token_at or now) - self.arrival,
            e2e_s=now - self.arrival,
            score_logprobs=[float(x) for x in self.score_logprobs] if self.scoring else None,
        )
