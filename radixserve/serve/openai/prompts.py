"""Prompts of the OpenAI requests: completions' ``prompt`` forms, chat ``messages`` rendered with the
model's chat template and tokenized here (the router receives token ids). A chat with tools, or
with tool calls and results in its history, is made ready for the template by
:func:`radixserve.tools.chat.template_messages`."""

from __future__ import annotations

from typing import Any

from radixserve import protocol as P
from radixserve.errors import BadRequestError
from radixserve.serve.openai.errors import APIError, bad
from radixserve.serve.openai.schema import ChatRequest, CompletionRequest
from radixserve.tools.chat import ToolRequest, has_tool_history, template_messages


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: a string, token ids, or a list of either."""
    prompt = req.prompt
    if prompt is None:
        raise bad("prompt", "is required")
    if isinstance(prompt, str) or (prompt and _is_ids(prompt)):
        prompts = [prompt]
    elif prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    for p in prompts:
        if not p:
            raise bad("prompt", "is empty")
    return prompts


def chat_messages(req: ChatRequest, tokenizer, tools: ToolRequest | None = None) -> tuple[list[dict], dict[str, Any]]:
    """``(messages, apply_chat_template keyword arguments)`` as the chat template expects them (text
    parts joined, ``developer``: system; tools, tool calls and results: see :mod:`radixserve.tools.chat`)."""
    if not req.messages:
        raise bad("messages", "must be a non-empty list of messages")
    rendered: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        elif content is None:
            if m.role != "assistant":
                raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
            content = ""
        if m.tool_calls is not None and m.role != "assistant":
            raise bad(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        one: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            one["tool_calls"] = m.tool_calls
        if m.role == "tool":
            one["tool_call_id"] = m.tool_call_id
        rendered.append(one)
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        raise bad("messages", "this model has no chat template; use /v1/completions")
    if tools is None and not has_tool_history(rendered):
        return rendered, {}
    try:
        return template_messages(rendered, template, tools.tools if tools else None)
    except BadRequestError as exc:
        raise bad(exc.field, exc.message.split(": ", 1)[-1]) from None


def chat_chars(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> int:
    """About how many characters the rendered chat holds (its contents, calls and tools)."""
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(str(c)) for m in messages for c in m.get("tool_calls") or ())
    return chars + sum(len(str(t)) for t in kwargs.get("tools") or ())


def chat_ids(messages: list[dict[str, Any]], tokenizer, limits: P.Limits, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, ready for the assistant's turn.
    Several threads may call it at once with a tokenizer made :func:`~radixserve.serve.router.shareable`."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {}))
    except Exception as exc:  # template errors (e.g. roles must alternate) are the caller's
        raise bad("messages", f"the chat template refused them: {exc}") from None
    # Templates that write BOS themselves must not get a second one from the tokenizer.
    bos = getattr(tokenizer, "bos_token", None)
    ids = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
    if len(ids) > limits.max_prompt_tokens:
        raise APIError(400, f"messages: {len(ids)} tokens; the limit is {limits.max_prompt_tokens}", param="messages", code="context_length_exceeded")
    return ids
