"""Wire protocol: msgspec Structs encoded as msgpack, tagged by ``type``, over ZMQ.

Sockets: the router binds two ROUTER sockets, one for clients (SDK, ``radixserve stats``, the
HTTP gateway) and one for workers (CURVE-authenticated with the shared worker secret, see
:mod:`radixserve.serve.auth`); peers connect DEALER sockets. Every ZMQ message is one frame holding one encoded Struct (the
ROUTER adds the peer identity frame). No pickle anywhere.

Client -> router: :class:`Generate`, :class:`Choose`, :class:`Abort`, :class:`Health`, :class:`Stats`.
Router -> client: :class:`Chunk` (streamed tokens), then exactly one :class:`Final` or
:class:`Error` per generate; exactly one :class:`ChoiceFinal` or :class:`Error` per choose;
:class:`HealthReply`, :class:`StatsReply`.
Worker -> router: :class:`Register`, :class:`Heartbeat`, :class:`CacheEvents`, :class:`Chunk`,
:class:`Final`, :class:`ChoiceFinal`, :class:`Error`, :class:`Goodbye`. Router -> worker: :class:`Work`, :class:`ChooseWork`,
:class:`Abort`, :class:`Ping`, :class:`Shutdown`, :class:`Refused`.

Every request carries a request ``id`` (chosen by the caller, unique per connection) and the
protocol version ``v``; a mismatch is answered with ``bad_request``. When the server has API keys,
:class:`Generate`, :class:`Choose` and :class:`Stats` must carry one (``api_key``; else
``unauthorized``), and the cache namespace is derived from its tenant on the server (a client's
``namespace`` only subdivides its own tenant's). Every peer-controlled size is bounded
(:class:`~radixserve.limits.Limits`, checked by the router with :func:`validate_generate` /
:func:`validate_choose`, both in :mod:`radixserve.limits`); a frame larger than ``max_frame_bytes``
or one that does not decode gets an :class:`Error` reply and the server keeps going.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import msgspec

from radixserve.errors import (  # noqa: F401  (the error codes live in errors.py; re-exported here)
    BAD_REQUEST,
    ERROR_CODES,
    INTERNAL,
    OVERLOADED,
    SHUTTING_DOWN,
    TOO_LONG,
    WORKER_LOST,
    BadRequestError,
    TooLongError,
)
from radixserve.limits import (  # noqa: F401  (the limits and their checks live in limits.py; re-exported here)
    DEFAULT_LIMITS,
    Limits,
    validate_choose,
    validate_generate,
)
from radixserve.sampling_params import SamplingParams
from radixserve.validation import explain

PROTOCOL_VERSION = 1
WORKER_MAX_FRAME_BYTES = 256 * 2**20  # workers are trusted peers; cache-event batches can be big


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    pass


# ------------------------------------------------------------------------------ client -> router
class Generate(_Msg, tag="generate"):
    id: str
    prompt: str | None = None
    token_ids: list[int] | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    namespace: str | None = None
    stream: bool = False
    api_key: str | None = None  # the tenant's key, required when the server has keys (serve --api-key)
    v: int = PROTOCOL_VERSION


class Choose(_Msg, tag="choose"):
    """Rank ``choices`` as continuations of the prompt by token log-probabilities."""

    id: str
    choices: list[str]
    prompt: str | None = None
    token_ids: list[int] | None = None
    normalize: str = "sum"  # sum | mean
    temperature: float = 0.0
    seed: int | None = None
    namespace: str | None = None
    api_key: str | None = None  # the tenant's key, required when the server has keys (serve --api-key)
    v: int = PROTOCOL_VERSION


class Abort(_Msg, tag="abort"):
    id: str
    v: int = PROTOCOL_VERSION


class Health(_Msg, tag="health"):
    id: str
    v: int = PROTOCOL_VERSION


class Stats(_Msg, tag="stats"):
    id: str
    # optional probe: per-worker cached-prefix length of these tokens in the router's index
    probe: str | list[int] | None = None
    namespace: str | None = None
    api_key: str | None = None  # the tenant's key, required when the server has keys (serve --api-key)
    v: int = PROTOCOL_VERSION


# ------------------------------------------------------------------------------ replies
class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Timings(msgspec.Struct, kw_only=True):
    queue_s: float
    ttft_s: float
    e2e_s: float


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's logprob and its top-n alternatives (token id, logprob), best first;
    the engine's chunks carry this type as it is."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class ChoiceUsage(msgspec.Struct, kw_only=True):
    """Token accounting of one choose call. ``query_tokens``/``cached_tokens`` sum over its
    sub-requests (the prompt prefill, then one per choice); ``prompt_cached_tokens`` is the
    prompt's own hit from earlier calls."""

    prompt_tokens: int
    choice_tokens: int
    query_tokens: int = 0
    cached_tokens: int = 0
    prompt_cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        return self.query_tokens - self.cached_tokens


