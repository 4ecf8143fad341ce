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
