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
    content: str = ""
    refusal: None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: Any
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = UNSET


class DeltaChoice(msgspec.Struct):
    index: int
    delta: dict[str, str]
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
        group = outs[start:start + n]
        prompt += group[0].usage.prompt_tokens
        cached += min(o.usage.cached_tokens for o in group)
        completion += sum(o.usage.completion_tokens for o in group)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def logprobs(tokenizer, lps, chat: bool):
    """OpenAI logprobs object from the protocol's per-token (token_id, logprob, top) triples."""
    if not lps:
        return None

    def text(t):
        return tokenizer.decode([t]) if tokenizer is not None else str(t)

    lps = [(lp.token_id, lp.logprob, lp.top) if hasattr(lp, "token_id") else tuple(lp) for lp in lps]
    if chat:
        return {"content": [{"token": text(lp[0]), "logprob": lp[1], "bytes": list(text(lp[0]).encode()),
                             "top_logprobs": [{"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                                              for a, b in lp[2]]} for lp in lps], "refusal": None}
    return {"tokens": [text(lp[0]) for lp in lps], "token_logprobs": [lp[1] for lp in lps],
            "top_logprobs": [{text(a): b for a, b in lp[2]} for lp in lps], "text_offset": None}


def _ids(token_ids) -> list[int] | msgspec.UnsetType:
    return UNSET if token_ids is None else list(token_ids)


def final_choice(index: int, out, lps, chat: bool, token_ids=None):
    """The choice of a finished (non-streamed) completion (``token_ids``: with return_token_ids)."""
    if chat:
        return ChatChoice(index=index, message=AssistantMessage(content=out.text), logprobs=lps,
                          finish_reason=out.finish_reason, token_ids=_ids(token_ids))
    return TextChoice(index=index, text=out.text, logprobs=lps, finish_reason=out.finish_reason, token_ids=_ids(token_ids))


def chunk_choice(index: int, text: str | None, lps, finish_reason: str | None, chat: bool, token_ids=None):
    """A streamed choice: new text (``text``) and, with return_token_ids, its new ``token_ids``;
    or the end (``finish_reason``, ``text`` None)."""
    if chat:
        return DeltaChoice(index=index, delta={} if text is None else {"content": text}, logprobs=lps,
                           finish_reason=finish_reason, token_ids=_ids(token_ids))
    return TextChoice(index=index, text=text or "", logprobs=lps, finish_reason=finish_reason, token_ids=_ids(token_ids))


def role_choice(index: int) -> DeltaChoice:
    """Chat streams open each choice with the assistant's role."""
    return DeltaChoice(index=index, delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None)


def sse(data: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
