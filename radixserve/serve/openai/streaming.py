"""Streamed completions (``stream: true``): server-sent events ending with ``data: [DONE]``.

All choices of a request stream through one queue of ``(index, item, exception)``: a Chunk of new
text, the Completion that ends a choice, or the error that ended it (sent as an OpenAI error
event, then the stream ends)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.serve.openai import responses as R
from radixserve.serve.openai.errors import api_error_from


def open_streams(client, jobs, namespace) -> tuple[asyncio.Queue, list[asyncio.Future]]:
    """Start streaming every job; their items arrive on the returned queue."""
    queue: asyncio.Queue = asyncio.Queue()

    async def one(index, prompt, sp):
        try:
            async for item in client.stream(prompt, namespace=namespace, timeout=None, params=sp):
                queue.put_nowait((index, item, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    return queue, [asyncio.ensure_future(one(i, p, sp)) for i, p, sp in jobs]


async def sse_events(prep, first, queue: asyncio.Queue, logprobs: Callable[[Any, bool], Any]) -> AsyncIterator[bytes]:
    """The events of a stream whose first item (already taken from ``queue``) is ``first``."""
    from radixserve.client import Completion

    chat, rid, created = prep.chat, prep.new_id(), int(time.time())
    finals: dict[int, Any] = {}
    tools = prep.tools if prep.tools is not None and prep.tools.parses else None
    calls = {i: tools.stream() for i, _, _ in prep.jobs} if tools is not None else {}

    def event(choices, usage=None) -> bytes:
        return R.sse(prep.response(choices, usage, chunk=True, rid=rid, created=created))

    if chat:
        for i, _, _ in prep.jobs:
            yield event([R.role_choice(i)])
    item = first
    while True:
        index, msg, exc = item
        if exc is not None:
            yield R.sse(api_error_from(exc, "messages" if chat else "prompt", prep.max_tokens_param).body())
            break
        if isinstance(msg, Completion):
            finals[index] = msg
            reason = msg.finish_reason
            if index in calls:  # the calls' last pieces, then finish_reason tool_calls if it made some
                text, deltas = calls[index].finish()
                if text or deltas:
                    yield event([R.chunk_choice(index, text, None, None, chat, tool_calls=deltas)])
                if calls[index].calls and reason == "stop":
                    reason = "tool_calls"
            yield event([R.chunk_choice(index, None, None, reason, chat)])
            if len(finals) == len(prep.jobs):
                if prep.include_usage:
                    yield event([], R.usage([finals[i] for i, _, _ in prep.jobs], prep.n))
                break
        else:
            text, deltas = calls[index].feed(msg.text) if index in calls else (msg.text, None)
            if text or deltas or getattr(msg, "logprobs", None) or (prep.return_token_ids and msg.token_ids):
                lps = logprobs(getattr(msg, "logprobs", None), chat)
                ids = msg.token_ids if prep.return_token_ids else None
                yield event([R.chunk_choice(index, text, lps, None, chat, ids, deltas)])
        item = await queue.get()
    yield b"data: [DONE]\n\n"
