"""Per-request sampling parameters (the names match vLLM's, which users already know).

Every range lives in the field's annotation (``msgspec.Meta``), so the same constraints hold when
a wire message or an HTTP body is decoded into these Structs and when :meth:`SamplingParams.validate`
checks one built with keyword arguments (:mod:`radixserve.validation`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from radixserve.errors import BadRequestError
from radixserve.tools.spec import ToolCallsSpec
from radixserve.validation import check

MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays of a JSON schema (deeper ones broke json.dumps: RecursionError)
MAX_REGEX_CHARS = 4096
MAX_GRAMMAR_CHOICES = 4096
MAX_GRAMMAR_CHOICE_CHARS = 256
MAX_GRAMMAR_CHOICES_CHARS = 256 * 1024


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Constrain a request's output to one grammar; give exactly one field.

    * ``json_schema``: a JSON schema (object or its JSON text); the output is compact JSON that
      validates against it.
    * ``json_object=True``: any JSON object.
    * ``regex``: the whole output matches this regular expression.
    * ``choice``: the output is exactly one of these strings.
    * ``tool_calls``: tool calls in a model family's format, each call's arguments valid against its
      tool's schema (:class:`~radixserve.tools.spec.ToolCallsSpec`; built by
      :mod:`radixserve.tools.chat` from OpenAI's ``tools`` / ``tool_choice``).

    This is the request's spec only; :mod:`radixserve.engine.structured` compiles it.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    tool_calls: ToolCallsSpec | None = None

    @property
    def kind(self) -> str:
        for name in ("json_schema", "regex", "choice", "tool_calls"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """Shape and size checks (the grammar itself is checked when it is compiled)."""
        given = [n for n in ("json_schema", "regex", "choice", "tool_calls") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise BadRequestError(
                "structured", "give exactly one of json_schema, json_object=True, regex, choice or tool_calls" + (f", got {', '.join(given)}" if given else "")
            )
        if self.json_schema is not None:
            depth = json_depth(self.json_schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise BadRequestError(
                    "structured.json_schema", f"nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} levels of objects and arrays are accepted"
                )
            if len(self.schema_text) > MAX_SCHEMA_CHARS:
                raise BadRequestError("structured.json_schema", f"must be at most {MAX_SCHEMA_CHARS} characters of JSON")
        if self.regex is not None and not 0 < len(self.regex) <= MAX_REGEX_CHARS:
            raise BadRequestError("structured.regex", f"must be 1..{MAX_REGEX_CHARS} characters")
        if self.choice is not None:
            c = self.choice
            if not 0 < len(c) <= MAX_GRAMMAR_CHOICES or any(not isinstance(s, str) or not 0 < len(s) <= MAX_GRAMMAR_CHOICE_CHARS for s in c):
                raise BadRequestError("structured.choice", f"must hold 1..{MAX_GRAMMAR_CHOICES} strings of 1..{MAX_GRAMMAR_CHOICE_CHARS} characters")
            if sum(map(len, c)) > MAX_GRAMMAR_CHOICES_CHARS:
                raise BadRequestError("structured.choice", f"must be at most {MAX_GRAMMAR_CHOICES_CHARS} characters in all")
        if self.tool_calls is not None:
            self.tool_calls.validate()

    @property
    def schema_text(self) -> str:
        s = self.json_schema
        return s if isinstance(s, str) else json.dumps(s, separators=(",", ":"))  # key order matters: kept

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (for the cache)."""
        if self.json_schema is not None:  # the order of :attr:`kind`
            return "json_schema", self.schema_text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", "\x00".join(self.choice)
        if self.tool_calls is not None:
            return "tool_calls", self.tool_calls.text
        return self.kind, ""


def json_depth(value: Any, stop: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """How deep dicts and lists nest in ``value`` (JSON text: its brackets outside strings),
    counted without recursion, up to ``stop`` (then it stops looking)."""
    if isinstance(value, str):
        depth = deepest = 0
        in_string = escaped = False
        for ch in value:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if deepest >= stop:
                        return deepest
            elif ch in "]}":
                depth -= 1
        return deepest
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        node, depth = todo.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest >= stop:
            return deepest
        todo.extend((child, depth + 1) for child in children)
    return deepest


def as_structured(value) -> StructuredOutput | None:
    """Accept a :class:`StructuredOutput`, or a plain dict of its fields (SDK convenience)."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, StructuredOutput)
        except msgspec.ValidationError as exc:
            raise BadRequestError("structured", f"{exc}") from None
    raise BadRequestError("structured", f"must be a StructuredOutput or a dict, got {type(value).__name__}")


MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to decode one request.

    ``temperature=0`` (or ``top_k=1``) is greedy. ``seed`` makes sampling reproducible for that
    request whatever else is in the batch. ``logprobs=n`` returns the chosen token's logprob and
    the top ``n`` alternatives at every step (``0``: only the chosen token's).
    """

    max_tokens: Annotated[int, Meta(ge=1, description="most tokens to generate")] | None = 16
    """None: until the context is full. Set, the prompt plus it must fit the model's context, or the
    request is refused (``TooLongError``, HTTP 400 ``context_length_exceeded``), as vLLM does."""
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE, description="0 is greedy")] = 1.0
    top_k: Annotated[int, Meta(ge=-1, description="-1 (disabled) or >= 1")] = -1
    top_p: Annotated[float, Meta(gt=0.0, le=1.0, description="nucleus sampling mass, in (0, 1]")] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0, description="in [0, 1]")] = 0.0
    seed: int | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16, description="at most 16 non-empty strings")] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="top alternatives per token")] | None = None
    repetition_penalty: Annotated[float, Meta(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1], description="1 is off")] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0, description="in [-2, 2]")] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0, description="in [-2, 2]")] = 0.0
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (JSON schema, any JSON object, regex or a list of choices);
    a plain dict of :class:`StructuredOutput` fields is accepted too."""

    MAX_LOGPROBS = MAX_LOGPROBS
    MAX_TEMPERATURE = MAX_TEMPERATURE
    REPETITION_PENALTY_RANGE = REPETITION_PENALTY_RANGE

    def __post_init__(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            self.structured = as_structured(self.structured)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`BadRequestError` naming the first bad field and its limit: the annotated
        constraints (types, ranges, lengths), then what an annotation cannot say."""
        check(self)
        if self.top_k == 0:
            raise BadRequestError("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # msgspec cannot bound past int64
            raise BadRequestError("seed", f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        for tid in self.stop_token_ids or ():
            if not 0 <= tid < vocab_size:
                raise BadRequestError("stop_token_ids", f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        if self.structured is not None:
            self.structured.validate()
