"""Issue 13 item 5: the SDK detects a lost router by heartbeat and fails pending calls with a code."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from radixserve import protocol as P
from radixserve.client import AsyncClient
from radixserve.errors import RouterLostError, error_from_code

pytestmark = pytest.mark.timeout(60)


class _SilentRouter:
    """Answers health probes until ``die`` is set, never answers a generate, then goes away."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.die = threading.Event()
        self.health_probes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.die.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = P.decode(frame)
            if isinstance(msg, P.Health):
                self.health_probes += 1
                self.sock.send_multipart([ident, P.encode(P.HealthReply(id=msg.id, status="ok", workers=1, workers_alive=1))])
        self.sock.close(linger=0)
        self.ctx.term()


def test_pending_calls_fail_with_router_lost_even_without_timeout():
    router = _SilentRouter()

    async def main():
        async with AsyncClient(router.address, timeout=None, heartbeat=0.25, router_timeout=2.0) as client:
            call = asyncio.ensure_future(client.generate([1, 2, 3], max_tokens=4))
            await asyncio.sleep(4.0)  # a slow request on a live router: heartbeats keep it pending
            assert not call.done()
            probes = router.health_probes
            router.die.set()
            t0 = time.monotonic()
            with pytest.raises(RouterLostError) as info:
                await call
            return probes, time.monotonic() - t0, info.value

    probes, waited, exc = asyncio.run(main())
    assert probes >= 3  # the client probed the quiet (but live) router
    assert exc.code == "router_lost" and waited < 10.0


def test_router_lost_code_maps_to_its_exception():
    exc = error_from_code("router_lost", "gone")
    assert isinstance(exc, RouterLostError) and isinstance(exc, ConnectionError)
