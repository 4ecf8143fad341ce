"""Issue 49 (hardening round 2): the SDK honours its timeout against a router that refuses its
connection. ``bench reliability --scenario idle-sockets`` hung for ever on a new client while the
router sat at its client cap: libzmq drops a connection refused at the handshake and never
retries, so the client's DEALER has no pipe and an awaited send on it never returns (the abort
sent when the call timed out did). Every call must end within its timeout (here: at once, with a
coded error saying the router refused the connection), leaving ``async with`` must not hang, and
the next call connects anew."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import zmq

from radixserve.client import AsyncClient, Client
from radixserve.errors import RequestTimeoutError, RouterLostError, RouterRefusedError
from radixserve.serve.router import RouterConfig

from serve_cluster import running_router

pytestmark = pytest.mark.timeout(90)

T = 2.0  # the calls' timeout
SLACK = 1.5


def _fill(router, ctx: zmq.Context, n: int) -> list[zmq.Socket]:
    """``n`` idle client connections, admitted (the router counts them) before returning."""
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(router.address)
        socks.append(s)
    deadline = time.monotonic() + 10
    while router.transport.clients < n:
        assert time.monotonic() < deadline, router.transport.clients
        time.sleep(0.02)
    time.sleep(0.2)  # their handshakes (admitted at the ZAP handler)
    return socks


@pytest.fixture
def full_router():
    """A router at its client cap: two idle connections, then max_clients lowered to 1 (set
    before them, whether the second got in would depend on when the router counted it)."""
    ctx = zmq.Context()
    with running_router(RouterConfig(port=0)) as router:
        socks = _fill(router, ctx, 2)
        router.transport.max_clients = 1
        try:
            yield router, socks
        finally:
            ctx.destroy(linger=0)


async def _ends_in_time(coro, limit: float = T + SLACK):
    """(the exception ``coro`` raised, seconds it took); a hang fails here, not at pytest's timeout."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(coro, limit + 5.0)
    except asyncio.TimeoutError:
        pytest.fail(f"the call hung (still pending {limit + 5.0:g} s later; its timeout was {T:g} s)")
    except Exception as exc:  # noqa: BLE001
        return exc, time.monotonic() - t0
    pytest.fail("the call succeeded against a router that refused the connection")


async def _drain(agen):
    async for _ in agen:
        pass


def _assert_refused(exc: BaseException, took: float) -> None:
    assert isinstance(exc, (RouterRefusedError, RequestTimeoutError)), repr(exc)
    assert took < T + SLACK, took
    assert isinstance(exc, RouterRefusedError), repr(exc)  # told, not just timed out
    assert exc.code == "router_refused" and "max_clients" in str(exc) and "did not accept" in str(exc), str(exc)


def test_async_calls_end_within_their_timeout_when_the_router_refuses_the_connection(full_router):
    router, _ = full_router

    async def main():
        t0 = time.monotonic()
        async with AsyncClient(router.address, timeout=T, router_timeout=None) as c:
            _assert_refused(*await _ends_in_time(c.generate([1, 2, 3], max_tokens=2)))
            # Again on the same client, and each kind of call.
            _assert_refused(*await _ends_in_time(c.generate([1, 2, 3], max_tokens=2)))
            _assert_refused(*await _ends_in_time(_drain(c.stream([1, 2, 3], max_tokens=2))))
            _assert_refused(*await _ends_in_time(c.choose([1, 2], ["a", "b"])))
            _assert_refused(*await _ends_in_time(c.health(timeout=T)))
            _assert_refused(*await _ends_in_time(c.stats(timeout=T)))
            exits = time.monotonic()
        assert time.monotonic() - exits < 1.0  # leaving `async with` does not hang
        return time.monotonic() - t0

    assert asyncio.run(asyncio.wait_for(main(), 60)) < 6 * (T + SLACK)


def test_a_refused_client_connects_anew_once_the_router_has_room(full_router):
    router, socks = full_router

    async def main():
        async with AsyncClient(router.address, timeout=T, router_timeout=None) as c:
            _assert_refused(*await _ends_in_time(c.health(timeout=T)))
            for s in socks:  # the idle connections go: room again
                s.close(linger=0)
            deadline = time.monotonic() + 10
            while router.transport.clients > 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            h = await asyncio.wait_for(c.health(timeout=T), T + SLACK)
            assert h["workers_alive"] == 0

    asyncio.run(asyncio.wait_for(main(), 60))


def test_timeout_none_still_ends_when_refused(full_router):
    router, _ = full_router

    async def main():
        async with AsyncClient(router.address, timeout=None, heartbeat=0.25, router_timeout=2.0) as c:
            for _ in range(2):
                _assert_refused(*await _ends_in_time(c.generate([1, 2, 3], max_tokens=2)))

    asyncio.run(asyncio.wait_for(main(), 60))


def test_sync_client_calls_end_within_their_timeout_when_refused(full_router):
    router, _ = full_router
    results: list = []

    def run():
        t0 = time.monotonic()
        with Client(router.address, timeout=T, router_timeout=None) as c:
            for call in (
                lambda: c.generate([1, 2, 3], max_tokens=2),
                lambda: list(c.stream([1, 2, 3], max_tokens=2)),
                lambda: c.health(timeout=T),
            ):
                t = time.monotonic()
                try:
                    call()
                    results.append(("ok", 0.0))
                except Exception as exc:  # noqa: BLE001
                    results.append((exc, time.monotonic() - t))
            exits = time.monotonic()
        results.append(("exit", time.monotonic() - exits, time.monotonic() - t0))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), f"the sync client hung; done so far: {results}"
    *calls, (_, exit_s, _) = results
    assert len(calls) == 3 and exit_s < 1.0, results
    for exc, took in calls:
        _assert_refused(exc, took)


def _dead_address() -> str:
    """A loopback port nothing listens on (connections to it are refused and retried)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_heartbeat_ends_calls_whose_send_blocks_with_no_router(tmp_path):
    """timeout=None, no router at all: more calls than the socket's send queue (SNDHWM 1000)
    holds. Those past it wait to send; the heartbeat watchdog (router_timeout) must end them too,
    not only those already sent."""
    address = _dead_address()

    async def main():
        async with AsyncClient(address, timeout=None, heartbeat=0.25, router_timeout=1.5) as c:
            t0 = time.monotonic()
            calls = [asyncio.ensure_future(c.generate([1, 2, 3], max_tokens=2)) for _ in range(1200)]
            done, pending = await asyncio.wait(calls, timeout=15.0)
            took = time.monotonic() - t0
            for f in pending:
                f.cancel()
            assert not pending, f"{len(pending)} of {len(calls)} calls still pending {took:.1f} s later"
            errors = [f.exception() for f in done]
            assert all(isinstance(e, RouterLostError) for e in errors), {type(e).__name__ for e in errors}
            assert took < 1.5 + 3.0, took

    asyncio.run(asyncio.wait_for(main(), 60))
