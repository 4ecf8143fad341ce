"""Bounds on what a client controls, and the one place each is checked.

The router runs :func:`validate_generate` / :func:`validate_choose` on every request before any
work (``max_tokens``, stop strings, prompt and choice sizes, ids, namespaces); the OpenAI gateway
and the SDK do not check them again, their callers get the router's error. :func:`check_choices`
holds the rules of a choose call's choices, ``normalize`` and ``temperature``, which the engine
applies too (:meth:`radixserve.Engine.choose` has no router in front of it). What depends on the
model (the vocabulary, the context) is checked by the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from radixserve.errors import BadRequestError, TooLongError
from radixserve.validation import check

if TYPE_CHECKING:
    from radixserve.protocol import Choose, Generate

MAX_CHOICES = 1024  # choices of one choose call
NORMALIZE = ("sum", "mean")  # how a choice's token logprobs are scored


class Limits(msgspec.Struct, frozen=True):
    """Bounds on everything a client controls (checked by the router before any work)."""

    max_frame_bytes: Annotated[int, Meta(ge=1, description="largest client frame (bytes)")] = 4 * 2**20
    max_prompt_tokens: Annotated[int, Meta(ge=1, description="longest prompt (tokens)")] = 1 << 17
    max_prompt_chars: Annotated[int, Meta(ge=1, description="longest prompt (characters)")] = 1 << 21
    max_tokens: Annotated[int, Meta(ge=1, description="largest max_tokens of one request")] = 1 << 15
    max_stop: Annotated[int, Meta(ge=0, description="stop strings per request")] = 16
    max_stop_chars: Annotated[int, Meta(ge=1, description="longest stop string (characters)")] = 256
    max_stop_token_ids: Annotated[int, Meta(ge=0, description="stop token ids per request")] = 64
    max_id_chars: Annotated[int, Meta(ge=1, description="longest request id (characters)")] = 128
    max_namespace_chars: Annotated[int, Meta(ge=1, description="longest namespace (characters)")] = 256
    max_probe_tokens: Annotated[int, Meta(ge=1, description="longest stats probe (tokens)")] = 1 << 17
    # A choose call scores every choice on top of the prompt: its work grows with the choices'
    # tokens in all, so they are bounded like a prompt is (and by the context, in the router).
    max_choice_chars: Annotated[int, Meta(ge=1, description="characters of one choose call's choices in all")] = 1 << 16
    max_choice_tokens: Annotated[int, Meta(ge=1, description="tokens of one choose call's choices in all")] = 1 << 13

    def validate(self) -> None:
        """Raise :class:`BadRequestError` naming the first bound out of its range."""
        check(self)


DEFAULT_LIMITS = Limits()


def validate_generate(msg: Generate, limits: Limits = DEFAULT_LIMITS) -> None:
    """Check every client-controlled size of a generate; raises :class:`BadRequestError`."""
    _check_id(msg.id, limits)
    if (msg.prompt is None) == (msg.token_ids is None):
        raise BadRequestError("prompt", "give exactly one of prompt (text) or token_ids")
    if msg.prompt is not None:
        if not msg.prompt:
            raise BadRequestError("prompt", "is empty")
        _check_chars(msg.prompt, limits)
    if msg.token_ids is not None:
        if not msg.token_ids:
            raise BadRequestError("token_ids", "is empty")
        check_prompt_tokens(msg.token_ids, limits)
    _check_namespace(msg.namespace, limits)
    p = msg.params
    if p.max_tokens is not None and (not isinstance(p.max_tokens, int) or not 1 <= p.max_tokens <= limits.max_tokens):
        raise BadRequestError("max_tokens", f"must be an integer in [1, {limits.max_tokens}], got {p.max_tokens!r}")
    if p.stop is not None:
        if len(p.stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in p.stop):
            raise BadRequestError("stop", f"at most {limits.max_stop} strings of at most {limits.max_stop_chars} characters")
    if p.stop_token_ids is not None and len(p.stop_token_ids) > limits.max_stop_token_ids:
        raise BadRequestError("stop_token_ids", f"at most {limits.max_stop_token_ids} ids")
    p.validate(vocab_size=1 << 31)  # ranges; the worker checks ids against the real vocabulary


def validate_choose(msg: Choose, limits: Limits = DEFAULT_LIMITS) -> None:
    """Check every client-controlled size of a choose; raises :class:`BadRequestError`."""
    _check_id(msg.id, limits)
    if (msg.prompt is None) == (msg.token_ids is None):
        raise BadRequestError("prompt", "give exactly one of prompt (text) or token_ids")
    if not (msg.prompt or msg.token_ids):
        raise BadRequestError("prompt", "is empty")
    if msg.prompt is not None:
        _check_chars(msg.prompt, limits)
    if msg.token_ids is not None:
        check_prompt_tokens(msg.token_ids, limits)
    check_choices(msg.choices, msg.normalize, msg.temperature)
    chars = sum(map(len, msg.choices))
    if chars > limits.max_choice_chars:
        raise TooLongError(
            "choices", f"have {chars} characters in all; the limit is {limits.max_choice_chars} (max_choice_chars): send fewer or shorter choices"
        )
    _check_namespace(msg.namespace, limits)


def check_choices(choices: Sequence, normalize: str, temperature: float) -> None:
    """A choose call's choices (1..MAX_CHOICES, none empty), ``normalize`` and ``temperature``."""
    if not isinstance(choices, (list, tuple)) or not 1 <= len(choices) <= MAX_CHOICES:
        got = len(choices) if isinstance(choices, (list, tuple)) else type(choices).__name__
        raise BadRequestError("choices", f"must hold 1..{MAX_CHOICES} choices, got {got}")
    if any(not c for c in choices):
        raise BadRequestError("choices", "must be non-empty")
    if normalize not in NORMALIZE:
        raise BadRequestError("normalize", f"must be one of {NORMALIZE}, got {normalize!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise BadRequestError("temperature", f"must be >= 0, got {temperature!r}")


def _check_id(rid: str, limits: Limits) -> None:
    if not rid or len(rid) > limits.max_id_chars:
        raise BadRequestError("id", f"must be 1..{limits.max_id_chars} characters")


def _check_chars(prompt: str, limits: Limits) -> None:
    if len(prompt) > limits.max_prompt_chars:
        raise BadRequestError("prompt", f"has {len(prompt)} characters; the limit is {limits.max_prompt_chars}")


def check_prompt_tokens(ids: list[int], limits: Limits) -> None:
    """A prompt's tokens against ``max_prompt_tokens`` (given as ids, or as text once tokenized)."""
    if len(ids) > limits.max_prompt_tokens:
        raise TooLongError("prompt", f"has {len(ids)} tokens; the router accepts at most {limits.max_prompt_tokens}")


def _check_namespace(namespace: str | None, limits: Limits) -> None:
    if namespace is not None and len(namespace) > limits.max_namespace_chars:
        raise BadRequestError("namespace", f"must be at most {limits.max_namespace_chars} characters")
