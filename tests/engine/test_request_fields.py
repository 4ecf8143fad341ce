"""Request keeps one name per field: through its part (issue 48)."""

from __future__ import annotations

import dataclasses

from radixserve.engine.request import Request
from radixserve.sampling_params import SamplingParams


def test_request_fields_have_one_path():
    """Issue 48: a field of a request's parts is reached through its part only (``req.kv.pages``),
    never also as an attribute of the request."""
    req = Request("r", [1], SamplingParams())
    for part in ("input", "decode", "out", "kv", "life"):
        for f in dataclasses.fields(getattr(req, part)):
            assert not hasattr(req, f.name), f"{part}.{f.name}"
