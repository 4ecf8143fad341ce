"""Structured output: grammars (JSON schema, any JSON, regex, a list of choices) compiled by
xgrammar into per-step token masks.

One :class:`GrammarCache` per engine (per tokenizer) compiles each distinct grammar once and keeps
the compiled form in a bounded LRU; every request gets its own :class:`xgrammar.GrammarMatcher`
(its position in the grammar). The sampler asks the matcher for a bitmask of allowed next tokens,
applies it to the logits, and advances the matcher on the token it picked
(:func:`radixserve.engine.sampler.apply_grammar_masks`, :func:`advance_grammars`). Once the grammar
is complete only the tokenizer's stop (EOS) tokens stay allowed; the matcher terminates on one and
the request finishes with ``stop``.

xgrammar is an optional dependency (``pip install 'radixserve[structured]'``); without it a
structured request is refused with a :class:`BadRequestError` that says so.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import msgspec

from radixserve.errors import BadRequestError

MAX_SCHEMA_CHARS = 64 * 1024
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 4096
MAX_CHOICE_CHARS = 256
MAX_CHOICES_CHARS = 256 * 1024


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Constrain a request's output to one grammar; give exactly one field.

    * ``json_schema``: a JSON schema (object or its JSON text); the output is compact JSON that
      validates against it.
    * ``json_object=True``: any JSON object.
    * ``regex``: the whole output matches this regular expression.
    * ``choice``: the output is exactly one of these strings.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None

    @property
    def kind(self) -> str:
        for name in ("json_schema", "regex", "choice"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def validate(self) -> None:
        """Shape and size checks (the grammar itself is checked when it is compiled)."""
        given = [n for n in ("json_schema", "regex", "choice") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise BadRequestError("structured", "give exactly one of json_schema, json_object=True, regex or choice"
                                  + (f", got {', '.join(given)}" if given else ""))
        if self.json_schema is not None:
            if len(self.schema_text) > MAX_SCHEMA_CHARS:
                raise BadRequestError("structured.json_schema", f"must be at most {MAX_SCHEMA_CHARS} characters of JSON")
        if self.regex is not None and not 0 < len(self.regex) <= MAX_REGEX_CHARS:
            raise BadRequestError("structured.regex", f"must be 1..{MAX_REGEX_CHARS} characters")
        if self.choice is not None:
            c = self.choice
            if not 0 < len(c) <= MAX_CHOICES or any(not isinstance(s, str) or not 0 < len(s) <= MAX_CHOICE_CHARS for s in c):
                raise BadRequestError("structured.choice", f"must hold 1..{MAX_CHOICES} strings of 1..{MAX_CHOICE_CHARS} characters")
            if sum(map(len, c)) > MAX_CHOICES_CHARS:
                raise BadRequestError("structured.choice", f"must be at most {MAX_CHOICES_CHARS} characters in all")

    @property
    def schema_text(self) -> str:
        s = self.json_schema
        return s if isinstance(s, str) else json.dumps(s, separators=(",", ":"))  # key order matters: kept

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (for the cache)."""
        kind = self.kind
        if kind == "json_schema":
            return kind, self.schema_text
        if kind == "regex":
            return kind, self.regex
        if kind == "choice":
            return kind, "\x00".join(self.choice)
        return kind, ""


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


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals JSON-escaped)."""
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"root ::= {alts}\n"


# xgrammar 0.2.x writes length-bounded strings (maxLength / minLength) with the character class
# [^"\\\r\n], which lets raw control characters (U+0000-U+001F) in, so the output is not JSON
# (json.loads refuses it); unbounded strings use the right class. We patch the class in the EBNF.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF of a JSON schema: compact JSON (no free whitespace, so a model cannot wander off
    into endless blanks), with JSON's string characters everywhere."""
    import xgrammar as xgr

    ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False))
    return ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarCache:
    """Compiles grammars for one tokenizer and vocabulary; an LRU of ``capacity`` compiled
    grammars. Thread-safe: requests are built on callers' threads, matchers run on the engine's."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], capacity: int = 256):
        self._tokenizer, self._vocab_size, self._stop = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity
        self.hits = self.misses = 0

    def _get_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise BadRequestError("structured", "structured output needs xgrammar, which is not installed: "
                                      "pip install 'radixserve[structured]'") from None
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of ``spec`` (cached); :class:`BadRequestError` when xgrammar refuses it."""
        key = spec.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                self.hits += 1
                return compiled
            compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except BadRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise BadRequestError(f"structured.{spec.kind}", f"cannot be compiled into a grammar: {exc}") from None
        with self._lock:
            self.misses += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler, spec: StructuredOutput):
        kind = spec.kind
        if kind == "json_schema":
            return compiler.compile_grammar(json_schema_ebnf(spec.schema_text))
        if kind == "json_object":
            return compiler.compile_grammar(json_schema_ebnf('{"type": "object"}'))
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        return compiler.compile_grammar(choice_ebnf(spec.choice))

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher (the start of the grammar) for one request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))
