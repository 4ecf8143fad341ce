"""Errors a user can hit. Each has a stable code (used on the wire) and says what to do."""

from __future__ import annotations


class RadixServeError(Exception):
    """Base class. ``code`` is one of the protocol's error codes."""

    code = "internal"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequestError(RadixServeError, ValueError):
    """The request is malformed: a field is missing, of the wrong type or out of range."""

    code = "bad_request"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class TooLongError(BadRequestError):
    """The prompt (plus what it asks to generate) does not fit the model's context."""

    code = "too_long"


class ModelLoadError(RadixServeError):
    """The model directory is missing, incomplete or of an unsupported architecture."""

    code = "bad_request"


class OverloadedError(RadixServeError):
    code = "overloaded"


class ShuttingDownError(RadixServeError):
    code = "shutting_down"


class WorkerLostError(RadixServeError):
    """The worker serving the request died after it had streamed tokens (or no worker is left);
    retry the call."""

    code = "worker_lost"


class RouterLostError(RadixServeError, ConnectionError):
    """The SDK heard nothing from the router (not even heartbeat replies) for ``router_timeout``
    seconds: it is gone or unreachable. Pending calls fail with this; retry against a live one."""

    code = "router_lost"


class InternalError(RadixServeError):
    code = "internal"


class RequestTimeoutError(RadixServeError, TimeoutError):
    """The client gave up waiting (its ``timeout``); the request was aborted on the server."""

    code = "timeout"


_BY_CODE: dict[str, type[RadixServeError]] = {
    "bad_request": BadRequestError, "too_long": TooLongError, "overloaded": OverloadedError,
    "worker_lost": WorkerLostError, "shutting_down": ShuttingDownError, "internal": InternalError,
    "timeout": RequestTimeoutError, "router_lost": RouterLostError,
}


def error_from_code(code: str, message: str) -> RadixServeError:
    """The exception for a wire error ``code`` (unknown codes become :class:`InternalError`)."""
    cls = _BY_CODE.get(code, InternalError)
    exc = cls.__new__(cls)
    RadixServeError.__init__(exc, message)
    if issubclass(cls, BadRequestError):
        exc.field = message.split(":", 1)[0] if ":" in message else ""
    if cls is InternalError and code not in _BY_CODE:
        exc.code = code
    return exc


class InvariantError(InternalError, AssertionError):
    """An internal invariant broke (KV accounting, radix tree, page tables): a bug, never bad input.
    Raised explicitly, so it fires under ``python -O`` too (unlike ``assert``)."""

