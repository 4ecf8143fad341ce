"""Issue 13 item 3: one tenant's sampling parameters cannot fail another tenant's requests."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.engine import sampler as sampler_mod
from radixserve.engine.request import Request
from radixserve.errors import BadRequestError

from conftest import random_prompts

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e300),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", 101.0),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("repetition_penalty", math.nan),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("presence_penalty", math.inf),
        ("seed", 10**30),
        ("seed", -(2**64)),
    ],
)
def test_insane_values_are_rejected(field, value):
    with pytest.raises(BadRequestError) as info:
        SamplingParams(**{field: value}).validate(vocab_size=512)
    assert info.value.field == field


def test_sane_edges_are_accepted():
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-300),  # tiny is greedy-like
        SamplingParams(temperature=100.0),
        SamplingParams(repetition_penalty=0.01),
        SamplingParams(repetition_penalty=100.0),
        SamplingParams(seed=2**64 - 1),
    ):
        params.validate(vocab_size=512)


def test_sampler_survives_degenerate_rows():
    """Rows that overflow to inf / nan (what 1e-300 penalties or temperatures produce) still give
    a token id in range instead of raising for the whole batch."""
    s = sampler_mod.Sampler(0, torch.device("cpu"))

    def R(**kw) -> Request:
        req = Request("r", [1, 2, 3], SamplingParams(**kw))
        req.append(4)
        return req

    logits = torch.randn(4, 64)
    logits[1, 5] = math.inf
    logits[2] = math.nan
    reqs = [R(temperature=1e-300), R(temperature=1.0), R(temperature=0.7, top_p=0.5), R(temperature=1.0)]
    reqs[3].input.params.repetition_penalty = 1e-300  # bypasses validation: the sampler must still cope
    tokens, _ = s(logits, reqs)
    assert all(t is not None and 0 <= t < 64 for t in tokens), tokens
    assert tokens[0] == int(logits[0].argmax())  # tiny temperature: the mode
    assert tokens[1] == 5  # +inf logit: it wins


def test_greedy_rows_take_argmax_first_maximum():
    """Greedy picks what torch's argmax picks, ties (the first maximum) and NaN rows included."""
    s = sampler_mod.Sampler(0, torch.device("cpu"))

    def R() -> Request:
        return Request("r", [1], SamplingParams(temperature=0.0))

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (32, 100), generator=g).float()  # many ties per row
    logits[3, 7] = math.nan
    logits[4, :] = -math.inf
    tokens, _ = s(logits, [R() for _ in range(32)])
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = Engine(llama_dir, kv_cache_tokens=4096, max_running=16)
    yield eng
    eng.shutdown()


def test_failing_request_fails_alone(engine, monkeypatch):
    """A request whose sampling raises ends with finish_reason 'error'; its batch-mates finish."""
    real_rows, real_row = sampler_mod.Sampler._sample_rows, sampler_mod.Sampler._sample_row

    def flaky_rows(self, logits, reqs):  # the batched draw fails for any batch that holds "bad" ...
        if any(r.input.rid == "bad" for r in reqs):
            raise RuntimeError("probability tensor contains inf/nan")
        return real_rows(self, logits, reqs)

    def flaky_row(self, row, r):  # ... and so does "bad" alone, when its batch is redone row by row
        if r.input.rid == "bad":
            raise RuntimeError("probability tensor contains inf/nan")
        return real_row(self, row, r)

    monkeypatch.setattr(sampler_mod.Sampler, "_sample_rows", flaky_rows)
    monkeypatch.setattr(sampler_mod.Sampler, "_sample_row", flaky_row)
    prompts = random_prompts([12, 15, 9, 20, 11], seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    reqs = [engine.make_request(p, params, request_id=rid) for p, rid in zip(prompts, ["a", "b", "bad", "c", "d"])]
    outs = engine._run_to_completion(reqs)
    by_id = {o.request_id: o for o in outs}
    assert by_id["bad"].finish_reason == "error"
    for rid in "abcd":
        assert by_id[rid].finish_reason == "length" and len(by_id[rid].token_ids) == 8
    # and the engine keeps serving afterwards
    again = engine.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert again.finish_reason in ("length", "stop")


def test_bypassed_validation_does_not_fail_the_batch(engine):
    """Even when a 1e-300 request gets past validation (a bug, an old client), every request in
    its batch, it included, finishes: the sampler is robust to the overflow."""
    prompts = random_prompts([10, 14, 9, 13], seed=6)
    good = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    reqs = [engine.make_request(p, good) for p in prompts[:3]]
    evil = engine.make_request(prompts[3], SamplingParams(max_tokens=6, seed=3, ignore_eos=True))
    evil.input.params.temperature = 1e-300
    evil.input.params.repetition_penalty = 1e-300
    outs = engine._run_to_completion(reqs + [evil])
    assert [o.finish_reason for o in outs] == ["length"] * 4
