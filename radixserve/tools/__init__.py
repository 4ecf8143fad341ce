"""Tool calling (OpenAI's ``tools``): checked tool definitions and the grammar spec
(:mod:`.spec`), the model families' call formats and their grammar (:mod:`.formats`), parsing calls
out of text, whole or streamed (:mod:`.parser`), and a chat with tools made ready for a chat
template (:mod:`.chat`). Shared by the HTTP gateway and the SDK."""

from radixserve.tools.chat import FALLBACK_PROMPT, ToolRequest, template_messages, tool_request
from radixserve.tools.formats import FORMATS, CallFormat, detect_format
from radixserve.tools.parser import CallStream, ToolCall, parse_calls
from radixserve.tools.spec import MAX_TOOLS, MAX_TOOLS_CHARS, Tool, ToolCallsSpec, ToolChoice, ToolSchema

__all__ = [
    "FALLBACK_PROMPT",
    "FORMATS",
    "MAX_TOOLS",
    "MAX_TOOLS_CHARS",
    "CallFormat",
    "CallStream",
    "Tool",
    "ToolCall",
    "ToolCallsSpec",
    "ToolChoice",
    "ToolRequest",
    "ToolSchema",
    "detect_format",
    "parse_calls",
    "template_messages",
    "tool_request",
]
