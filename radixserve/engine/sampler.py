"""Turn a batch of logits into next tokens, each row under its own request's parameters."""

from __future__ import annotations

import logging

import torch

from radixserve.engine.request import Request, TokenLogprob

log = logging.getLogger("radixserve.sampler")

MIN_TEMPERATURE = 1e-5  # below this, sampling is greedy to float precision: divide by this instead


class Sampler:
    """Greedy rows take one batched argmax; sampled rows are filtered and drawn one by one, each
    from its request's own generator when it brought a seed (so batch-mates never change its
    tokens), else from the engine's seeded generator."""

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
        if any(r.params.needs_penalties for r in reqs):
            logits = logits.clone()
            for row, r in enumerate(reqs):
                if r.params.needs_penalties:
                    try:
                        _apply_penalties(logits[row], r)
                        _sanitize_(logits[row])
                    except Exception:
                        log.exception("penalties failed for request %s; failing it alone", r.rid)
                        failed.add(row)
        if any(r.grammar is not None for r in reqs):
            logits = apply_grammar_masks(logits.clone() if logits is raw else logits, reqs, failed)
        # max(-1).indices: argmax's first-maximum (and first-NaN) index, about 3x faster on CPU
        # ([64, 32000] fp32, 2 threads: 0.58 vs 1.60 ms)
        tokens = logits.max(dim=-1).indices
        for row, r in enumerate(reqs):
            if not r.params.greedy and row not in failed:
                try:
                    tokens[row] = self._sample_row(logits[row], r)
                except Exception:
                    log.exception("sampling failed for request %s; failing it alone", r.rid)
                    failed.add(row)
        token_list: list[int | None] = tokens.tolist()
        for row in failed:
            token_list[row] = None
        advance_grammars(token_list, reqs, failed)

        logprobs: list[TokenLogprob | None] = [None] * len(reqs)
        wanted = [row for row, r in enumerate(reqs) if r.params.logprobs is not None and row not in failed]
        if wanted:
            lp = torch.log_softmax(raw[wanted], dim=-1)
            for i, row in enumerate(wanted):
                token = token_list[row]
                if token is None:  # only failed rows hold None, and wanted has none of them
                    continue
                n = reqs[row].params.logprobs
                alternatives: list[tuple[int, float]] = []
                if n:
                    top = torch.topk(lp[i], n)
                    alternatives = list(zip(top.indices.tolist(), top.values.tolist()))
                logprobs[row] = TokenLogprob(token, float(lp[i, token]), alternatives)
        return token_list, logprobs

    def _sample_row(self, row: torch.Tensor, r: Request) -> int:
        p = r.params
        row = _sanitize_(row / max(p.temperature, MIN_TEMPERATURE))
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            return int(row.argmax())  # nothing left to draw from (or under/overflow): the mode
        generator = r.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))


def _sanitize_(row: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> -inf, +inf -> the dtype's max, so softmax and argmax stay defined."""
    return torch.nan_to_num_(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max, neginf=float("-inf"))


def _apply_penalties(row: torch.Tensor, r: Request) -> None:
    """In place. Repetition penalty (as in transformers) over prompt and output; presence and
    frequency penalties (as in OpenAI) over the output only."""
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if r.output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(r.output_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def apply_grammar_masks(logits: torch.Tensor, reqs: list[Request], failed: set[int] | None = None) -> torch.Tensor:
    """In place: structured requests' rows keep only the tokens their grammar allows next
    (the rest become -inf), from each request's xgrammar matcher. Returns ``logits``. A row whose
    matcher raises is added to ``failed`` (its request alone ends with an error)."""
    import xgrammar as xgr

    failed = set() if failed is None else failed
    rows = [row for row, r in enumerate(reqs)
            if row not in failed and r.grammar is not None and not r.grammar.is_terminated()]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[-1])
    masked = []
    for row in rows:
        try:
            if reqs[row].grammar.fill_next_token_bitmask(bitmask, row):
                masked.append(row)
        except Exception:
            log.exception("grammar mask failed for request %s; failing it alone", reqs[row].rid)
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
        m = r.grammar
        if token is None or m is None or m.is_terminated():  # None: this row already failed
            continue
        try:
            ok = m.accept_token(token)
        except Exception:
            log.exception("grammar failed for request %s; failing it alone", r.rid)
            ok = False
        if not ok:
            log.error("request %s: grammar rejected token %d; failing it alone", r.rid, token)
            failed.add(row)
            tokens[row] = None
