"""Issue 13 item 6 (engine part): an abort that arrives while the idle loop takes an add is not lost."""

from __future__ import annotations

import queue
import threading

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.commands import AbortRequest, AddRequest

pytestmark = pytest.mark.timeout(120)


class _RacyInbox:
    """An inbox that makes the race deterministic: the moment the idle loop takes an 'add', the
    abort for that request arrives (as if another thread put it just then)."""

    def __init__(self):
        self.q = queue.SimpleQueue()

    def put(self, item):
        self.q.put(item)

    def get_nowait(self):
        return self.q.get_nowait()

    def get(self, timeout=None):
        item = self.q.get(timeout=timeout)
        if isinstance(item, AddRequest):
            self.q.put(AbortRequest(item.req.rid))
        return item


def test_abort_arriving_during_the_idle_take_is_applied_in_order(llama_dir):
    engine = Engine(llama_dir, kv_cache_tokens=4096)
    engine.thread.inbox = _RacyInbox()
    engine.start()
    try:
        done = threading.Event()
        box = []

        def on_chunk(chunk):
            if chunk.output is not None:
                box.append(chunk.output)
                done.set()

        req = engine.make_request([5, 6, 7, 8], SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        engine.add_request(req, on_chunk)
        assert done.wait(60)
        assert box[0].finish_reason == "abort", box[0].finish_reason  # not 'length' after 1000 tokens
        assert len(box[0].token_ids) < 1000
    finally:
        engine.shutdown()
