"""Structured output: grammars (JSON schema, any JSON, regex, a list of choices, tool calls)
compiled by xgrammar into per-step token masks.

One :class:`GrammarCache` per engine (per tokenizer) compiles each distinct grammar once and keeps
the compiled form in a bounded LRU; every request gets its own :class:`xgrammar.GrammarMatcher`
(its position in the grammar). The sampler asks the matcher for a bitmask of allowed next tokens,
applies it to the logits, and advances the matcher on the token it picked
(:func:`radixserve.engine.sampler.apply_grammar_masks`, :func:`advance_grammars`). Once the grammar
is complete only the tokenizer's stop (EOS) tokens stay allowed; the matcher terminates on one and
the request finishes with ``stop``.

xgrammar is an optional dependency (``pip install 'radixserve[structured]'``); without it a
structured request is refused with a :class:`BadRequestError` that says so. The spec a request
carries (:class:`~radixserve.sampling_params.StructuredOutput`) lives with the sampling parameters;
this module only compiles it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from radixserve.ebnf import choice_ebnf, json_schema_ebnf
from radixserve.errors import BadRequestError
from radixserve.sampling_params import StructuredOutput, as_structured  # noqa: F401  (the spec; re-exported)


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
        self._info = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity
        self.hits = self.misses = 0

    def tokenizer_info(self):
        """The xgrammar TokenizerInfo grammars are compiled against (built once)."""
        if self._info is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise BadRequestError("structured", "structured output needs xgrammar, which is not installed: pip install 'radixserve[structured]'") from None
            self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop or None)
        return self._info

    def _get_compiler(self):
        if self._compiler is None:
            info = self.tokenizer_info()  # first: without xgrammar, a bad_request that says how to install it
            import xgrammar as xgr

            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def cached(self, spec: StructuredOutput) -> bool:
        """Whether ``spec``'s grammar is compiled already (:meth:`compile` returns at once)."""
        with self._lock:
            return spec.key in self._compiled

    def put(self, spec: StructuredOutput, compiled) -> None:
        """Keep a grammar compiled elsewhere (the worker's killable compile process) for ``spec``."""
        with self._lock:
            self._compiled[spec.key] = compiled
            self._compiled.move_to_end(spec.key)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)

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
        if spec.tool_calls is not None:  # kind "tool_calls"
            from radixserve.tools.formats import structural_tag

            return compiler.compile_structural_tag(structural_tag(spec.tool_calls))
        return compiler.compile_grammar(choice_ebnf(spec.choice or []))  # kind "choice": choice is set

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher (the start of the grammar) for one request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))
