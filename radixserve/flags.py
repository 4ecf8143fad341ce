"""argparse flags generated from the config Structs (:mod:`radixserve.config`).

One field, one flag: the name is the field's (``max_running`` -> ``--max-running``) unless its
Meta says ``flag=``; the help is the Meta description; the default is the field's; the type is the
field's (``int``, ``float``, ``str``); a ``Literal`` gives ``choices``; a bool gives a
``store_true`` flag (``store_false`` for a ``--no-...`` flag of a field that defaults to True); a
``list[str]`` gives a repeatable flag. :func:`from_args` turns the parsed namespace back into the
Struct through :func:`radixserve.validation.convert`, so a bad value is refused with the field's
name and range.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from radixserve.validation import convert, field_meta, flatten_type, literal_choices, type_hints

T = TypeVar("T", bound=msgspec.Struct)


def add_flags(
    parser, cls: type, fields: Iterable[str] | None = None, *, defaults: dict[str, Any] | None = None, helps: dict[str, str | None] | None = None
) -> None:
    """Add one flag per field of ``cls`` (``fields``: which, in this order; default: every
    non-Struct field) to ``parser`` (a parser or an argument group). ``defaults`` / ``helps``
    override a field's default / help for this command only."""
    info = {f.name: f for f in msgspec.structs.fields(cls)}
    names = list(fields) if fields is not None else [n for n in info if not _is_struct_field(cls, n)]
    defaults, helps = defaults or {}, helps or {}
    for name in names:
        f = info[name]
        meta = field_meta(cls, name)
        extra = dict(meta.extra or {}) if meta is not None and meta.extra else {}
        default = defaults.get(
            name, f.default if f.default is not msgspec.NODEFAULT else (f.default_factory() if f.default_factory is not msgspec.NODEFAULT else None)
        )
        kwargs: dict[str, Any] = {"dest": name, "help": helps.get(name, meta.description if meta is not None else None)}
        flag = extra.pop("flag", "--" + name.replace("_", "-"))
        base = _base_type(cls, name)
        if base is bool:
            kwargs["action"] = "store_false" if default is True else "store_true"
        elif base is list:
            kwargs.update(action="append", default=default)
        else:
            choices = literal_choices(cls, name)
            if choices:
                kwargs["choices"] = list(choices)
            elif base in (int, float):
                kwargs["type"] = base
            kwargs["default"] = default
            if f.required and name not in defaults:
                kwargs["required"] = True
        kwargs.update(extra)
        parser.add_argument(flag, **kwargs)


def from_args(cls: type[T], args: argparse.Namespace, fields: Iterable[str] | None = None, **values) -> T:
    """The ``cls`` Struct of the parsed flags (plus ``values``), checked; raises
    :class:`~radixserve.errors.BadRequestError` naming the field."""
    names = list(fields) if fields is not None else [f.name for f in msgspec.structs.fields(cls)]
    data = {n: getattr(args, n) for n in names if hasattr(args, n)}
    data.update(values)
    return convert({k: v for k, v in data.items() if v is not None or _optional(cls, k)}, cls)


def _is_struct_field(cls: type, name: str) -> bool:
    return any(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in flatten_type(type_hints(cls)[name]))


def _optional(cls: type, name: str) -> bool:
    return any(t is type(None) for t in flatten_type(type_hints(cls)[name]))


def _base_type(cls: type, name: str) -> Any:
    """``bool`` / ``list`` / ``int`` / ``float`` / ``str`` for a field (None and Literal set aside)."""
    for t in flatten_type(type_hints(cls)[name]):
        if t is type(None) or typing.get_origin(t) is typing.Literal:
            continue
        origin = typing.get_origin(t)
        if origin is list or t is list:
            return list
        return t
    return str
