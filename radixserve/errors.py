"""Errors a user can hit. Each has a stable code (used on the wire) and says what to do."""

from __future__ import annotations

# The error codes: stable strings, the one list (protocol.py re-exports it; error_from_code maps
# each to its exception class below).
BAD_REQUEST = "bad_request"
TOO_LONG = "too_long"
OVERLOADED = "overloaded"
WORKER_LOST = "worker_lost"
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"
UNAUTHORIZED = "unauthorized"  # keys are configured and the request carried none, or an unknown one
TIMEOUT = "timeout"  # the SDK's own: the caller's timeout ran out (never sent by a server)
ROUTER_LOST = "router_lost"  # the SDK's own: nothing heard from the router
ROUTER_REFUSED = "router_refused"  # the SDK's own: the router refused the connection at its handshake
ERROR_CODES = (BAD_REQUEST, TOO_LONG, OVERLOADED, WORKER_LOST, SHUTTING_DOWN, INTERNAL, UNAUTHORIZED)  # what servers send


class RadixServeError(Exception):
    """Base class. ``code`` is one of the protocol's error codes."""

    code = INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequestError(RadixServeError, ValueError):
    """The request is malformed: a field is missing, of the wrong type or out of range."""

    code = BAD_REQUEST

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class TooLongError(BadRequestError):
    """The prompt (plus what it asks to generate) does not fit the model's context."""

    code = TOO_LONG


class ModelLoadError(RadixServeError):
    """The model directory is missing, incomplete or of an unsupported architecture."""

    code = BAD_REQUEST


class UnauthorizedError(RadixServeError, PermissionError):
    """The server requires an API key (``serve --api-key`` / ``--api-keys-file``) and the request
    carried none, or one it does not know: pass ``Client(..., api_key=KEY)`` or set
    ``RADIXSERVE_API_KEY``."""

    code = UNAUTHORIZED


class OverloadedError(RadixServeError):
    code = OVERLOADED


class ShuttingDownError(RadixServeError):
    code = SHUTTING_DOWN


class WorkerLostError(RadixServeError):
    """The worker serving the request died after it had streamed tokens (or no worker is left);
    retry the call."""

    code = WORKER_LOST


class RouterLostError(RadixServeError, ConnectionError):
    """The SDK heard nothing from the router (not even heartbeat replies) for ``router_timeout``
    seconds: it is gone or unreachable. Pending calls fail with this; retry against a live one."""

    code = ROUTER_LOST


class RouterRefusedError(RadixServeError, ConnectionError):
    """The router did not accept the SDK's connection: it refused the handshake, most likely
    because it is at its client-connection cap (``serve --max-clients``; its stats count
    ``refused_clients``), or the address is not a router's client socket. Pending calls on that
    connection fail with this at once; the next call connects anew."""

    code = ROUTER_REFUSED


class InternalError(RadixServeError):
    code = INTERNAL


class RequestTimeoutError(RadixServeError, TimeoutError):
    """The client gave up waiting (its ``timeout``); the request was aborted on the server."""

    code = TIMEOUT


_BY_CODE: dict[str, type[RadixServeError]] = {
    cls.code: cls
    for cls in (
        BadRequestError,
        TooLongError,
        OverloadedError,
        WorkerLostError,
        ShuttingDownError,
        InternalError,
        RequestTimeoutError,
        RouterLostError,
        RouterRefusedError,
        UnauthorizedError,
    )
}


def error_from_code(code: str, message: str) -> RadixServeError:
    """The exception for a wire error ``code`` (unknown codes become :class:`InternalError`)."""
    cls = _BY_CODE.get(code, InternalError)
    exc = cls.__new__(cls)
    RadixServeError.__init__(exc, message)
    if isinstance(exc, BadRequestError):
        exc.field = message.split(":", 1)[0] if ":" in message else ""
    if cls is InternalError and code not in _BY_CODE:
        exc.code = code
    return exc


class InvariantError(InternalError, AssertionError):
    """An internal invariant broke (KV accounting, radix tree, page tables): a bug, never bad input.
    Raised explicitly, so it fires under ``python -O`` too (unlike ``assert``)."""
