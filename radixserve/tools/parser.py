"""Tool calls out of a model's text, whole (:func:`parse_calls`) or as it streams
(:class:`CallStream`: OpenAI's deltas, each call's name first, then fragments of its arguments).

Both read the text with one scanner (:func:`scan`), so a stream's deltas, joined, are exactly the
whole parse: the same content and, per call, the same name and arguments text. Arguments are the
JSON text the model wrote (the grammar writes compact JSON), not a re-serialization. A call's
JSON may also put ``arguments`` before ``name`` or use ``parameters``; then its arguments are
re-serialized (``json.dumps``).

Content is the text outside the calls, joined; text made only of whitespace and the format's
separator (what stands between calls) is no content (None). A call cut off by ``max_tokens`` before
its arguments' JSON object closes (``finish_reason: "length"``) is still a call, with the arguments
written so far, as OpenAI returns one and as a stream has sent it by then. An unclosed call in an
output that ended otherwise (a stop string) is text: it stays in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.tools.formats import CallFormat

_DECODER = json.JSONDecoder()
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = re.compile(r"\s*")
PENDING = -1  # the text ends inside a call: more may come
NOT_A_CALL = -2


@dataclass
class ScannedCall:
    """A call as far as the text goes: ``done`` once its arguments' JSON closed."""

    name: str
    arguments: str
    done: bool


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: ``id`` (``call_`` + 24 hex digits; 9 letters and digits for mistral, whose
    templates check that), ``name`` and ``arguments`` (JSON text)."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(fmt: CallFormat) -> str:
    return uuid.uuid4().hex[:9] if fmt.name == "mistral" else "call_" + uuid.uuid4().hex[:24]


