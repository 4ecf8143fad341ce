"""Turn a batch of logits into next tokens, each row under its own request's parameters."""

from __future__ import annotations

import logging

import torch

from radixserve.engine.request import Request, TokenLogprob
from radixserve.kernels import layers

log = logging.getLogger("radixserve.sampler")

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy to float precision: divide by this instead


class Sampler:
    """Greedy rows take one batched argmax; sampled rows are filtered and drawn together, each
    from a uniform of its request's own generator when it brought a seed (so batch-mates never
    change its tokens), else of the engine's seeded generator."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def generator_for(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int | None], list[TokenLogprob | None]]:
        raw = logits
        failed: set[int] = set()
        if any(r.input.params.needs_penalties for r in reqs):
            logits = logits.clone()
            for row, r in enumerate(reqs):
                if r.input.params.needs_penalties:
                    try:
                        _apply_penalties(logits[row], r)
                        _sanitize_(logits[row])
                    except Exception:
                        log.exception("penalties failed for request %s; failing it alone", r.input.rid)
                        failed.add(row)
        if any(r.decode.grammar is not None for r in reqs):
            logits = apply_grammar_masks(logits.clone() if logits is raw else logits, reqs, failed)
        tokens = layers.argmax(logits)  # the first maximum's (or first NaN's) index, as max(-1).indices
        sampled = [row for row, r in enumerate(reqs) if not r.input.params.greedy and row not in failed]
        if sampled:
            try:
                drawn = self._sample_rows(logits[sampled], [reqs[row] for row in sampled])
                tokens[sampled] = drawn.to(tokens.dtype)
            except Exception:  # one row's trouble must not fail its batch-mates: redo them one by one
                for row in sampled:
                    try:
                        tokens[row] = self._sample_row(logits[row], reqs[row])
                    except Exception:
                        log.exception("sampling failed for request %s; failing it alone", reqs[row].input.rid)
                        failed.add(row)
        token_list: list[int | None] = tokens.tolist()
        for row in failed:
            token_list[row] = None
        advance_grammars(token_list, reqs, failed)

        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        wanted = [row for row, r in enumerate(reqs) if r.input.params.logprobs is not None and row not in failed]
        if wanted:
            lp = torch.log_softmax(raw[wanted], dim=-1)
            for i, row in enumerate(wanted):
                token = token_list[row]
                if token is None:  # only failed rows hold None, and wanted has none of them
                    continue
                n = reqs[row].input.params.logprobs
                alternatives: list[tuple[int, float]] = []
                if n:
                    top = torch.topk(lp[i], n)
                    alternatives = list(zip(top.indices.tolist(), top.values.tolist()))
                logprobs[row] = TokenLogprob(token, float(lp[i, token]), alternatives)
        return token_list, logprobs

    def _sample_rows(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Token ids ``[n]`` for ``n`` sampled rows, all at once: temperature, top-k, top-p and
        min-p as one tensor op each over the batch (rows that do not use a filter pass through
        it unchanged), then one inverse-CDF draw per row, from a uniform of the row's own
        generator when it has one, else of the engine's. ``torch.multinomial`` costs about 0.7 ms
        a row at a 32k vocabulary on CPU (it draws an exponential per token), and top-p's full
        sort 2 ms; here a row costs tens of microseconds (``python -m bench sampler``)."""
        n, vocab = logits.shape
        dev = logits.device
        params = [r.input.params for r in reqs]
        temps = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], dtype=logits.dtype, device=dev)
        x = _sanitize_(logits / temps[:, None])
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(ks):
            top = x.topk(max(ks), dim=-1).values
            at = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)
            kth = top.gather(1, at[:, None])
            kth[torch.tensor([k == 0 for k in ks], device=dev)] = float("-inf")
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if nucleus:
            probs[nucleus] = _top_p(probs[nucleus], torch.tensor([params[i].top_p for i in nucleus], device=dev))
        if any(p.min_p > 0.0 for p in params):
            floor = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev)[:, None]
            probs = probs.masked_fill(probs < floor * probs.max(dim=-1, keepdim=True).values, 0.0)
        # inverse CDF: the first token whose cumulative mass exceeds u * total (a token of mass 0
        # spans an empty interval, so it is never drawn)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1]
        u = torch.empty(n, dtype=cdf.dtype, device=dev)
        shared = [i for i, r in enumerate(reqs) if r.decode.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), dtype=cdf.dtype, device=dev, generator=self.generator)
        for i, r in enumerate(reqs):
            if r.decode.generator is not None:
                u[i] = torch.rand((), dtype=cdf.dtype, device=dev, generator=r.decode.generator)
        drawn = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0]
        # (rare) u * total rounded up to the total: the last token with mass; nothing to draw from
        # (all masses 0, or not finite): the mode, as the greedy rows take it
        over = drawn >= vocab
        if bool(over.any()):
            drawn[over] = vocab - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(dim=-1)
        bad = ~(torch.isfinite(total) & (total > 0))
        if bool(bad.any()):
            drawn[bad] = x[bad].max(dim=-1).indices
        return drawn

    def _sample_row(self, row: torch.Tensor, r: Request) -> int:
        """One row alone (the fallback when :meth:`_sample_rows` raised): the same filters and
        draw, so that a failing request fails by itself."""
        return int(self._sample_rows(row[None], [r])[0])


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches its ``top_p`` (the
    others become 0). Sorting a 32k-token row takes ~2 ms on CPU, so rows are ranked by a top-k
    that grows (x8) until its mass exceeds top_p in every row: the tokens beyond it are then
    dropped whatever their order, as a full sort would drop them."""
    vocab = probs.shape[-1]
    k = min(vocab, 64)
    while True:
        vals, idx = probs.topk(k, dim=-1)  # sorted, largest first
        cum = vals.cumsum(dim=-1)
        if k == vocab or bool((cum[:, -1] > top_p).all()):
            break
        k = min(vocab, k * 8)
    keep = cum - vals <= top_p[:, None]  # the mass before a token has not yet reached top_p
    return torch.zeros_like(probs).scatter_(-1, idx, vals * keep)


def _sanitize_(row: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> -inf, +inf -> the dtype's max, so softmax and argmax stay defined."""
    return torch.nan_to_num_(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))


