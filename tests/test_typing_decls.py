"""Declarations that exist only for the type checker stay in step with the code they describe:
Request's flat names (declared under TYPE_CHECKING, set at import by a loop over its parts)."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from radixserve.engine import request as request_module
from radixserve.engine.request import Request


def _type_checking_names(module, cls_name: str) -> dict[str, str]:
    """name -> annotation source of the annotations in ``cls_name``'s ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    block = next(n for n in cls.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {n.target.id: ast.unparse(n.annotation) for n in block.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_request_flat_names_are_declared_exactly():
    declared = _type_checking_names(request_module, "Request")
    fields = {f.name: part for part, cls in Request._PARTS.items() for f in dataclasses.fields(cls)}
    assert set(declared) == set(fields)
    for name, part in fields.items():  # the input is read-only, the other parts read-write
        assert declared[name].startswith("_ReadOnly[" if part == "input" else "_Flat["), name
        assert isinstance(getattr(Request, name), property)