def _held(tail: str, marker: str) -> int:
    """How many characters at the end of ``tail`` could begin ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if tail.endswith(marker[:k]):
            return k
    return 0


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    return m.end() if m else pos


def _read_call(fmt: CallFormat, text: str, pos: int, final: bool, calls: list[ScannedCall]) -> int:
    """Read one call's JSON object at ``pos`` (after blanks); returns the position after it (and
    after ``fmt.close``), or PENDING / NOT_A_CALL."""
    pos = _skip_ws(text, pos)
    head = _HEAD.match(text, pos)
    if head is None:
        try:  # lenient: keys in another order, or blanks the grammar would not write
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return NOT_A_CALL if final else PENDING
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("arguments" in obj or "parameters" in obj)):
            return NOT_A_CALL
        args = obj.get("arguments", obj.get("parameters"))
        calls.append(ScannedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), True))
        return _after_close(fmt, text, end, final)
    start = head.end()
    try:
        _, end = _DECODER.raw_decode(text, start)
    except ValueError:
        if final:
            return NOT_A_CALL
        calls.append(ScannedCall(head.group(1), text[start:], False))
        return PENDING
    calls.append(ScannedCall(head.group(1), text[start:end], True))
    k = _skip_ws(text, end)
    if k == len(text):
        return len(text) if final else PENDING
    if text[k] != "}":
        calls.pop()
        return NOT_A_CALL
    return _after_close(fmt, text, k + 1, final)


def _after_close(fmt: CallFormat, text: str, pos: int, final: bool) -> int:
    if not fmt.close:
        return pos
    k = _skip_ws(text, pos)
    if text.startswith(fmt.close, k):
        return k + len(fmt.close)
    if not final and fmt.close.startswith(text[k:]):
        return PENDING
    return pos  # lenient: a call whose closing tag is missing


def _read_group(fmt: CallFormat, text: str, pos: int, final: bool, calls: list[ScannedCall]) -> int:
    """Read ``[call, call, ...]`` (mistral) at ``pos``."""
    k = _skip_ws(text, pos)
    if k == len(text):
        return len(text) if final else PENDING
    if text[k] != "[":
        return NOT_A_CALL
    k += 1
    while True:
        k = _read_call(fmt, text, k, final, calls)
        if k < 0:  # PENDING, or NOT_A_CALL (the caller drops this group's calls)
            return k
        k = _skip_ws(text, k)
        if k == len(text):
            return len(text) if final else PENDING
        if text[k] == "]":
            return k + 1
        if text[k] != ",":
            return NOT_A_CALL
        k += 1


def scan(fmt: CallFormat, text: str, final: bool) -> tuple[str, list[ScannedCall]]:
    """The content and calls of ``text``. Not ``final`` (a stream's text so far): text that may
    still become part of a call is held back from the content, and the last call may be partial.
    Content right after a call is dropped while it is blank (the separator between calls)."""
    content: list[str] = []
    calls: list[ScannedCall] = []
    pos = start = 0  # pos: where to look for the next call; start: where the current piece of content began
    after_call = False

    def add(piece: str) -> None:
        if not (after_call and _blank(fmt, piece)):
            content.append(piece)

    while True:
        i = text.find(fmt.trigger, pos)
        if i < 0:
            tail = text[start:]
            add(tail if final else tail[: len(tail) - _held(tail, fmt.trigger)])
            break
        before = len(calls)
        at = i + len(fmt.opener)
        end = _read_group(fmt, text, at, final, calls) if fmt.group else _read_call(fmt, text, at, final, calls)
        if end == NOT_A_CALL:  # the trigger is text: the piece goes on
            del calls[before:]
            pos = i + len(fmt.trigger)
            continue
        add(text[start:i])
        if end == PENDING:
            break
        pos = start = end
        after_call = True
    return "".join(content), calls


def _blank(fmt: CallFormat, content: str) -> bool:
    return not content.strip(" \t\r\n" + fmt.separator)


def parse_calls(fmt: CallFormat, text: str, cut_off: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The content (None when blank) and the calls of a finished output; ``cut_off``: it ended at
    ``max_tokens``, so a call it opened and did not close is a call (its arguments cut short)."""
    content, calls = scan(fmt, text, final=True)
    done = [c for c in calls if c.done]
    if cut_off:
        partial_content, partial = scan(fmt, text, final=False)
        if len(partial) > len(done):  # (what a stream has sent: CallStream.feed)
            content, done = partial_content, partial
    return (None if _blank(fmt, content) else content), [ToolCall(new_call_id(fmt), c.name, c.arguments) for c in done]


class CallStream:
    """One streamed choice's tool calls: :meth:`feed` each new piece of text, then :meth:`finish`;
    each returns ``(content delta or None, tool_calls deltas)`` in OpenAI's shape. Content is held
    back while it is blank, so that a response of calls alone streams no content, like the whole
    parse (whose blank content is None)."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.text = ""
        self._content_sent = 0
        self._sent: list[tuple[str, int]] = []  # per call: id, arguments characters sent

    @property
    def calls(self) -> int:
        """How many calls were opened so far."""
        return len(self._sent)

    def feed(self, piece: str, final: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
        self.text += piece
        content, calls = scan(self.fmt, self.text, final)
        if final:
            calls = [c for c in calls if c.done]
            if len(calls) < len(self._sent):  # a call it opened was cut off: sent as a call, not content
                content = scan(self.fmt, self.text, False)[0]
        delta = None
        if not _blank(self.fmt, content) and len(content) > self._content_sent:
            delta, self._content_sent = content[self._content_sent :], len(content)
        out: list[dict[str, Any]] = []
        for k, c in enumerate(calls):
            if k == len(self._sent):
                self._sent.append((new_call_id(self.fmt), 0))
                out.append({"index": k, "id": self._sent[k][0], "type": "function", "function": {"name": c.name, "arguments": ""}})
            cid, sent = self._sent[k]
            if len(c.arguments) > sent:
                out.append({"index": k, "function": {"arguments": c.arguments[sent:]}})
                self._sent[k] = (cid, len(c.arguments))
        return delta, out

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """The rest, once the output is complete."""
        return self.feed("", final=True)
