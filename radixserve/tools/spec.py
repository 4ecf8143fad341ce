"""Tool definitions (OpenAI's ``tools`` / ``tool_choice`` shapes), checked once and bounded, and the
grammar spec a tool-calling request carries to the worker (:class:`ToolCallsSpec`).

Bounds (like every other size a client controls): at most :data:`MAX_TOOLS` tools, whose JSON
(names, descriptions, parameter schemas) is at most :data:`MAX_TOOLS_CHARS` characters; a tool name
is 1-64 of ``[A-Za-z0-9_-]`` (OpenAI's rule), and names are unique. A tool's ``parameters`` must be a
JSON-schema object (``{"type": "object", ...}``); a missing one means "no arguments" (``{}``).
Every refusal is a :class:`~radixserve.errors.BadRequestError` naming the field
(``tools[2].function.parameters``, ``tool_choice``, ...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from radixserve.errors import BadRequestError

MAX_TOOLS = 128
MAX_TOOLS_CHARS = 64 * 1024
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FORMATS = ("hermes", "llama3", "mistral")
Format = Literal["hermes", "llama3", "mistral"]
Mode = Literal["auto", "required", "none"]


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI shape (``{"type": "function", "function": {...}}``), for chat templates."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``: ``mode`` none / auto / required, and for a named function
    (``{"type": "function", "function": {"name": ...}}``) mode ``required`` with ``name`` set."""

    mode: Mode = "auto"
    name: str | None = None


def _check_parameters(params: Any, field: str) -> dict[str, Any]:
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadRequestError(field, f"must be a JSON schema object, got {type(params).__name__}")
    kind = params.get("type", "object")
    if kind != "object":
        raise BadRequestError(field, f'must be a JSON schema of type "object" (a tool\'s arguments are a JSON object), got type {kind!r}')
    return params


def check_tools(tools: Any, field: str = "tools") -> list[Tool]:
    """The tools of a request in OpenAI's shape (``[{"type": "function", "function": {"name",
    "description", "parameters"}}]``); :class:`BadRequestError` naming the first bad field."""
    if not isinstance(tools, list) or not tools:
        raise BadRequestError(field, 'must be a non-empty list of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise BadRequestError(field, f"at most {MAX_TOOLS} tools, got {len(tools)}")
    chars = len(json.dumps(tools, separators=(",", ":")))
    if chars > MAX_TOOLS_CHARS:
        raise BadRequestError(field, f"must be at most {MAX_TOOLS_CHARS} characters of JSON in all, got {chars}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        here = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise BadRequestError(here, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}} (only function tools are supported)')
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BadRequestError(f"{here}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
        if any(o.name == name for o in out):
            raise BadRequestError(f"{here}.function.name", f"{name!r} is given twice; tool names must be unique")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise BadRequestError(f"{here}.function.description", "must be a string")
        out.append(Tool(name, _check_parameters(fn.get("parameters"), f"{here}.function.parameters"), desc))
    return out


def check_tool_choice(choice: Any, tools: list[Tool], field: str = "tool_choice") -> ToolChoice:
    """``none`` / ``auto`` (the default) / ``required`` / ``{"type": "function", "function":
    {"name": N}}`` with N one of ``tools``."""
    if choice is None or choice == "auto":
        return ToolChoice("auto")
    if choice in ("none", "required"):
        return ToolChoice(choice)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadRequestError(field, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if not any(t.name == name for t in tools):
        raise BadRequestError(field, f"names function {name!r}, which is not in tools ({', '.join(t.name for t in tools)})")
    return ToolChoice("required", name)


def legacy_functions(functions: Any, function_call: Any) -> tuple[list[dict], Any]:
    """OpenAI's deprecated ``functions`` / ``function_call`` as ``tools`` / ``tool_choice``."""
    if not isinstance(functions, list):
        raise BadRequestError("functions", 'must be a list of {"name": ..., "parameters": {...}}')
    tools = [{"type": "function", "function": f} for f in functions]
    choice = function_call
    if isinstance(function_call, dict):
        choice = {"type": "function", "function": {"name": function_call.get("name")}}
    return tools, choice


class ToolSchema(msgspec.Struct, forbid_unknown_fields=True):
    """A tool as the grammar sees it: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any]


class ToolCallsSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Constrain a request's output to tool calls in one model family's format
    (:mod:`radixserve.tools.formats`): ``mode`` ``required`` (one or more calls, nothing else; one
    tool for a named function), ``auto`` (free text; a call, once opened, follows the grammar) or
    ``none`` (free text that never opens a call). ``parallel`` False allows at most one call."""

    format: Format
    tools: list[ToolSchema]
    mode: Mode = "auto"
    parallel: bool = True

    def validate(self) -> None:
        """Shape and size checks (the schemas themselves are checked when compiled)."""
        field = "structured.tool_calls"
        if self.format not in FORMATS:
            raise BadRequestError(f"{field}.format", f"must be one of {', '.join(FORMATS)}")
        if not 0 < len(self.tools) <= MAX_TOOLS:
            raise BadRequestError(f"{field}.tools", f"must hold 1..{MAX_TOOLS} tools")
        if len(self.text) > MAX_TOOLS_CHARS:
            raise BadRequestError(f"{field}.tools", f"must be at most {MAX_TOOLS_CHARS} characters of JSON")
        for i, t in enumerate(self.tools):
            if not _NAME.fullmatch(t.name):
                raise BadRequestError(f"{field}.tools[{i}].name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
            _check_parameters(t.parameters, f"{field}.tools[{i}].parameters")

    @property
    def text(self) -> str:
        """Canonical JSON (what identifies the compiled grammar)."""
        return msgspec.json.encode(self).decode()


def tool_calls_spec(fmt: str, tools: list[Tool], choice: ToolChoice, parallel: bool = True) -> ToolCallsSpec:
    """The grammar spec of a checked request (a named function keeps only that tool)."""
    chosen = [t for t in tools if choice.name is None or t.name == choice.name]
    return ToolCallsSpec(
        format=fmt,  # type: ignore[arg-type]
        tools=[ToolSchema(t.name, t.parameters) for t in chosen],
        mode=choice.mode,
        parallel=parallel,
    )
