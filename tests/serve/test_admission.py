"""The router's admission view (issue 49, HTTP overload): what the in-process HTTP gateway reads to
answer 503 ``overloaded`` without a round trip. It must never refuse what the router would admit:
replayed against the router itself, its answer is the router's, tenant by tenant."""

from __future__ import annotations

import random
import time

import pytest
from test_remote_workers import _RecordingTransport  # (the router's transport without sockets)

from radixserve import protocol as P
from radixserve.sampling_params import SamplingParams
from radixserve.serve.router import Router, RouterConfig
from radixserve.serve.router.admission import AdmissionView, http_tenant
from radixserve.serve.router.fair_queue import FairQueue

pytestmark = pytest.mark.timeout(60)


def _router(**config) -> tuple[Router, list]:
    router = Router(RouterConfig(**config), transport=_RecordingTransport)
    assert isinstance(router.transport, _RecordingTransport)
    return router, router.transport.sent


def _final(work_id: str) -> P.Final:
    return P.Final(
        id=work_id,
        token_ids=[1],
        text="x",
        finish_reason="length",
        usage=P.Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=1),
        timings=P.Timings(queue_s=0.0, ttft_s=0.0, e2e_s=0.0),
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_view_refuses_exactly_what_the_router_refuses(seed):
    """Random generates from 3 clients (3 tenants: the fair queue's push-out decides too),
    finals, aborts and a second worker coming and going: before each generate, the published
    view's answer for its tenant equals the router's answer to it."""
    rng = random.Random(seed)
    router, out = _router(max_inflight_per_worker=2, max_queue=rng.choice([0, 1, 3, 5]))
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    clients = [b"c0", b"c1", b"c2"]
    calls: dict[str, bytes] = {}
    refused = admitted = 0
    for step in range(600):
        r = rng.random()
        if r < 0.55:
            client = rng.choices(clients, weights=[6, 3, 1])[0]
            rid = f"r{step}"
            predicted = router.admission.refuses(f"conn:{client.hex()}")
            out.clear()
            router.on_client_frames([client, P.encode(P.Generate(id=rid, token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)))])
            answer = any(isinstance(m, P.Error) and m.id == rid and m.code == P.OVERLOADED for m in out)
            assert predicted == answer, (step, predicted, answer)
            refused, admitted = refused + answer, admitted + (not answer)
            calls[rid] = client
        elif r < 0.85 and router.jobs.works:
            work_id = rng.choice(sorted(router.jobs.works))
            worker = router.jobs.works[work_id].worker
            assert worker is not None
            router.on_worker_frames([worker.identity, P.encode(_final(work_id))])
        elif r < 0.95 and calls:
            rid = rng.choice(sorted(calls))
            router.on_client_frames([calls.pop(rid), P.encode(P.Abort(id=rid))])
            for m in list(out):  # the worker confirms an abort with its final
                if isinstance(m, P.Abort) and m.id in router.jobs.works:
                    w = router.jobs.works[m.id].worker
                    assert w is not None
                    router.on_worker_frames([w.identity, P.encode(_final(m.id))])
        elif "b" in router.registry.workers and router.registry.workers["b"].alive:
            router.on_worker_frames([b"b", P.encode(P.Leave(worker="b"))])
        else:
            router.on_worker_frames([b"b", P.encode(P.Register(worker="b", pid=2, session=f"sb{step}"))])
    assert refused > 20 and admitted > 20, (refused, admitted)


def test_a_full_router_refuses_the_largest_holder_but_not_a_newcomer():
    """The fair queue's rule: a tenant holding less than the largest holder by 2 or more pushes
    out that holder's newest job, so the view passes it to the router."""
    router, out = _router(max_inflight_per_worker=1, max_queue=3)
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    for i in range(4):  # 1 in flight, 3 queued: all the gateway's default tenant's
        router.on_client_frames([b"gw", P.encode(P.Generate(id=f"g{i}", token_ids=[1, 2], params=SamplingParams(max_tokens=2)))])
    assert router.admission.refuses("conn:" + b"gw".hex())
    assert not router.admission.refuses("conn:" + b"other".hex())  # holds 0: 3 >= 0 + 2
    assert not router.admission.refuses(http_tenant("t-1"))
    work_id = next(iter(router.jobs.works))
    router.on_worker_frames([b"a", P.encode(_final(work_id))])  # room again
    assert not router.admission.refuses("conn:" + b"gw".hex())


def test_shutting_down_and_stale_views_pass_everything_on():
    router, _ = _router(max_inflight_per_worker=1, max_queue=0)
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    router.on_client_frames([b"c", P.encode(P.Generate(id="g", token_ids=[1, 2], params=SamplingParams(max_tokens=2)))])
    assert router.admission.refuses("conn:" + b"c".hex())
    router.dispatcher.shutting_down = True  # the router answers shutting_down itself
    router.dispatcher.publish()
    assert not router.admission.refuses("conn:" + b"c".hex())
    view = AdmissionView(max_age_s=0.0)  # a publication missed: the view no longer vouches
    view.publish(True, FairQueue())
    time.sleep(0.002)
    assert not view.refuses("t")
