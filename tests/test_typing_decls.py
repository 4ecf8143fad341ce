"""Declarations that exist only for the type checker stay in step with the code they describe (the
router's shared state: RouterBase annotations, set in Router.__init__ and Sockets.bind), and
Request keeps one name per field (through its part)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from radixserve.engine.request import Request
from radixserve.sampling_params import SamplingParams
from radixserve.serve.router import base as router_base
from radixserve.serve.router.core import Router
from radixserve.serve.router.sockets import Sockets


def test_request_fields_have_one_path():
    """Issue 48: a field of a request's parts is reached through its part only (``req.kv.pages``),
    never also as an attribute of the request."""
    req = Request("r", [1], SamplingParams())
    for part in ("input", "decode", "out", "kv", "life"):
        for f in dataclasses.fields(getattr(req, part)):
            assert not hasattr(req, f.name), f"{part}.{f.name}"


def test_router_base_declares_what_the_router_sets():
    declared = set(inspect.get_annotations(router_base.RouterBase))
    set_in_init = {node.attr for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(Router.__init__))))
                   if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                   and isinstance(node.value, ast.Name) and node.value.id == "self"}
    set_in_bind = {node.attr for method in (Sockets.bind, Sockets._bind_sockets)
                   for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(method))))
                   if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                   and isinstance(node.value, ast.Name) and node.value.id == "self"}
    assert set_in_init | set_in_bind == declared
