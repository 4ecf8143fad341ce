"""The engine thread's inbox: typed commands, put by any thread, applied in arrival order by the
engine thread between steps (or by :meth:`Engine.step` when no thread runs)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from radixserve.engine.request import Request, StreamChunk

OnChunk = Callable[[StreamChunk], None]


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue ``req``; ``on_chunk`` gets its chunks (see :meth:`Engine.add_request`)."""

    req: Request
    on_chunk: OnChunk | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """End a request with finish_reason 'abort' (unknown or finished ids are ignored)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Unpin:
    """Drop a pin; ``reply(found)`` is called on the engine thread."""

    namespace: Hashable
    prompt_ids: tuple[int, ...]
    reply: Callable[[bool], None]


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn()`` on the engine thread between steps (snapshots, wake-ups)."""

    fn: Callable[[], None]


Command = AddRequest | AbortRequest | Unpin | Call