class RankedChoice(NamedTuple):
    choice: str
    logprob_sum: float
    logprob_mean: float
    n_tokens: int


class Chunk(_Msg, tag="chunk"):
    id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprob] | None = None


class Final(_Msg, tag="final"):
    id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    timings: Timings
    worker: str = ""
    logprobs: list[TokenLogprob] | None = None


class ChoiceFinal(_Msg, tag="choice_final"):
    id: str
    best: str
    index: int
    ranked: list[RankedChoice]  # (choice, logprob_sum, logprob_mean, n_tokens), best first
    usage: ChoiceUsage
    timings: Timings
    worker: str = ""


class Error(_Msg, tag="error"):
    id: str
    code: str
    message: str


class HealthReply(_Msg, tag="health_reply"):
    id: str
    status: str  # ok | degraded (no live worker) | shutting_down
    workers: int
    workers_alive: int
    v: int = PROTOCOL_VERSION


class StatsReply(_Msg, tag="stats_reply"):
    id: str
    stats: dict[str, Any]


# ------------------------------------------------------------------------------ router <-> worker
class Register(_Msg, tag="register"):
    worker: str
    pid: int
    host: str = ""
    max_model_len: int = 0
    kv_total_tokens: int = 0
    page_size: int = 1
    active: list[str] = msgspec.field(default_factory=list)  # work ids it is running (re-registration)
    fingerprint: str = ""  # the model's (auth.model_fingerprint); the router refuses a mismatch
    session: str = ""  # random per worker process: the same session registering again is not a restart
    v: int = PROTOCOL_VERSION


class Refused(_Msg, tag="refused"):
    """Router -> worker: the registration is refused (e.g. another model); the worker exits."""

    reason: str


class Heartbeat(_Msg, tag="heartbeat"):
    worker: str
    running: int = 0
    waiting: int = 0
    stats: dict[str, Any] = msgspec.field(default_factory=dict)
    events_seq: int = 0  # the last CacheEvents seq sent before it: the router notices a lost last batch
    reset_seq: int = 0  # the seq of the last snapshot sent: the router notices a lost snapshot


class CacheEvent(msgspec.Struct, array_like=True):
    kind: str  # insert | evict
    namespace: str | None
    tokens: list[int]  # root to the end of the inserted leaf / evicted node
    length: int = 0  # evict: the evicted node's own length (its tail of `tokens`)


class CacheEvents(_Msg, tag="cache_events"):
    worker: str
    events: list[CacheEvent]
    seq: int = 0  # 1, 2, ... per worker process: a gap means events were lost (the router resyncs)
    reset: bool = False  # a snapshot: clear the mirror first (the events are the whole tree's leaves)


class Goodbye(_Msg, tag="goodbye"):
    """Worker -> router: draining (finish what runs, route nothing new here)."""

    worker: str


class Leave(_Msg, tag="leave"):
    """Worker -> router: gone now (after draining); the router forgets it at once."""

    worker: str


class Rejoin(_Msg, tag="rejoin"):
    """Router -> worker: register again and send a cache snapshot (the router does not know
    this connection, or lost some of its cache events)."""

    reason: str = ""
    register: bool = True  # False: only send a snapshot (the index lost events; the rest is fine)


class Work(_Msg, tag="work"):
    id: str  # the router's work id (one per attempt)
    token_ids: list[int]
    params: SamplingParams
    namespace: str | None = None
    stream: bool = False


class ChooseWork(_Msg, tag="choose_work"):
    id: str
    token_ids: list[int]
    choices: list[str]
    choice_ids: list[list[int]]
    normalize: str = "sum"
    temperature: float = 0.0
    seed: int | None = None
    namespace: str | None = None


