"""The batched sampler draws from the distribution its filters leave: frequencies against the
probabilities, top-k / top-p / min-p against straightforward per-row references, seeded rows
independent of their batch-mates."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine import sampler as sampler_mod
from radixserve.engine.request import Request


def R(generator=None, **kw) -> Request:
    return Request("r", [1], SamplingParams(**kw), generator=generator)


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters one row at a time with a full sort, as the sampler did before it was batched."""
    row = row / max(p.temperature, sampler_mod.MIN_TEMPERATURE)
    if 0 < p.top_k < row.numel():
        row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def test_draws_follow_the_probabilities():
    """40,000 rows of one 8-token distribution (one batch): each token's frequency is within 5
    standard deviations of its probability, and the token top_k masks out is never drawn."""
    s = sampler_mod.Sampler(0, torch.device("cpu"))
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.2, -9.0])
    n = 40_000
    for params in (dict(temperature=1.0), dict(temperature=0.7, top_k=7)):
        reqs = [R(**params)] * n
        tokens, _ = s(logits.expand(n, -1).contiguous(), reqs)
        counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
        probs = reference_probs(logits, reqs[0].input.params).double()
        sigma = (n * probs * (1 - probs)).sqrt()
        assert ((counts - n * probs).abs() <= 5 * sigma + 1e-9).all(), (params, counts.tolist(), (n * probs).tolist())
        if "top_k" in params:
            assert counts[7] == 0


@pytest.mark.parametrize("vocab", [50, 5000])
def test_filters_equal_the_sorting_reference(vocab):
    """top-p (including nuclei larger than the first top-k tried), top-k and min-p leave the same
    tokens, with the same masses, as the per-row full sort."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g) * torch.linspace(0.2, 6.0, 12)[:, None]  # flat to peaky
    cases = [dict(temperature=1.0, top_p=q) for q in (0.05, 0.5, 0.9, 0.999)]
    cases += [dict(temperature=0.8, top_k=k) for k in (1, 3, 40)] + [dict(temperature=1.3, min_p=0.02)]
    cases += [dict(temperature=0.9, top_k=30, top_p=0.8, min_p=0.01)]
    s = sampler_mod.Sampler(0, torch.device("cpu"))
    for params in cases:
        p = SamplingParams(**params)
        got = torch.softmax(logits / p.temperature, dim=-1)
        if 0 < p.top_k < vocab:
            got = torch.softmax(_masked_topk(logits / p.temperature, p.top_k), dim=-1)
        if p.top_p < 1.0:
            got = sampler_mod._top_p(got, torch.full((12,), p.top_p))
        if p.min_p > 0.0:
            got = got.masked_fill(got < p.min_p * got.max(dim=-1, keepdim=True).values, 0.0)
        want = torch.stack([reference_probs(row, p) for row in logits])
        assert torch.equal(got > 0, want > 0), params
        torch.testing.assert_close(got, want)
        # and the sampler draws only tokens the reference keeps
        tokens, _ = s(logits, [R(**params) for _ in range(12)])
        assert all(want[i, t] > 0 for i, t in enumerate(tokens)), params


def _masked_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.masked_fill(x < x.topk(k, dim=-1).values[:, -1:], float("-inf"))


def test_seeded_rows_ignore_their_batch_mates():
    """A row with its own generator draws the same tokens alone and among other rows, seeded or not."""
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(6, 300, generator=g) for _ in range(20)]

    def run(rows):
        s = sampler_mod.Sampler(0, torch.device("cpu"))
        reqs = [
            R(generator=torch.Generator().manual_seed(42), temperature=1.0, top_p=0.95)
            if i == 2
            else R(generator=torch.Generator().manual_seed(i) if i % 2 else None, temperature=1.0)
            for i in rows
        ]
        return [s(step[rows], reqs)[0][rows.index(2)] for step in steps]

    alone = run([2])
    assert run([0, 1, 2, 3, 4, 5]) == alone == run([5, 2])
    assert len(set(alone)) > 3  # it does sample


def test_degenerate_rows_fall_back_to_the_mode():
    """All-NaN and all -inf rows give the mode (as greedy takes it), not an out-of-range id."""
    s = sampler_mod.Sampler(0, torch.device("cpu"))
    logits = torch.randn(3, 40)
    logits[0] = math.nan
    logits[1] = -math.inf
    logits[2, 17] = 9.0
    tokens, _ = s(logits, [R(temperature=1.0), R(temperature=0.5, top_p=0.3), R(temperature=1.0, min_p=0.9)])
    assert tokens[0] == 0 and tokens[1] == 0
    assert tokens[2] == 17  # min_p=0.9 keeps only the mode
