"""Errors in OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``, and the map
from the SDK's / router's typed errors to HTTP statuses."""

from __future__ import annotations

import logging
from typing import Any

from radixserve.errors import (
    BadRequestError,
    OverloadedError,
    RadixServeError,
    RequestTimeoutError,
    RouterLostError,
    RouterRefusedError,
    ShuttingDownError,
    TooLongError,
    WorkerLostError,
)

log = logging.getLogger("radixserve.http")


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 naming the field (``param``) at the start of its message."""
    text = f"{param}: {message}" if param else message
    return APIError(400, text, param=param, code=code)


# (error class, HTTP status, OpenAI code, Retry-After seconds or None); the first match wins
# (the gateway's own connection to the router lost or refused: the service is unavailable, not broken)
_UNAVAILABLE = (
    (OverloadedError, "overloaded", "1"),
    (ShuttingDownError, "shutting_down", "5"),
    (WorkerLostError, "worker_lost", "1"),
    (RouterLostError, "router_lost", "5"),
    (RouterRefusedError, "router_refused", "5"),
)


def api_error_from(exc: BaseException, prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> APIError:
    """Map an SDK / router error to the HTTP error a client of OpenAI expects. The router names
    ``max_tokens`` what a chat may have set as ``max_completion_tokens`` (``max_tokens_param``)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, TooLongError):  # the prompt, or max_tokens on top of it, does not fit the context
        too_long = "max_tokens" if exc.field == "max_tokens" else prompt_param
        return APIError(400, exc.message, param=too_long, code="context_length_exceeded")
    if isinstance(exc, BadRequestError):
        param = getattr(exc, "field", None) or None
        message = exc.message
        if param in ("prompt", "token_ids"):
            param = prompt_param
        elif param == "max_tokens" and message.startswith("max_tokens:"):
            param, message = max_tokens_param, max_tokens_param + message[len("max_tokens") :]
        return APIError(400, message, param=param, code=None)
    for cls, code, retry in _UNAVAILABLE:
        if isinstance(exc, cls):
            return APIError(503, exc.message, type="server_error", code=code, headers={"Retry-After": retry})
    if isinstance(exc, RequestTimeoutError):
        return APIError(503, f"the router did not answer: {exc.message}", type="server_error", code="router_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, RadixServeError):
        return APIError(500, exc.message, type="server_error", code=getattr(exc, "code", "internal") or "internal")
    log.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")
