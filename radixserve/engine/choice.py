"""Choice scoring (SGLang's ``select``): rank candidate continuations of one prompt by their
token log-probabilities.

The prompt is prefilled once by a prefill-only scoring request; only when it has finished (and
its KV sits in the radix tree) are the N ``prompt + choice`` scoring requests submitted, in one
burst, so each of them hits the cached prompt and computes only its last prompt token and its
choice tokens: the cost is about ``prompt + sum(|choice| + 1)`` tokens, not ``N x prompt``.
Choices are tokenized on their own and their ids appended to the prompt's, so the shared prefix
is exactly the prompt's ids.
"""

from __future__ import annotations

import functools
import math
import random
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import msgspec

from radixserve.errors import BadRequestError, InvariantError
from radixserve.protocol import ChoiceUsage, RankedChoice  # noqa: F401  (wire types)

if TYPE_CHECKING:
    from radixserve.engine.request import Request, RequestOutput, StreamChunk


class ChoiceResult(msgspec.Struct, kw_only=True):
    """``best``: the top choice (greedy) or the sampled one (temperature > 0); ``ranked``: every
    choice, best score first, as ``(choice, logprob_sum, logprob_mean, n_tokens)``."""

    best: str
    ranked: list[RankedChoice]
    usage: ChoiceUsage
    index: int = 0  # index of ``best`` in the caller's choices
    ttft_s: float = 0.0
    e2e_s: float = 0.0


def tokenize_choices(tokenizer, choices: Sequence) -> list[list[int]]:
    """Each choice on its own, without special tokens (token id lists pass through)."""
    out = []
    for i, c in enumerate(choices):
        ids = tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str) else list(c)
        if not ids:
            raise BadRequestError("choices", f"entry {i} ({c!r}) is empty after tokenizing")
        out.append(ids)
    return out


def rank(choices: Sequence[str], scores: list[list[float]], normalize: str, temperature: float, seed: int | None) -> tuple[list[RankedChoice], int]:
    """Rank by the normalized score; pick the best, or sample softmax(score / temperature)."""
    rows = [RankedChoice(str(c), float(sum(lp)), float(sum(lp) / len(lp)), len(lp)) for c, lp in zip(choices, scores)]
    key = [r.logprob_sum if normalize == "sum" else r.logprob_mean for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -key[i])
    if temperature > 0:
        top = max(key)
        weights = [math.exp((k - top) / temperature) for k in key]
        index = random.Random(seed).choices(range(len(rows)), weights=weights)[0]
    else:
        index = order[0]
    return [rows[i] for i in order], index


def choice_requests(
    make_request: Callable[..., Request], rid: str, prompt_ids: list[int], choice_ids: list[list[int]], namespace: Hashable = None
) -> tuple[Request, list[Request]]:
    """The prefill-only request of the prompt and one scoring request per choice
    (``prompt + choice``), each scoring from the prompt's end. All are built (and so validated)
    up front: errors are raised to the caller here, before anything runs."""
    from radixserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    n = len(prompt_ids)
    prefill = make_request(prompt_ids, params, request_id=f"{rid}/p", namespace=namespace)
    prefill.decode.score_from = n
    scorers = []
    for i, ids in enumerate(choice_ids):
        req = make_request(prompt_ids + list(ids), params, request_id=f"{rid}/{i}", namespace=namespace)
        req.decode.score_from = n
        scorers.append(req)
    return prefill, scorers


class ChoiceJob:
    """One choose call inside an engine: prefill the prompt, then score every choice.
    ``submit(request, on_chunk)`` queues a request on the engine, ``abort(rid)`` aborts one;
    ``on_done(result, error)`` is called once, from the engine thread (or from ``step``)."""

    def __init__(
        self,
        prefill: Request,
        scorers: list[Request],
        choices: Sequence[str],
        *,
        submit: Callable[[Request, Callable[[StreamChunk], None]], object],
        abort: Callable[[str], None],
        normalize: str = "sum",
        temperature: float = 0.0,
        seed: int | None = None,
        on_done: Callable[[ChoiceResult | None, str | None], None],
    ):
        if len(scorers) != len(choices):
            raise BadRequestError("choices", "token ids and choices differ in length")
        self.prefill, self.scorers = prefill, scorers
        self.choices = list(choices)
        self._submit, self._abort = submit, abort
        self.normalize, self.temperature, self.seed = normalize, temperature, seed
        self.on_done = on_done
        n = len(prefill.input.prompt_ids)
        self.usage = ChoiceUsage(prompt_tokens=n, choice_tokens=sum(len(r.input.prompt_ids) - n for r in scorers))
        self.outputs: dict[int, RequestOutput] = {}
        self.done = False
        self.aborted = False
        self._lock = threading.Lock()

    @property
    def request_ids(self) -> list[str]:
        return [self.prefill.input.rid] + [r.input.rid for r in self.scorers]

    def start(self) -> None:
        self._submit(self.prefill, self._on_prefill)

    def abort(self) -> None:
        self.aborted = True
        for rid in self.request_ids:
            self._abort(rid)

    def _on_prefill(self, chunk) -> None:
        out = chunk.output
        if out is None:
            return
        if out.finish_reason != "stop" or self.aborted:
            return self._fail(out.finish_reason or "abort")
        self.usage.query_tokens += out.prompt_tokens
        self.usage.cached_tokens += out.cached_tokens
        self.usage.prompt_cached_tokens = out.cached_tokens
        now = time.monotonic()
        for i, req in enumerate(self.scorers):
            req.life.arrival = now
            self._submit(req, functools.partial(self._on_scored, i))

    def _on_scored(self, i: int, chunk: StreamChunk) -> None:
        out = chunk.output
        if out is None or self.done:
            return
        if out.finish_reason != "stop":
            self.abort()
            return self._fail(out.finish_reason or "abort")
        self.outputs[i] = out
        self.usage.query_tokens += out.prompt_tokens
        self.usage.cached_tokens += out.cached_tokens
        if len(self.outputs) == len(self.scorers):
            scores = [self.outputs[k].score_logprobs for k in range(len(self.scorers))]
            if any(s is None for s in scores):
                raise InvariantError(f"a scoring request of choose {self.prefill.input.rid} finished without its logprobs")
            ranked, index = rank(self.choices, [s for s in scores if s is not None], self.normalize, self.temperature, self.seed)
            first = self.prefill.life.arrival
            result = ChoiceResult(
                best=self.choices[index],
                ranked=ranked,
                usage=self.usage,
                index=index,
                ttft_s=(self.prefill.life.first_token_at or first) - first,
                e2e_s=time.monotonic() - first,
            )
            self.done = True
            self.on_done(result, None)

    def _fail(self, reason: str) -> None:
        if not self.done:
            self.done = True
            self.on_done(None, reason)
