"""One validation layer: msgspec Structs whose fields carry their constraints.

Fields are declared as ``Annotated[int, msgspec.Meta(ge=1, description="...")]`` (ranges, lengths)
or ``Literal[...]`` (choices). msgspec checks those constraints whenever it decodes (a wire
message, a JSON config) or converts (a dict); :func:`convert` and :func:`check` do the same for
plain data and for a Struct built with keyword arguments (constructors do not check), and turn
msgspec's :class:`~msgspec.ValidationError` into the project's :class:`BadRequestError` naming the
field, what it must be, and the field's description.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Any, TypeVar

import msgspec

from radixserve.errors import BadRequestError

T = TypeVar("T")

_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_KIND = {"int": "an integer", "float": "a number", "str": "a string", "array": "a list", "bool": "true or false", "object": "an object", "null": "null"}


def convert(data: Any, type_: type[T], *, field_prefix: str = "") -> T:
    """``msgspec.convert(data, type_)``, raising :class:`BadRequestError` that names the field."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        field, rule = explain(exc, type_, _lookup(data, explain(exc)[0]))
        raise BadRequestError(field_prefix + field if field else field_prefix.rstrip(".") or "value", rule) from None


def check(obj: msgspec.Struct) -> None:
    """Check a Struct's field constraints (msgspec checks them only on decode and convert, not in
    the constructor). Nested Struct values are taken as they are (check them on their own)."""
    values = msgspec.structs.asdict(obj)
    try:
        msgspec.convert(values, type(obj))
    except msgspec.ValidationError as exc:
        field = explain(exc)[0]
        top = field.split(".", 1)[0]
        raise BadRequestError(field or "value", explain(exc, type(obj), values.get(top, _MISSING))[1]) from None


_MISSING = object()


def explain(exc: msgspec.ValidationError, type_: Any = None, value: Any = _MISSING) -> tuple[str, str]:
    """``(field, what it must be)`` from a msgspec validation error: ``$.params.top_p`` gives
    field ``params.top_p``; the rule is msgspec's, in words, then the value given (when known)
    and the field's description."""
    m = _PATH.match(str(exc))  # matches every string (its path part is optional)
    what, path = (m.group("what"), (m.group("path") or "").lstrip(".")) if m is not None else (str(exc), "")
    field = re.split(r"\[", path, maxsplit=1)[0]
    if not field:  # "Object missing required field `x`" / "Object contains unknown field `x`"
        named = re.search(r"field `([^`]+)`", what)
        field = named.group(1) if named else ""
    rule = "is required" if what.startswith("Object missing required field") else _in_words(what)
    leaf = field.rsplit(".", 1)[-1]
    owner = _owner(type_, field)
    if owner is not None and leaf:
        choices = literal_choices(owner, leaf)
        if choices and what.startswith("Invalid enum value"):
            rule = "must be one of " + ", ".join(map(str, choices))
    if value is not _MISSING and ", got" not in rule:
        rule += f", got {value!r}"
    if owner is not None and leaf:
        desc = description(owner, leaf)
        if desc:
            rule += f"; {desc}"
    return field, rule


def _lookup(data: Any, field: str) -> Any:
    """The value at a dotted ``field`` of plain (dict) data, or ``_MISSING``."""
    for name in field.split(".") if field else ():
        if not isinstance(data, dict) or name not in data:
            return _MISSING
        data = data[name]
    return data if field else _MISSING


def _in_words(what: str) -> str:
    m = re.match(r"Expected `([^`]+)`(.*)$", what, re.S)
    if not m:
        return what[:1].lower() + what[1:]
    kinds = " or ".join(_KIND.get(k.strip(), k.strip()) for k in m.group(1).split("|"))
    return f"must be {kinds}{m.group(2)}"


def _owner(type_: Any, path: str) -> Any:
    """The Struct type holding the last field of a dotted ``path`` (None when unknown)."""
    parts = [p for p in path.split(".") if p]
    owner = type_
    for name in parts[:-1]:
        hint = type_hints(owner).get(name) if _is_struct(owner) else None
        owner = next((t for t in flatten_type(hint) if _is_struct(t)), None)
    return owner if _is_struct(owner) else None


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, msgspec.Struct)


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The field annotations of ``cls``, with their ``Annotated`` metadata."""
    return typing.get_type_hints(cls, include_extras=True)


def flatten_type(hint: Any) -> list[Any]:
    """The types inside ``hint``: Annotated and unions unwrapped."""
    if hint is None:
        return []
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return flatten_type(typing.get_args(hint)[0])
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return [t for a in typing.get_args(hint) for t in flatten_type(a)]
    return [hint]


def field_meta(cls: type, name: str) -> msgspec.Meta | None:
    """The ``msgspec.Meta`` annotated on a field (the outermost one), or None."""
    hint = type_hints(cls).get(name)
    stack = [hint]
    while stack:
        h = stack.pop(0)
        origin = typing.get_origin(h)
        if origin is typing.Annotated:
            metas = [a for a in typing.get_args(h)[1:] if isinstance(a, msgspec.Meta)]
            if metas:
                return metas[-1]
            stack.append(typing.get_args(h)[0])
        elif origin is typing.Union or type(h).__name__ == "UnionType":
            stack.extend(typing.get_args(h))
    return None


def description(cls: type, name: str) -> str:
    meta = field_meta(cls, name)
    return (meta.description or "") if meta is not None else ""


def literal_choices(cls: type, name: str) -> tuple:
    """The values of a ``Literal[...]`` field (None excluded), or ``()``."""
    out: list = []
    for t in flatten_type(type_hints(cls).get(name)):
        if typing.get_origin(t) is typing.Literal:
            out += [v for v in typing.get_args(t) if v is not None]
    return tuple(out)
