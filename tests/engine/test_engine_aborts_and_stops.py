"""Issue 13 item 6 (engine part): an abort that arrives while the idle loop takes an add is not lost.
Issue 49 item 16: stop strings and streams detokenize per token, not per output."""

from __future__ import annotations

import queue
import random
import string
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
            self.q.put(AbortRequest(item.req.input.rid))
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


def test_incremental_detokenizing_equals_decoding_the_whole(llama_dir):
    """Issue 49 item 16: the stream's text is built from the new tokens only; after every token
    it equals the whole output decoded (split characters and special tokens included)."""
    from transformers import AutoTokenizer

    from radixserve.engine.output import OutputProcessor
    from radixserve.engine.request import OutputState

    tok = AutoTokenizer.from_pretrained(llama_dir)
    proc = OutputProcessor(tok, [], 10**6, lambda req, reason: None)
    rng = random.Random(0)
    text_ids = tok.encode("héllo wörld, 世界 🙂 ok\n  two  spaces", add_special_tokens=False)
    for _ in range(20):
        out = OutputState()
        for _ in range(rng.randrange(1, 60)):
            out.output_ids.append(rng.choice(text_ids) if rng.random() < 0.5 else rng.randrange(len(tok)))
            assert proc.detokenize(out) == tok.decode(out.output_ids, skip_special_tokens=True), out.output_ids


def test_stop_strings_cost_per_token_not_per_output(llama_dir, monkeypatch):
    """Issue 49 item 16: 16 stop strings of 256 characters nearly doubled a batch's time: a
    request with stop strings streams, and the whole output was decoded again at every token."""
    engine = Engine(llama_dir, kv_cache_tokens=4096)
    decoded = []
    real = engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw))
    rng = random.Random(1)
    stops = ["".join(rng.choices(string.ascii_letters, k=256)) for _ in range(16)]  # the most protocol.Limits allows
    n = 512
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=stops))[0]
    assert len(out.token_ids) == n and out.finish_reason == "length"
    assert out.text == real(out.token_ids, skip_special_tokens=True)
    assert sum(decoded) < 16 * n, f"{sum(decoded)} token ids decoded for {n} tokens"  # the whole each time: ~n*n/2
