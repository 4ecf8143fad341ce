"""Issue 49 item 9: the ZMQ client socket keeps tenants apart as HTTP does. An in-process router
with API keys, a fake worker (raw ZMQ, holding the worker secret) and SDK clients."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from radixserve import protocol as P
from radixserve.client import Client
from radixserve.errors import OverloadedError, RadixServeError, UnauthorizedError
from radixserve.serve import auth
from radixserve.serve.router import Job, Router, RouterConfig
from radixserve.serve.router.fair_queue import FairQueue
from radixserve.serve.router.sockets import is_local_address

from serve_cluster import ENV, running_router

pytestmark = pytest.mark.timeout(120)

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
PIN = [11, 22, 33, 44, 5, 6, 7, 8]  # alice's cached prompt (a 4-digit PIN, as the attacker read it)


class FakeWorker:
    """A registered worker that records the work it gets and answers only when told to."""

    def __init__(self, router: Router):
        self.ctx = zmq.Context()
        s = self.sock = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, b"w0/s")
        auth.make_client(s, router.secret)
        s.connect(router.worker_address)
        s.send(P.encode(P.Register(worker="w0", pid=4242, max_model_len=4096, session="s")))
        assert self.recv(P.Ping) is not None

    def recv(self, kind, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            msg = P.decode(self.sock.recv(), max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)
            if isinstance(msg, kind):
                return msg
        return None

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def finish(self, work: P.Work) -> None:
        self.send(
            P.Final(
                id=work.id,
                token_ids=[1],
                text="x",
                finish_reason="length",
                usage=P.Usage(prompt_tokens=len(work.token_ids), cached_tokens=0, completion_tokens=1),
                timings=P.Timings(queue_s=0.0, ttft_s=0.0, e2e_s=0.0),
            )
        )

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture()
def keyed():
    with running_router(RouterConfig(port=0, api_keys=KEYS, max_queue=8, max_inflight_per_worker=1, heartbeat_timeout_s=30.0)) as router:
        worker = FakeWorker(router)
        yield router, worker
        worker.close()


def test_a_keyless_or_other_tenants_client_cannot_probe_a_tenants_cache(keyed):
    """The repro: a keyless client read alice's cached PIN through stats(probe=..., namespace=...).
    Without a key it now gets `unauthorized`; with bob's key the namespace it names is bob's own."""
    router, worker = keyed
    alice_ns = router.tenants.namespace("alice")
    worker.send(P.CacheEvents(worker="w0", events=[P.CacheEvent("insert", alice_ns, PIN)], seq=1, reset=True))
    with Client(router.address, timeout=10, api_key="sk-alice") as alice:
        deadline = time.monotonic() + 5
        while alice.stats(probe=PIN)["probe"]["w0"] != len(PIN):  # alice sees her own cache
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with Client(router.address, timeout=10, api_key="") as anon:
        for call in (
            lambda: anon.stats(probe=PIN, namespace=alice_ns),
            lambda: anon.stats(),
            lambda: anon.generate(PIN, max_tokens=1, namespace=alice_ns),
            lambda: anon.choose(PIN, ["a", "b"], namespace=alice_ns),
        ):
            with pytest.raises(UnauthorizedError, match="requires an API key"):
                call()
        assert anon.health()["workers_alive"] == 1  # health needs no key
    with Client(router.address, timeout=10, api_key="sk-mallory") as mallory:
        with pytest.raises(UnauthorizedError, match="unknown API key"):
            mallory.stats(probe=PIN, namespace=alice_ns)
    with Client(router.address, timeout=10, api_key="sk-bob") as bob:
        for ns in (alice_ns, None, "tenant-a"):
            assert bob.stats(probe=PIN, namespace=ns)["probe"]["w0"] == 0


def test_generation_runs_in_the_namespace_derived_from_the_key(keyed):
    router, worker = keyed
    bob_ns = router.tenants.namespace("bob")
    with Client(router.address, timeout=10, api_key="sk-bob") as bob:
        for asked, expected in (
            (router.tenants.namespace("alice"), f"{bob_ns}/{router.tenants.namespace('alice')}"),
            (None, bob_ns),
            ("agents", f"{bob_ns}/agents"),
        ):
            call = bob._run(_start(bob._async.generate([1, 2, 3], max_tokens=1, namespace=asked)))
            work = worker.recv(P.Work)
            assert work is not None and work.namespace == expected
            worker.finish(work)
            assert bob._run(_wait(call)).text == "x"
    # the in-process HTTP gateway's key: it authenticated its tenants, the router keeps its namespace
    with Client(router.address, timeout=10, api_key=router.gateway_key) as gateway:
        call = gateway._run(_start(gateway._async.generate([1, 2, 3], max_tokens=1, namespace="t-0123")))
        work = worker.recv(P.Work)
        assert work is not None and work.namespace == "t-0123"
        worker.finish(work)
        assert gateway._run(_wait(call)).text == "x"


async def _start(coro):
    import asyncio

    return asyncio.ensure_future(coro)


async def _wait(task):
    return await task


def test_one_tenant_filling_the_queue_does_not_lock_out_another(keyed):
    """The repro, made small: a client that filled the queue made every other tenant's request
    `overloaded` (503 over HTTP). The queue is now fair: bob's request pushes out alice's newest,
    and tenants are served in turn."""
    router, worker = keyed
    with Client(router.address, timeout=20, api_key="sk-alice") as alice, Client(router.address, timeout=20, api_key="sk-bob") as bob:
        flood = [alice._run(_start(alice._async.generate([1, i + 2], max_tokens=1))) for i in range(12)]
        first = worker.recv(P.Work)  # one in flight (the cap is 1), 8 queued, 3 refused
        assert first is not None
        deadline = time.monotonic() + 5
        while router.stats()["router"]["gauges"]["queue_depth"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim = bob._run(_start(bob._async.generate([9, 9], max_tokens=1)))
        deadline = time.monotonic() + 5
        while router.counters["queue_pushed_out"] < 1:
            assert time.monotonic() < deadline, router.counters
            time.sleep(0.02)
        worker.finish(first)
        second = worker.recv(P.Work)  # alice's queue and bob's were both never served: the older head first
        worker.finish(second)
        third = worker.recv(P.Work)  # then bob's, not after alice's 7 others
        assert third is not None and third.token_ids == [9, 9], third
        worker.finish(third)
        assert bob._run(_wait(victim)).text == "x"
        while True:  # let alice's queue drain
            work = worker.recv(P.Work, timeout_s=1.0)
            if work is None:
                break
            worker.finish(work)
        results = [alice._run(_gather(f)) for f in flood]
        refused = [r for r in results if isinstance(r, OverloadedError)]
        assert len(refused) == 4 and any("hold the most" in str(r) for r in refused), results


async def _gather(task):
    try:
        return await task
    except RadixServeError as exc:
        return exc


def test_fair_queue_serves_tenants_in_turn():
    q = FairQueue()
    jobs = [Job(n=i, client=b"c", cid=str(i), token_ids=[1], params=None, namespace=None, stream=False, arrival=0.0, tenant=t) for i, t in enumerate("aaaab")]
    for j in jobs:
        q.append(j)
    assert [q.popleft().tenant for _ in range(3)] == ["a", "b", "a"] and len(q) == 2
    q.append(Job(n=9, client=b"c", cid="9", token_ids=[1], params=None, namespace=None, stream=False, arrival=0.0, tenant="c"))
    assert q.popleft().tenant == "c"  # arrived after "a" was served: goes first
    assert q.push_out("c") is jobs[3] and q.push_out("c") is None  # "a" now holds 1: not 2 more than "c"
    q.appendleft(jobs[0])
    assert [j.n for j in q] == [0, 2]


def test_the_client_socket_is_not_opened_to_the_network_without_keys():
    assert is_local_address("tcp://127.0.0.1:7700") and is_local_address("ipc:///tmp/x")
    assert is_local_address("tcp://[::1]:7700") and is_local_address("tcp://localhost:7700")
    assert not is_local_address("tcp://0.0.0.0:7700") and not is_local_address("tcp://*:7700")
    with pytest.raises(RadixServeError, match="without API keys"):
        Router(RouterConfig(host="0.0.0.0", port=0)).bind()
    router = Router(RouterConfig(host="0.0.0.0", port=0, api_keys=KEYS))
    try:
        assert router.bind().startswith("tcp://0.0.0.0:")
    finally:
        router.close(linger=0)
    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--host", "0.0.0.0", "--port", "0"], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and "without API keys" in out.stderr, out.stderr
