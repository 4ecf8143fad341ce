"""From sampled tokens to what callers see: detokenizing, stop conditions (EOS, stop ids, stop
strings, grammar end, length), stream chunks cut where text is safe to send, and the final
chunk that carries a request's :class:`~radixserve.engine.request.RequestOutput`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, overload

from radixserve.engine.commands import OnChunk
from radixserve.engine.request import OutputState, Request, StreamChunk, TokenLogprob

DETOKENIZE_CONTEXT = 5  # tokens decoded again before the new ones (vLLM's incremental detokenizer: 5)


class OutputProcessor:
    """Owns the live requests and their listeners; runs on the engine thread.

    ``release(req, reason)`` is called when a request finishes, before its final chunk is built
    (the scheduler frees its KV and marks it finished)."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], max_model_len: int, release: Callable[[Request, str], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.release = release
        self.requests: dict[str, Request] = {}
        self.listeners: dict[str, OnChunk] = {}

    def register(self, req: Request, on_chunk: OnChunk | None) -> None:
        self.requests[req.input.rid] = req
        if on_chunk is not None:
            self.listeners[req.input.rid] = on_chunk

    def live(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        req = self.requests.get(request_id)
        return None if req is None or req.finished else req

    # -- per token -----------------------------------------------------------------------------
    def on_token(self, req: Request, token: int, logprob: TokenLogprob | None, now: float) -> StreamChunk | None:
        """Record a sampled token; returns the request's final chunk when it stopped, else its
        stream chunk (None when it does not stream)."""
        req.append(token)
        if req.life.first_token_at is None:
            req.life.first_token_at = now
        if logprob is not None:
            req.out.logprobs = (req.out.logprobs or []) + [logprob]
        reason = self.stop_reason(req)
        return self.finish(req, reason) if reason else self.chunk(req)

    def stop_reason(self, req: Request) -> str | None:
        p = req.input.params
        token = req.out.output_ids[-1]
        if req.decode.grammar is not None and req.decode.grammar.is_terminated():
            return "stop"
        if p.stop_token_ids and token in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if req.decode.stream and self.update_text(req):
            return "stop"
        if (p.max_tokens is not None and len(req.out.output_ids) >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def update_text(self, req: Request) -> bool:
        """Detokenize the output; True when a stop string appeared (the text is cut before it).
        The stop strings are looked for only where a new one can be: from the longest one's
        length before the text already streamed out (what is held back is looked at again)."""
        out = req.out
        text = self.detokenize(out)
        stops = req.input.params.stop
        if stops:
            start = max(0, out.emitted_chars - max(map(len, stops)))
            hits = [(text.find(s, start), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                out.text = text[: i + len(s)] if req.input.params.include_stop_str_in_output else text[:i]
                return True
        out.text = text
        return False

    def detokenize(self, out: OutputState) -> str:
        """``tokenizer.decode(out.output_ids, skip_special_tokens=True)``, from the tokens added
        since the text last ended on a whole character, decoded with up to
        :data:`DETOKENIZE_CONTEXT` tokens before them (so a leading space, or a character split
        across tokens, comes out as in the whole). Decoding the whole output at every token made
        a stream O(n^2): with stop strings on (they stream), most of a batch's time."""
        ids, done = out.output_ids, out.decoded_tokens
        context = max(0, done - DETOKENIZE_CONTEXT)
        before = self.tokenizer.decode(ids[context:done], skip_special_tokens=True)
        after = self.tokenizer.decode(ids[context:], skip_special_tokens=True)
        if after.startswith(before):
            text = out.decoded_text + after[len(before) :]
        else:  # the new tokens changed the text before them (a tokenizer's clean-up): decode it all
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            out.decoded_tokens, out.decoded_text = len(ids), text
        return text

    # -- chunks --------------------------------------------------------------------------------
    @overload
    def chunk(self, req: Request, final: Literal[True]) -> StreamChunk: ...
    @overload
    def chunk(self, req: Request, final: bool = False) -> StreamChunk | None: ...

    def chunk(self, req: Request, final: bool = False) -> StreamChunk | None:
        """What is new since the last chunk. A non-final chunk holds back a trailing half
        character and anything that may be the start of a stop string."""
        if not final and not req.decode.stream:
            return None
        out = req.out
        text = out.text
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end -= 1  # half of a multi-byte character: wait for the rest
            if req.input.params.stop:
                end -= max(map(len, req.input.params.stop)) - 1  # might be the start of a stop string
        end = max(end, out.emitted_chars)
        chunk = StreamChunk(
            request_id=req.input.rid,
            token_ids=out.output_ids[out.emitted_tokens :],
            text=text[out.emitted_chars : end],
            logprobs=out.logprobs[out.emitted_tokens :] if out.logprobs else None,
        )
        out.emitted_tokens, out.emitted_chars = len(out.output_ids), end
        listener = self.listeners.get(req.input.rid)
        if listener is not None and not final and chunk.token_ids:
            listener(chunk)
        return chunk

    def finish(self, req: Request, reason: str) -> StreamChunk:
        """End ``req`` with ``reason``; returns (and sends its listener) the final chunk."""
        self.release(req, reason)
        self.update_text(req)
        chunk = self.chunk(req, final=True)
        chunk.output = req.to_output()
        self.requests.pop(req.input.rid, None)
        listener = self.listeners.pop(req.input.rid, None)
        if listener is not None:
            listener(chunk)
        return chunk
