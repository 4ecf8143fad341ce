"""The OpenAI response bodies as msgspec Structs (fields in OpenAI's order), and their builders
from the SDK's completions: usage, logprobs, choices, server-sent-event chunks."""

from __future__ import annotations

from typing import Any

import msgspec

UNSET = msgspec.UNSET


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Any
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = UNSET  # with return_token_ids


class AssistantMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = ""
    refusal: None = None
    tool_calls: list[dict[str, Any]] | msgspec.UnsetType = UNSET  # with tools, when the model called some


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: Any
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = UNSET


class DeltaChoice(msgspec.Struct):
    index: int
    delta: dict[str, Any]
    logprobs: Any
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = UNSET


class Response(msgspec.Struct):
    """A completion (``text_completion`` / ``chat.completion``) or one streamed chunk of one;
    ``usage`` is left out of chunks that carry none."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]  # TextChoice, ChatChoice or DeltaChoice
    system_fingerprint: None = None
    usage: Usage | msgspec.UnsetType = UNSET


def usage(outs: list, n: int) -> Usage:
    """Usage of ``outs`` (n choices per prompt, in order): each prompt counted once, its
    ``cached_tokens`` the smallest over its choices."""
    prompt = cached = completion = 0
    for start in range(0, len(outs), n):
        group = outs[start : start + n]
        prompt += group[0].usage.prompt_tokens
        cached += min(o.usage.cached_tokens for o in group)
        completion += sum(o.usage.completion_tokens for o in group)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, prompt_tokens_details={"cached_tokens": cached})


class TokenTexts:
    """Each token id's text and UTF-8 bytes (``str(id)`` without a tokenizer), decoded once.
    Logprobs name every token and up to 20 alternatives: decoding each anew (n 8 x 1,500 tokens x
    21) held the gateway's loop for seconds. The ids are the model's: at most its vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        known = self._known.get(token)
        if known is None:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)
            known = self._known[token] = (text, list(text.encode()))
        return known


class TopLogprob(msgspec.Struct, gc=False):
    """A chat token's alternative. Logprob Structs are never in a reference cycle: gc=False keeps
    the garbage collector off the hundreds of thousands a large response holds."""

    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(msgspec.Struct, gc=False):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


def logprobs(texts: TokenTexts, lps, chat: bool):
    """OpenAI logprobs object from the protocol's per-token (token_id, logprob, top) triples."""
    if not lps:
        return None
    lps = [(lp.token_id, lp.logprob, lp.top) if hasattr(lp, "token_id") else tuple(lp) for lp in lps]
    if chat:

        def alternative(token: int, logprob: float) -> TopLogprob:
            text, raw = texts(token)
            return TopLogprob(token=text, logprob=logprob, bytes=raw)

        content = []
        for token, logprob, top in lps:
            text, raw = texts(token)
            content.append(ChatLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=[alternative(a, b) for a, b in top]))
        return {"content": content, "refusal": None}
    return {
        "tokens": [texts(lp[0])[0] for lp in lps],
        "token_logprobs": [lp[1] for lp in lps],
        "top_logprobs": [{texts(a)[0]: b for a, b in lp[2]} for lp in lps],
        "text_offset": None,
    }


def _ids(token_ids) -> list[int] | msgspec.UnsetType:
    return UNSET if token_ids is None else list(token_ids)


def final_choice(index: int, out, lps, chat: bool, token_ids=None, tools=None):
    """The choice of a finished (non-streamed) completion (``token_ids``: with return_token_ids;
    ``tools``: a chat's :class:`~radixserve.tools.chat.ToolRequest`, whose calls are parsed out of
    the text: then ``content`` is None when the text held only calls, and ``finish_reason`` is
    ``tool_calls`` when it made some and stopped by itself)."""
    if chat:
        if tools is None:
            message = AssistantMessage(content=out.text)
            reason = out.finish_reason
        else:
            content, calls, reason = tools.parse(out.text, out.finish_reason)
            message = AssistantMessage(content=content, tool_calls=[c.as_openai() for c in calls] if calls else UNSET)
        return ChatChoice(index=index, message=message, logprobs=lps, finish_reason=reason, token_ids=_ids(token_ids))
    return TextChoice(index=index, text=out.text, logprobs=lps, finish_reason=out.finish_reason, token_ids=_ids(token_ids))


def chunk_choice(index: int, text: str | None, lps, finish_reason: str | None, chat: bool, token_ids=None, tool_calls: list[dict[str, Any]] | None = None):
    """A streamed choice: new text (``text``), new ``tool_calls`` deltas (chat with tools) and, with
    return_token_ids, its new ``token_ids``; or the end (``finish_reason``)."""
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return DeltaChoice(index=index, delta=delta, logprobs=lps, finish_reason=finish_reason, token_ids=_ids(token_ids))
    return TextChoice(index=index, text=text or "", logprobs=lps, finish_reason=finish_reason, token_ids=_ids(token_ids))


def role_choice(index: int) -> DeltaChoice:
    """Chat streams open each choice with the assistant's role."""
    return DeltaChoice(index=index, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)


def sse(data: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
