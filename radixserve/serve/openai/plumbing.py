"""Request plumbing of the gateway: reading a bounded JSON body, starting a request's router calls
at once, and running a call that is cancelled (aborting its router requests) when the client goes
away."""

from __future__ import annotations

import asyncio

import msgspec

from radixserve.serve.openai.errors import APIError, bad


async def _read_body(request, limit: int) -> bytes:
    """The request body; 413 past ``limit`` bytes (declared or read so far)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad(None, "invalid Content-Length")
        if int(length) > limit:
            raise APIError(413, f"request body is {length} bytes; the limit is {limit}", code="request_too_large")
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # the client left, or its body was too late (answered 408 by the server)
        raise APIError(499, "client closed the request", code="client_closed") from None
    return b"".join(chunks)


async def read_json(request, limit: int) -> dict:
    """The request body as a JSON object (400 when it is not one)."""
    raw = await _read_body(request, limit)
    if not raw:
        raise bad(None, "the request body is empty; send a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad(None, f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise bad(None, "the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    return body


async def with_disconnect(request, coro):
    """Run ``coro``; cancel it (aborting its router requests) if the client goes away."""
    task = asyncio.ensure_future(coro)

    async def gone():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Wait for the cancellation to land: reading the result of a task that is still
            # cancelling raised InvalidStateError (a logged 500 for a client that left).
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "client closed the request", code="client_closed")
    return task.result()


def start_all(client, jobs, namespace) -> list[asyncio.Future]:
    """A task per job, its request sent to the router before this returns (``start_generate``;
    a stand-in client without it: at the task's first step). In a burst, the requests sent
    at once reach the router while the gateway takes in the rest, so its admission view
    turns to refusing within the burst, not after it (a 300-request burst's first request
    used to leave after the whole burst's intake, two task hops later)."""
    start = getattr(client, "start_generate", None)
    tasks: list[asyncio.Future] = []
    try:
        for _, p, sp in jobs:
            if start is not None:
                tasks.append(start(p, namespace=namespace, timeout=None, params=sp))
            else:
                tasks.append(asyncio.ensure_future(client.generate(p, namespace=namespace, timeout=None, params=sp)))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return tasks


async def gather_all(tasks: list[asyncio.Future]) -> list:
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
