"""Issue 13 items 1 and 3 in real processes: a router stall kills no worker; a bad tenant fails alone."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import string
import subprocess
import time

import pytest

from radixserve.client import AsyncClient, Client, Completion
from radixserve.errors import BadRequestError, TooLongError

from conftest import random_prompts
from serve_cluster import Cluster

pytestmark = pytest.mark.timeout(300)

HUGE_CHARS = 1_900_000  # inside the 4 MiB frame and 2**21-character limits


def _huge_prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(3000)]
    return " ".join(rng.choices(words, k=HUGE_CHARS // 5))[:HUGE_CHARS]


@pytest.fixture(scope="module")
def cluster(llama_dir):
    # --max-prompt-chars lifts the context-derived character cap, so the huge prompts really are
    # tokenized (seconds each) and the test exercises tokenizing off the router's loop.
    c = Cluster(llama_dir, 2, "--max-prompt-chars", str(2**21), "--policy", "round_robin", restart=True)
    yield c
    c.stop()


def test_stall_repro_keeps_the_original_workers(cluster):
    """Three ~1.9M-character prompts, then 32 normal requests: all succeed, on the same pids."""

    async def main():
        async with AsyncClient(cluster.address, timeout=120) as client:
            huge = [asyncio.ensure_future(client.generate(_huge_prompt(i), max_tokens=4)) for i in range(3)]
            done = await asyncio.gather(*huge, return_exceptions=True)
            await asyncio.sleep(6.0)  # past the workers' 5 s no-word-from-the-router re-register point
            prompts = random_prompts([8 + i % 9 for i in range(32)], seed=11)
            outs = await asyncio.gather(*(client.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in prompts), return_exceptions=True)
            return done, outs, await client.stats()

    huge, outs, stats = asyncio.run(main())
    assert all(isinstance(e, TooLongError) for e in huge), huge  # 1.5M tokens > the 128k-token limit
    assert all(isinstance(o, Completion) and len(o.token_ids) == 6 for o in outs), outs
    pids = {name: w["pid"] for name, w in stats["workers"].items()}
    assert pids == cluster.pids, (pids, cluster.pids)
    assert all(w["alive"] for w in stats["workers"].values())
    assert stats["router"]["counters"]["worker_deaths"] == 0
    for pid in pids.values():
        os.kill(pid, 0)  # the original processes are still there


def test_default_char_cap_refuses_untokenizable_prompts(llama_dir):
    """Without the override, a prompt that cannot fit the context is refused before tokenizing."""
    from radixserve.serve.router import Router, RouterConfig, load_tokenizer

    router = Router(RouterConfig(max_model_len=4096), load_tokenizer(llama_dir))
    limit = router.prompt_char_limit()
    assert 4096 * 4 <= limit <= 4096 * 64 and limit < HUGE_CHARS
    with pytest.raises(TooLongError):
        router.front.check_prompt_chars(HUGE_CHARS)
    router.front.check_prompt_chars(limit)


def test_insane_sampling_request_fails_alone(cluster):
    """repetition_penalty / temperature = 1e-300 get a 'bad_request' of their own; concurrent
    requests of other tenants finish."""

    async def main():
        async with AsyncClient(cluster.address, timeout=120) as client:
            prompts = random_prompts([12] * 8, seed=12)
            good = [client.generate(p, max_tokens=8, temperature=0.8, seed=i, ignore_eos=True, namespace=f"t{i}") for i, p in enumerate(prompts)]
            bad = [
                client.generate(prompts[0], max_tokens=8, repetition_penalty=1e-300, namespace="evil"),
                client.generate(prompts[1], max_tokens=8, temperature=1e300, namespace="evil"),
            ]
            return await asyncio.gather(*good, *bad, return_exceptions=True)

    outs = asyncio.run(main())
    assert all(isinstance(o, Completion) and len(o.token_ids) == 8 for o in outs[:8]), outs
    assert [type(e) for e in outs[8:]] == [BadRequestError, BadRequestError], outs[8:]
    assert outs[8].field == "repetition_penalty" and outs[9].field == "temperature"


def test_a_remote_worker_cannot_take_a_live_workers_name(cluster, llama_dir):
    """Issue 49 item 14: a remote worker started with --worker-id w0 took the local w0's ZMQ
    identity and name in turn with it (18 worker deaths in 60 s). It is refused and exits 3."""
    rogue = cluster.start_worker(llama_dir, "w0", stderr=subprocess.PIPE, text=True)
    try:
        _, err = rogue.communicate(timeout=90)
    finally:
        if rogue.poll() is None:
            rogue.kill()
            rogue.wait()
    assert rogue.returncode == 3, err[-2000:]
    assert "belongs to a live worker" in err and "--worker-id" in err, err[-2000:]
    with Client(cluster.address, timeout=60) as c:
        stats = c.stats()
        assert stats["workers"]["w0"]["alive"] and stats["workers"]["w0"]["pid"] == cluster.pids["w0"]
        assert stats["router"]["counters"]["worker_deaths"] == 0
        assert len(c.generate([5, 6, 7], max_tokens=2, temperature=0.0).token_ids) == 2


def test_supervisor_restarts_a_dead_worker(cluster):
    """Last in this module (it changes the cluster): a SIGKILLed local worker comes back as a new
    process and serves again."""
    victim = cluster.pids["w0"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 90
    with Client(cluster.address, timeout=60) as c:
        while True:
            w0 = c.stats()["workers"].get("w0", {})
            if w0.get("alive") and w0.get("pid") not in (None, victim):
                break
            assert time.monotonic() < deadline, w0
            time.sleep(0.2)
        outs = c.batch(random_prompts([9] * 6, seed=13), max_tokens=3, temperature=0.0, ignore_eos=True)
        assert all(len(o.token_ids) == 3 for o in outs)
        assert c.stats()["router"]["counters"]["worker_deaths"] == 1
