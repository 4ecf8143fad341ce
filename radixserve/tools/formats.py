"""The tool-call formats of the model families, chosen from the chat template, and the grammar
(an xgrammar structural tag) that makes a model write them.

=========  ==========================================================================  ==========
format     a call, as the grammar writes it                                            models
=========  ==========================================================================  ==========
hermes     ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one per   Qwen2.5/3,
           call, separated by ``\\n``                                                   Hermes,
                                                                                       SmolLM3,
                                                                                       fallback
llama3     ``{"name": "f", "parameters": {...}}``, separated by ``; ``                 Llama 3.x
mistral    ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``                   Mistral
=========  ==========================================================================  ==========

:func:`detect_format` reads the chat template: one that never mentions ``tools`` gets the
documented fallback (:data:`radixserve.tools.chat.FALLBACK_PROMPT`: the tools listed in the system
prompt, calls in the hermes format); one that takes tools in a format not in this table is refused
with an error that names the three formats.

:func:`structural_tag` builds the grammar: each tool's call is a tag whose begin fixes the name and
whose content is the tool's ``parameters`` schema as compact JSON (the same EBNF as
``response_format``'s, :func:`radixserve.ebnf.json_schema_ebnf`). ``required`` admits
only calls (one or more; one with ``parallel`` False); ``auto`` admits free text, and once the text
opens a call (the format's ``trigger``) the call follows the grammar to its end; ``none`` admits
free text that never opens a call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixserve.errors import BadRequestError
from radixserve.tools.spec import ToolCallsSpec


@dataclass(frozen=True)
class CallFormat:
    """How one family writes its calls. A call is ``call_begin`` name ``name_end`` arguments-object
    ``call_end``; calls follow each other with ``separator`` between them, inside ``group`` (begin,
    end) where the family wraps them in one list. ``trigger`` is the text that opens a call (or the
    group) in free text."""

    name: str
    trigger: str
    call_begin: str
    name_end: str
    call_end: str
    separator: str
    group: tuple[str, str] | None = None
    opener: str = ""  # what comes before the JSON object (hermes) or list (mistral) of calls
    close: str = ""  # what ends a call after its JSON object (hermes: </tool_call>)

    def call_text(self, name: str, arguments: str) -> str:
        """One call written as the grammar writes it (``arguments``: the JSON text)."""
        return self.call_begin + name + self.name_end + arguments + self.call_end

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls ``[(name, arguments JSON text)]`` written as the grammar writes them."""
        body = self.separator.join(self.call_text(n, a) for n, a in calls)
        return f"{self.group[0]}{body}{self.group[1]}" if self.group else body


HERMES = CallFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", opener="<tool_call>", close="</tool_call>")
LLAMA3 = CallFormat("llama3", '{"name": ', '{"name": "', '", "parameters": ', "}", "; ")
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", '{"name": "', '", "arguments": ', "}", ", ", group=("[TOOL_CALLS] [", "]"), opener="[TOOL_CALLS]")
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL)}


def takes_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` (else the fallback system prompt is used)."""
    return bool(template) and re.search(r"\btools\b", template) is not None  # type: ignore[arg-type]


def detect_format(template: str | None) -> CallFormat:
    """The call format of a chat template (see the module's table); hermes for a template that takes
    no tools (the fallback prompt teaches it). :class:`BadRequestError` (``tools``) for a template
    that takes tools in another format."""
    if not takes_tools(template):
        return HERMES
    assert template is not None
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return LLAMA3
    raise BadRequestError(
        "tools",
        "this model's chat template takes tools, but writes calls in none of the formats "
        'radixserve parses: hermes (<tool_call>{"name", "arguments"}</tool_call>: Qwen, '
        'Hermes), llama3 ({"name", "parameters"}: Llama 3.x), mistral ([TOOL_CALLS] [...])',
    )


def structural_tag(spec: ToolCallsSpec) -> str:
    """The xgrammar structural tag (its JSON) that admits what ``spec`` allows (module docstring)."""
    from xgrammar.structural_tag import AnyTextFormat, GrammarFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat, TriggeredTagsFormat

    from radixserve.ebnf import json_schema_ebnf

    fmt = FORMATS[spec.format]
    if spec.mode == "none":
        return StructuralTag(format=AnyTextFormat(excludes=[fmt.trigger])).model_dump_json()
    one = not spec.parallel
    if fmt.group is None:
        tags = [
            TagFormat(begin=fmt.call_begin + t.name + fmt.name_end, end=fmt.call_end, content=GrammarFormat(grammar=json_schema_ebnf(_json(t.parameters))))
            for t in spec.tools
        ]
        if spec.mode == "required":
            return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator=fmt.separator, at_least_one=True, stop_after_first=one)).model_dump_json()
        return StructuralTag(format=TriggeredTagsFormat(triggers=[fmt.trigger], tags=tags, stop_after_first=one)).model_dump_json()
    calls = [
        TagFormat(begin=fmt.call_begin + t.name + fmt.name_end, end=fmt.call_end, content=GrammarFormat(grammar=json_schema_ebnf(_json(t.parameters))))
        for t in spec.tools
    ]
    group = TagFormat(
        begin=fmt.group[0], end=fmt.group[1], content=TagsWithSeparatorFormat(tags=calls, separator=fmt.separator, at_least_one=True, stop_after_first=one)
    )
    if spec.mode == "required":
        return StructuralTag(format=group).model_dump_json()
    return StructuralTag(format=TriggeredTagsFormat(triggers=[fmt.trigger], tags=[group], stop_after_first=True)).model_dump_json()


def _json(schema: dict) -> str:
    import json

    return json.dumps(schema, separators=(",", ":"))
