"""Grammar texts (EBNF, as xgrammar reads it) for choices and JSON schemas: shared by the engine's
structured output (:mod:`radixserve.engine.structured`) and tool calls' structural tags
(:mod:`radixserve.tools.formats`)."""

from __future__ import annotations

import json


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals JSON-escaped)."""
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"root ::= {alts}\n"


# xgrammar 0.2.x writes length-bounded strings (maxLength / minLength) with the character class
# [^"\\\r\n], which lets raw control characters (U+0000-U+001F) in, so the output is not JSON
# (json.loads refuses it); unbounded strings use the right class. We patch the class in the EBNF.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF of a JSON schema: compact JSON (no free whitespace, so a model cannot wander off
    into endless blanks), with JSON's string characters everywhere."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
