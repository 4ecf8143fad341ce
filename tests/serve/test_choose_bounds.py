"""Issue 49 item 10: choose calls neither stall the router's loop nor ask unbounded work.
An in-process router (no worker: an admitted call just waits in the queue), raw SDK calls."""

from __future__ import annotations

import asyncio
import time

import pytest

from radixserve import protocol as P
from radixserve.client import AsyncClient
from radixserve.errors import TooLongError
from radixserve.serve.router import RouterConfig

from serve_cluster import running_router

pytestmark = pytest.mark.timeout(60)

SLOW_S_PER_KCHAR = 0.02  # the fake tokenizer's cost: 20 ms per 1000 characters


class _CharTokenizer:
    """One token per character, slow like a real tokenizer on megabytes (it sleeps)."""

    is_fast = False

    def get_vocab(self) -> dict[str, int]:
        return {chr(97 + i): i for i in range(26)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(len(text) / 1000 * SLOW_S_PER_KCHAR)
        return [ord(c) % 512 for c in text]


def _router(**kw):
    config = RouterConfig(port=0, max_queue=64, **kw)
    ctx = running_router(config)
    return ctx


def test_choose_with_token_ids_is_tokenized_off_the_loop():
    """Ten choose calls with token_ids and 60k characters of choices each (1.2 s to tokenize
    each here): the router answers a health probe meanwhile at once. Before, the choices were
    tokenized on the loop whenever the prompt was token ids: the probe waited 12 s."""
    with _router() as router:
        router.set_tokenizer(_CharTokenizer())
        choices = ["abcd" * 15] * 1000  # 60,000 characters, under max_choice_chars (65,536)

        async def main():
            async with AsyncClient(router.address, timeout=30) as c:
                calls = [asyncio.ensure_future(c.choose([1, 2, 3], choices, timeout=2.0)) for _ in range(10)]
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                await c.health(timeout=5.0)
                took = time.monotonic() - t0
                results = await asyncio.gather(*calls, return_exceptions=True)
                return took, results

        took, results = asyncio.run(main())
        assert took < 0.5, f"a health probe waited {took:.2f} s behind choose tokenizing"
        # every call got an answer: 60,000 choice tokens is over max_choice_tokens (8,192), or
        # the pool was full (overloaded), or it timed out waiting in the queue (no worker)
        assert all(isinstance(r, Exception) for r in results), results
        assert any(isinstance(r, TooLongError) and "max_choice_tokens" in str(r) for r in results), results


def test_choose_work_is_bounded_in_characters_and_tokens():
    with _router(max_model_len=2048) as router:
        router.set_tokenizer(_CharTokenizer())

        async def main():
            async with AsyncClient(router.address, timeout=10) as c:
                t0 = time.monotonic()
                with pytest.raises(TooLongError, match="max_choice_chars") as huge:
                    await c.choose([1, 2, 3], ["x" * 2048] * 128)  # 128 x 2 KiB: the repro
                assert time.monotonic() - t0 < 1.0  # refused untokenized
                assert huge.value.code == P.TOO_LONG and huge.value.field == "choices"
                with pytest.raises(TooLongError, match=r"3000 tokens in all; the limit is 2048 \(the model's context\)"):
                    await c.choose("a prompt", ["abc"] * 1000)
                # within both bounds: admitted (it waits in the queue: there is no worker)
                with pytest.raises(Exception) as waited:
                    await c.choose("a prompt", ["abc"] * 600, timeout=0.5)
                assert waited.type.__name__ == "RequestTimeoutError"

        asyncio.run(main())


def test_choose_limits_are_validated_at_the_protocol():
    limits = P.Limits(max_choice_chars=10)
    P.validate_choose(P.Choose(id="a", token_ids=[1], choices=["abcde", "fghij"]), limits)
    with pytest.raises(TooLongError, match="11 characters in all; the limit is 10"):
        P.validate_choose(P.Choose(id="a", token_ids=[1], choices=["abcde", "fghijk"]), limits)