class Ping(_Msg, tag="ping"):
    pass


class Shutdown(_Msg, tag="shutdown"):
    grace_s: float = 5.0


Message = (
    Generate
    | Abort
    | Health
    | Stats
    | Chunk
    | Final
    | Error
    | HealthReply
    | StatsReply
    | Register
    | Heartbeat
    | CacheEvents
    | Goodbye
    | Work
    | Ping
    | Shutdown
    | Choose
    | ChoiceFinal
    | ChooseWork
    | Refused
    | Leave
    | Rejoin
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


class DecodeError(BadRequestError):
    """A frame that is not a valid message; ``request_id`` is recovered when possible. ``field``
    is ``frame``, or the sampling parameter whose constraint the frame broke."""

    def __init__(self, message: str, request_id: str = "", field: str = "frame"):
        super().__init__(field, message)
        self.request_id = request_id


def decode(frame: bytes, *, max_frame_bytes: int | None = None) -> _Msg:
    """Decode one frame; raise :class:`DecodeError` (with the request id when it can be read)."""
    if max_frame_bytes is not None and len(frame) > max_frame_bytes:
        raise DecodeError(f"is {len(frame)} bytes; the limit is {max_frame_bytes} bytes")
    try:
        msg = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        field, rule = explain(exc)
        if field.startswith("params.") and "." not in field[7:]:  # a SamplingParams range: name the parameter
            field = field[7:]
            raise DecodeError(explain(exc, SamplingParams)[1] if field in SamplingParams.__struct_fields__ else rule, _guess_id(frame), field=field) from None
        raise DecodeError(f"is not a valid protocol message ({exc})", _guess_id(frame)) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"is not a valid protocol message ({exc})", _guess_id(frame)) from None
    except RecursionError:
        raise DecodeError("nests too deeply to be a protocol message", _guess_id(frame)) from None
    v = getattr(msg, "v", PROTOCOL_VERSION)
    if v != PROTOCOL_VERSION:
        raise DecodeError(f"protocol version {v} is not supported; this server speaks {PROTOCOL_VERSION}", getattr(msg, "id", ""))
    return msg


RECV_BATCH = 64  # frames a receive loop takes before it gives the rest of its event loop a turn
_T = TypeVar("_T")


async def received(recv: Callable[[], Awaitable[_T]]) -> AsyncIterator[_T]:
    """What ``await recv()`` returns, again and again, with a turn for the other tasks of the event
    loop every :data:`RECV_BATCH` frames. pyzmq's asyncio ``recv`` returns without suspending while
    frames are queued: a receive loop over a flooded socket kept every other task (the other
    socket, timers, the HTTP gateway's requests) waiting for as long as the flood lasted."""
    while True:
        for _ in range(RECV_BATCH):
            yield await recv()
        await asyncio.sleep(0)


def _guess_id(frame: bytes) -> str:
    try:
        raw = msgspec.msgpack.decode(frame)
    except RecursionError:  # too deep to decode: the id usually comes before the deep part
        return _scan_id(frame)
    except Exception:
        return ""
    rid = raw.get("id") if isinstance(raw, dict) else None
    return rid[:128] if isinstance(rid, str) else ""


def _scan_id(frame: bytes) -> str:
    """The ``id`` of a msgpack map read entry by entry while keys and values are short strings
    (msgspec writes ``type`` and ``id`` first); "" when it cannot be found that way."""

    def string(at: int) -> tuple[str, int] | None:
        b = frame[at] if at < len(frame) else None
        if b is None:
            return None
        if 0xA0 <= b <= 0xBF:
            n, at = b & 0x1F, at + 1
        elif b == 0xD9 and at + 1 < len(frame):
            n, at = frame[at + 1], at + 2
        else:
            return None
        try:
            return frame[at : at + n].decode(), at + n
        except UnicodeDecodeError:
            return None

    if not frame or not 0x80 <= frame[0] <= 0x8F:  # a fixmap (at most 15 fields)
        return ""
    at = 1
    for _ in range(frame[0] & 0x0F):
        key = string(at)
        value = string(key[1]) if key is not None else None
        if key is None or value is None:
            return ""
        if key[0] == "id":
            return value[0][:128]
        at = value[1]
    return ""
