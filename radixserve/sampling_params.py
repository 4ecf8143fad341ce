"""Per-request sampling parameters (the names match vLLM's, which users already know)."""

from __future__ import annotations

import msgspec

from radixserve.engine.structured import StructuredOutput, as_structured
from radixserve.errors import BadRequestError


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to decode one request.

    ``temperature=0`` (or ``top_k=1``) is greedy. ``seed`` makes sampling reproducible for that
    request whatever else is in the batch. ``logprobs=n`` returns the chosen token's logprob and
    the top ``n`` alternatives at every step (``0``: only the chosen token's).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, any JSON object, regex or a list of choices);
    a plain dict of :class:`StructuredOutput` fields is accepted too."""

    MAX_LOGPROBS = 20
    MAX_TEMPERATURE = 100.0
    REPETITION_PENALTY_RANGE = (0.01, 100.0)

    def __post_init__(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            self.structured = as_structured(self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`BadRequestError` naming the first bad field and its limit."""

        def bad(field: str, msg: str) -> None:
            raise BadRequestError(field, msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= self.MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {self.MAX_TEMPERATURE:g}] (0 is greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            bad("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        lo, hi = self.REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            bad("repetition_penalty", f"must be in [{lo:g}, {hi:g}] (1 is off), got {self.repetition_penalty!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            bad("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                bad(name, f"must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.stop is not None:
            if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
                bad("stop", "must be at most 16 non-empty strings")
        for tid in self.stop_token_ids or ():
            if not 0 <= tid < vocab_size:
                bad("stop_token_ids", f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        if self.structured is not None:
            self.structured.validate()