def _apply_penalties(row: torch.Tensor, r: Request) -> None:
    """In place. Repetition penalty (as in transformers) over prompt and output; presence and
    frequency penalties (as in OpenAI) over the output only."""
    p = r.input.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.input.prompt_ids) | set(r.out.output_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if r.out.output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(r.out.output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def apply_grammar_masks(logits: torch.Tensor, reqs: list[Request], failed: set[int] | None = None) -> torch.Tensor:
    """In place: structured requests' rows keep only the tokens their grammar allows next
    (the rest become -inf), from each request's xgrammar matcher. Returns ``logits``. A row whose
    matcher raises is added to ``failed`` (its request alone ends with an error)."""
    import xgrammar as xgr

    failed = set() if failed is None else failed
    rows = [row for row, r in enumerate(reqs) if row not in failed and r.decode.grammar is not None and not r.decode.grammar.is_terminated()]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[-1])
    masked = []
    for row in rows:
        try:
            if reqs[row].decode.grammar.fill_next_token_bitmask(bitmask, row):
                masked.append(row)
        except Exception:
            log.exception("grammar mask failed for request %s; failing it alone", reqs[row].input.rid)
            failed.add(row)
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=masked)
    return logits


def advance_grammars(tokens: list[int | None], reqs: list[Request], failed: set[int] | None = None) -> None:
    """Move each structured request's matcher past the token it just got. The mask makes a
    rejected token impossible; if one is ever rejected (or the matcher raises), that row joins
    ``failed`` and its token becomes None: its request alone ends with an error, rather than going
    on unconstrained or failing the whole batch."""
    failed = set() if failed is None else failed
    for row, (token, r) in enumerate(zip(tokens, reqs)):
        m = r.decode.grammar
        if token is None or m is None or m.is_terminated():  # None: this row already failed
            continue
        try:
            ok = m.accept_token(token)
        except Exception:
            log.exception("grammar failed for request %s; failing it alone", r.input.rid)
            ok = False
        if not ok:
            log.error("request %s: grammar rejected token %d; failing it alone", r.input.rid, token)
            failed.add(row)
            tokens[row] = None
