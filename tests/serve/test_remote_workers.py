"""Workers on other hosts, without sockets: the worker's cache events and snapshots feed a real
Router through a lossy link, and the router's index must equal the worker's tree whenever the
stream has settled; a worker that leaves is forgotten at once; a re-registering worker's lost
requests are restarted, not left hanging."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest

from radixserve import protocol as P
from radixserve.kv.radix import RadixCache
from radixserve.sampling_params import SamplingParams
from radixserve.serve.router import Router, RouterConfig
from radixserve.serve.router.sockets import Transport
from radixserve.serve.worker import Worker

from test_serve_units import _paths, _Pool

ID = b"w1"


class _Loop:
    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def _worker(tree: RadixCache, tmp_path) -> tuple[Worker, list]:
    engine = SimpleNamespace(
        cache=SimpleNamespace(tree=tree),
        info=lambda: {"model": str(tmp_path)},
        tokenizer=[0] * 512,
        max_model_len=4096,
        pool=SimpleNamespace(capacity_tokens=8192, page_size=1),
        stats=dict,
    )
    engine.call_soon = lambda fn: fn()  # the engine thread, between steps
    engine.cache_leaves = lambda: list(tree.leaf_paths())  # Engine.cache_leaves: the snapshot's source
    worker = Worker(engine, "tcp://x", "w1", secret="0" * 64)
    worker.loop = worker.events.loop = _Loop()
    sent: list = []
    worker._send = worker.events.send = sent.append
    tree.on_event = worker.events.on_event
    return worker, sent


class _RecordingTransport(Transport):
    """The router's transport without sockets: what it sends, to clients or workers, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sent: list = []

    def send(self, identity: bytes, msg) -> None:
        self.sent.append(msg)

    def send_worker(self, identity: bytes, msg) -> None:
        self.sent.append(msg)


def _router() -> tuple[Router, list]:
    router = Router(RouterConfig(), transport=_RecordingTransport)
    assert isinstance(router.transport, _RecordingTransport)
    return router, router.transport.sent


def _deliver(router: Router, msgs: list) -> None:
    for msg in msgs:
        router.on_worker_frames([ID, P.encode(msg)])


@pytest.mark.parametrize("seed", range(4))
def test_index_equals_the_tree_after_loss_and_rejoins(seed, tmp_path):
    rng = random.Random(seed)
    pool = _Pool()
    tree = RadixCache(1, pool)
    worker, sent = _worker(tree, tmp_path)
    router, to_worker = _router()
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    lost = 0
    for step in range(150):
        if step == 30:  # joins with history: the snapshot after Register must carry it
            worker._register()
        if rng.random() < 0.6:
            seq = list(rng.choice(bases)) + [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            tree.insert(seq, pool.alloc(len(seq)), rng.choice([None, "t"]))
        else:
            tree.evict(rng.randrange(1, 40))
        sent.append(worker._heartbeat())
        while sent:  # the link: about one cache-event message in 7 is lost
            batch, sent[:] = list(sent), []
            for msg in batch:
                if isinstance(msg, P.CacheEvents) and rng.random() < 1 / 7:
                    lost += 1
                    continue
                _deliver(router, [msg])
            answers, to_worker[:] = list(to_worker), []
            for msg in answers:  # Rejoin / Ping reach the worker; it answers into `sent`
                worker._handle(msg)
        state = router.registry.workers.get("w1")
        if state is not None and state.synced:
            assert _paths(state.index.tree) == _paths(tree), step
            assert state.index.tokens == tree.total_pages
    assert lost and router.counters["index_resyncs"] >= 1  # losses happened and were noticed
    state = router.registry.workers["w1"]
    assert state.synced and _paths(state.index.tree) == _paths(tree)
    assert router.counters["index_resyncs"] >= 1  # the lossy steps were noticed


def test_events_before_the_snapshot_are_ignored_and_a_gap_asks_for_rejoin(tmp_path):
    router, out = _router()
    _deliver(router, [P.Register(worker="w1", pid=1, session="s1")])
    state = router.registry.workers["w1"]
    assert not state.synced
    _deliver(router, [P.CacheEvents(worker="w1", events=[P.CacheEvent("insert", None, [1, 2, 3])], seq=1)])
    assert state.index.tokens == 0  # before the snapshot: ignored
    _deliver(router, [P.CacheEvents(worker="w1", events=[P.CacheEvent("insert", None, [4, 5])], seq=2, reset=True)])
    assert state.synced and state.index.tokens == 2
    _deliver(router, [P.CacheEvents(worker="w1", events=[P.CacheEvent("insert", None, [4, 5, 6])], seq=3)])
    assert state.index.tokens == 3
    out.clear()
    _deliver(router, [P.CacheEvents(worker="w1", events=[P.CacheEvent("insert", None, [7])], seq=5)])  # 4 lost
    assert not state.synced and state.index.tokens == 0
    assert any(isinstance(m, P.Rejoin) for m in out)


def test_unknown_connection_is_asked_to_rejoin_once_per_timeout():
    router, out = _router()
    for _ in range(3):
        _deliver(router, [P.Heartbeat(worker="w9")])
    assert sum(isinstance(m, P.Rejoin) for m in out) == 1


def _generate(router: Router, rid: str) -> None:
    router.on_client_frames([b"client", P.encode(P.Generate(id=rid, token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)))])


