"""The OpenAI request bodies as msgspec Structs, and their conversion into SamplingParams.

Types and static ranges are constraints on the Structs (``Meta(ge=..., le=...)``, ``Literal``),
checked by ``msgspec.convert``; a failure becomes a 400 whose ``param`` names the field (the first
path component, or ``messages[i].role`` / ``messages[i].content`` inside ``messages``). What spans
fields (``best_of`` against ``n``, ``top_logprobs`` needing ``logprobs``) is checked after, in
:func:`sampling_params`; the result is validated once more by :meth:`SamplingParams.validate`. What
depends on the server's limits (``max_tokens`` against its cap, the stop strings) is checked once,
by the router (:func:`radixserve.limits.validate_generate`), and ``max_tokens`` against the context
by the engine (400 ``context_length_exceeded``): their errors come back as 400s naming the field.

Unknown top-level fields are ignored (like vLLM; each is listed in a response header by the app).
Known OpenAI fields this server cannot honour (``logit_bias``, ``suffix``, ``echo``,
``best_of != n``, ...) are refused with 400 naming the field rather than silently dropped.
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (and the deprecated ``functions`` /
``function_call``) are checked by :func:`radixserve.tools.chat.tool_request`, against the model's
chat template, in the app.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from radixserve.errors import BadRequestError
from radixserve.sampling_params import SamplingParams, StructuredOutput  # the type of SamplingParams.structured
from radixserve.serve.openai.errors import bad
from radixserve.tools.chat import ToolRequest, tool_request
from radixserve.validation import convert

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
REPETITION_PENALTY = SamplingParams.REPETITION_PENALTY_RANGE
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (OpenAI's, plus vLLM's extras)."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=SamplingParams.MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0: disabled
    min_p: Unit | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: PositiveInt | None = None
    best_of: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1])] | None = None
    user: str | None = None  # accepted and ignored: a client cannot choose its namespace
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    logit_bias: Any = None  # refused when given
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice (and streamed chunk) also carries its token_ids


class CompletionRequest(_Common, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of either."""

    prompt: str | list[Any] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Any = None  # refused when given
    echo: Any = None  # refused when true


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class Message(msgspec.Struct):
    role: Role
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None  # assistant: checked by radixserve.tools.chat.check_history
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None  # accepted and ignored (a tool message's name comes from its call)


class ChatRequest(_Common, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: Any = None  # checked by structured_output
    tools: Any = None  # these five: checked by radixserve.tools.chat.tool_request
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    modalities: Any = None
    metadata: Any = None  # the rest: accepted, nothing to do
    store: Any = None
    service_tier: Any = None
    reasoning_effort: Any = None


Request = CompletionRequest | ChatRequest
_AT = re.compile(r"(.*) - at `\$(.*)`$", re.S)
_MESSAGE_PARAM = re.compile(r"messages\[\d+\](?:\.(?:role|content|tool_calls|tool_call_id))?")


def _param(path: str) -> str | None:
    """The ``param`` of an error at msgspec's path (``.top_p``, ``.messages[0].content[1].type``)."""
    path = path.lstrip(".")
    m = _MESSAGE_PARAM.match(path)
    if m:
        return m.group(0)
    return re.split(r"[.\[]", path, maxsplit=1)[0] or None


def parse_request(body: dict, chat: bool) -> Request:
    """The request Struct of a decoded JSON body; 400 naming the first bad field."""
    try:
        return msgspec.convert(body, ChatRequest) if chat else msgspec.convert(body, CompletionRequest)
    except msgspec.ValidationError as exc:
        m = _AT.match(str(exc))
        if m is None:
            raise bad(None, str(exc)) from None
        raise bad(_param(m.group(2)), m.group(1)) from None


def known_fields(chat: bool) -> frozenset[str]:
    return frozenset((ChatRequest if chat else CompletionRequest).__struct_fields__)


def refuse_unsupported(req: Request) -> None:
    """Known OpenAI features this server cannot honour: refuse rather than ignore."""
    if req.logit_bias:
        raise bad("logit_bias", "is not supported by this server")
    if isinstance(req, ChatRequest):
        if req.modalities is not None and req.modalities != ["text"]:
            raise bad("modalities", 'only ["text"] is supported')
        return
    for name in ("suffix", "echo"):
        if getattr(req, name):
            raise bad(name, "is not supported by this server")


def chat_tools(req: ChatRequest, template: str | None) -> ToolRequest | None:
    """The request's tools, checked against the model's chat template (400 naming the field)."""
    try:
        return tool_request(template, req.tools, req.tool_choice, req.parallel_tool_calls, req.functions, req.function_call)
    except BadRequestError as exc:
        raise bad(exc.field, exc.message.split(": ", 1)[-1]) from None


def _response_format(rf: Any):
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format", 'json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return StructuredOutput(json_schema=schema)
    if kind != "text":
        raise bad("response_format", "type must be text, json_object or json_schema")
    return None


def structured_field(req: Request) -> str | None:
    """The name of the field that asked for structured output, if any."""
    if isinstance(req, ChatRequest) and req.response_format is not None and structured_output(req) is not None:
        return "response_format"
    return next((name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(req, name) is not None), None)


def structured_output(req: Request):
    """Structured output from OpenAI's ``response_format`` (chat: ``json_object``, ``json_schema``)
    or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` (both endpoints)."""
    found = []
    if isinstance(req, ChatRequest) and req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.guided_json is not None:
        found.append(("guided_json", StructuredOutput(json_schema=req.guided_json)))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput(choice=req.guided_choice)))
    if len(found) > 1:
        raise bad(found[1][0], "give only one of response_format, guided_json, guided_regex, guided_choice")
    return found[0][1] if found else None


def _max_tokens(req: Request) -> int | None:
    if isinstance(req, ChatRequest):  # OpenAI: chat defaults to "as many as fit" (None: the engine fills the context)
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return 16 if req.max_tokens is None else req.max_tokens  # OpenAI: completions default to 16 tokens


def max_tokens_field(req: Request) -> str:
    """The field that set ``max_tokens``: the router's error about it names that one."""
    return "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens is not None else "max_tokens"


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s] or None


def _logprobs(req: Request) -> int | None:
    """Chat: ``logprobs: bool`` + ``top_logprobs: 0..20``; completions: ``logprobs: 0..20``."""
    if not isinstance(req, ChatRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "requires logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


_COPIED = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop_token_ids", "ignore_eos")


def sampling_params(req: Request) -> tuple[SamplingParams, int]:
    """The validated SamplingParams of a request and its ``n`` (400 naming a bad field). The
    server's limits (``max_tokens``, stop strings) are the router's to check: its 400 comes back."""
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise bad("best_of", "is not supported (only best_of == n)")
    kw: dict[str, Any] = {name: getattr(req, name) for name in _COPIED if getattr(req, name) is not None}
    kw["max_tokens"] = _max_tokens(req)
    if req.top_k is not None:
        kw["top_k"] = -1 if req.top_k == 0 else req.top_k
    optional = {"stop": _stop(req.stop), "logprobs": _logprobs(req), "structured": structured_output(req)}
    kw.update({k: v for k, v in optional.items() if v is not None})
    try:  # the ranges are SamplingParams' own: what the Structs above leave open is refused here
        params = convert(kw, SamplingParams)
        params.validate(vocab_size=1 << 31)
    except BadRequestError as exc:
        raise bad(exc.field, exc.message.split(": ", 1)[-1]) from None
    return params, n
