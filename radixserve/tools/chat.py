"""A chat with tools, ready for the model: checked tools and choice (:class:`ToolRequest`), the
messages as the chat template wants them (:func:`template_messages`: assistant ``tool_calls`` and
``tool`` results), the grammar spec, and the output parsed back into calls. The HTTP gateway and the
SDK (:meth:`radixserve.client.AsyncClient.chat`) both use it.

Templates that take ``tools`` (Qwen2.5/3, Llama 3.x, Mistral, Hermes ...) get them as
``apply_chat_template(..., tools=[...])`` and the history as HF's convention has it (an assistant
message's ``tool_calls`` with their ``arguments`` as objects; ``tool`` messages with their
``tool_call_id`` and ``name``). Templates that do not (SmolLM2's among them) get the **fallback**:

- :data:`FALLBACK_PROMPT` with the tools (one JSON object per line) is added to the system message
  (a system message holding only it comes first when the chat has none);
- an assistant message's calls are written after its content as the hermes format writes them
  (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, the arguments text as sent), so a
  follow-up turn repeats the tokens the model wrote and its prefix stays cached;
- ``tool`` results become a ``user`` message of ``<tool_response>\\n...\\n</tool_response>`` blocks
  (consecutive results in one message), for templates that know no ``tool`` role.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.errors import BadRequestError
from radixserve.tools.formats import HERMES, CallFormat, detect_format, takes_tools
from radixserve.tools.parser import CallStream, ToolCall, parse_calls
from radixserve.tools.spec import Tool, ToolCallsSpec, ToolChoice, check_tool_choice, check_tools, legacy_functions, tool_calls_spec

FALLBACK_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked, in the call format of the model's chat template."""

    fmt: CallFormat
    native: bool  # the template renders the tools itself (else the fallback prompt)
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True

    @property
    def spec(self) -> ToolCallsSpec:
        """The grammar of the output (``SamplingParams.structured.tool_calls``)."""
        return tool_calls_spec(self.fmt.name, self.tools, self.choice, self.parallel)

    @property
    def parses(self) -> bool:
        """Whether the output is read for calls (not with ``tool_choice: "none"``)."""
        return self.choice.mode != "none"

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """``(content, calls, finish_reason)`` of a finished output: ``tool_calls`` replaces
        ``stop`` when it made calls."""
        if not self.parses:
            return text, [], finish_reason
        content, calls = parse_calls(self.fmt, text, cut_off=finish_reason == "length")
        return content, calls, ("tool_calls" if calls and finish_reason == "stop" else finish_reason)

    def stream(self) -> CallStream:
        return CallStream(self.fmt)


def tool_request(
    template: str | None, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None, functions: Any = None, function_call: Any = None
) -> ToolRequest | None:
    """The checked tools of a chat request (OpenAI's fields; ``functions`` / ``function_call`` are
    the deprecated spelling), or None without tools. :class:`BadRequestError` naming the field."""
    field = "tools"
    if functions is not None:
        if tools is not None:
            raise BadRequestError("functions", "give tools or functions, not both")
        tools, tool_choice = legacy_functions(functions, function_call if tool_choice is None else tool_choice)
        field = "functions"
    elif function_call is not None:
        raise BadRequestError("function_call", "needs functions (or use tools and tool_choice)")
    if tools is None:
        if tool_choice not in (None, "none"):
            raise BadRequestError("tool_choice", "needs tools")
        return None
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise BadRequestError("parallel_tool_calls", "must be true or false")
    checked = check_tools(tools, field)
    choice = check_tool_choice(tool_choice, checked, "function_call" if field == "functions" else "tool_choice")
    return ToolRequest(detect_format(template), takes_tools(template), checked, choice, parallel_tool_calls is not False)


def check_history(messages: list[dict[str, Any]]) -> dict[str, str]:
    """Check the assistant ``tool_calls`` and ``tool`` messages of a chat; returns call id ->
    function name. Every ``tool`` message must answer a call id of an earlier assistant message."""
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant":
                raise BadRequestError(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
            for j, c in enumerate(calls):
                here = f"messages[{i}].tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not c["id"]:
                    raise BadRequestError(here, 'must be {"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}')
                if not isinstance(fn.get("name"), str):
                    raise BadRequestError(f"{here}.function.name", "must be a string")
                try:
                    json.loads(fn["arguments"])
                except (KeyError, TypeError, ValueError):
                    raise BadRequestError(f"{here}.function.arguments", "must be a string of JSON") from None
                names[c["id"]] = fn["name"]
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in names:
                raise BadRequestError(f"messages[{i}].tool_call_id", f"{cid!r} answers no tool call of an earlier assistant message")
    return names


def _calls_of(m: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]


def template_messages(messages: list[dict[str, Any]], template: str | None, tools: list[Tool] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, apply_chat_template keyword arguments)`` for the chat template: the history's
    calls and results in the template's convention or the fallback's (module docstring). Messages
    are OpenAI's (``content`` a string or None); :func:`check_history` is applied first."""
    names = check_history(messages)
    if takes_tools(template):
        out = []
        for m in messages:
            m2: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
            if m.get("tool_calls"):
                m2["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ]
            if m["role"] == "tool":
                m2.update(tool_call_id=m["tool_call_id"], name=names[m["tool_call_id"]])
            out.append(m2)
        return out, ({"tools": [t.as_openai() for t in tools]} if tools else {})
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        calls = _calls_of(m)
        if calls:
            content = (content + "\n" if content else "") + HERMES.calls_text(calls)
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("_tool", None)
    if tools:
        prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def has_tool_history(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def render_chat(
    tokenizer, messages: list[dict[str, Any]], tools: Any = None, tool_choice: Any = None, parallel_tool_calls: Any = None
) -> tuple[str, ToolRequest | None]:
    """``(prompt text, tools)``: OpenAI-style ``messages`` (with ``tool_calls`` / ``tool`` messages)
    and ``tools`` through ``tokenizer``'s chat template, ready for the assistant's turn (the SDK's
    path; the gateway tokenizes the same messages itself)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequestError("messages", "this model has no chat template")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadRequestError("messages", 'must be a non-empty list of {"role": ..., "content": ...}')
    req = tool_request(template, tools, tool_choice, parallel_tool_calls)
    if req is not None or has_tool_history(messages):
        msgs, kwargs = template_messages(messages, template, req.tools if req else None)
    else:
        msgs, kwargs = messages, {}
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as exc:  # template errors (e.g. roles must alternate) are the caller's
        raise BadRequestError("messages", f"the chat template refused them: {exc}") from None
    return text, req