def test_leave_restarts_requests_on_another_worker_at_once(caplog):
    router, out = _router()
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    _generate(router, "c1")
    job = next(iter(router.jobs.works.values()))
    assert job.worker.name == "a"
    router.on_worker_frames([b"b", P.encode(P.Register(worker="b", pid=2, session="sb"))])
    with caplog.at_level(logging.INFO, logger="radixserve.router"):
        router.on_worker_frames([b"a", P.encode(P.Leave(worker="a"))])
    assert not router.registry.workers["a"].alive
    assert router.counters["workers_left"] == 1 and router.counters["worker_deaths"] == 0
    assert job.worker is router.registry.workers["b"]  # restarted, no heartbeat timeout waited for
    assert "worker a left; 1 request in flight there: 1 restarted, 0 answered with an error" in caplog.text
    with caplog.at_level(logging.INFO, logger="radixserve.router"):
        router.on_worker_frames([b"c", P.encode(P.Register(worker="c", pid=3, session="sc"))])
        router.on_worker_frames([b"c", P.encode(P.Leave(worker="c"))])
    assert "worker c left; no requests in flight there" in caplog.text


def test_same_session_registering_again_restarts_what_it_lost():
    router, out = _router()
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    _generate(router, "c1")
    _generate(router, "c2")
    kept, lost = sorted(router.jobs.works)
    # It re-registers (it heard nothing for a while) running only the first: the second's Work
    # or Final went down with the old connection.
    out.clear()
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa", active=[kept]))])
    assert kept in router.jobs.works and lost not in router.jobs.works
    assert any(isinstance(m, P.Abort) and m.id == lost for m in out)
    retried = [m for m in out if isinstance(m, P.Work)]
    assert len(retried) == 1 and retried[0].id != lost  # a new attempt, under a new work id
    assert router.counters["retries"] == 1


def test_declaring_a_worker_dead_hands_back_its_jobs_newest_first():
    """The registry only says which jobs a dead worker held; restarting them is the dispatcher's."""
    router, out = _router()
    router.on_worker_frames([b"a", P.encode(P.Register(worker="a", pid=1, session="sa"))])
    _generate(router, "c1")
    _generate(router, "c2")
    a = router.registry.workers["a"]
    orphans = router.registry.declare_dead(a, "a test")
    assert [j.cid for j in orphans] == ["c2", "c1"]
    assert not a.alive and not a.inflight and router.registry.of(b"a") is None
    assert router.counters["worker_deaths"] == 1


def test_every_message_type_has_one_handler():
    """Client requests reach the client table, worker messages the worker table (Register aside)."""
    router, _ = _router()
    for kind in (P.Generate, P.Choose, P.Abort, P.Health, P.Stats):
        assert kind in router.client_handlers and kind not in router.worker_handlers
    for kind in (P.Heartbeat, P.Goodbye, P.CacheEvents, P.Chunk, P.Final, P.ChoiceFinal, P.Error, P.Leave):
        assert kind in router.worker_handlers and kind not in router.client_handlers
