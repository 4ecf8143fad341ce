"""Load driver for tests/serve/test_netns.py (not a test module): a raw-protocol client, so it sees
every reply, including a second answer to the same request, which the SDK would hide.

It keeps ``--concurrency`` requests in flight for ``--duration`` seconds (half share one of a few
long prefixes, half are fresh; a third stream), gives each one ``--deadline`` seconds to end, then
listens ``--linger`` seconds more for late duplicates, asks the router for its stats, and writes
one JSON record per request plus the stats to ``--out``::

    {"requests": [{"id", "sent", "ended", "kind": ok|coded|hung, "code", "worker", "replies"}],
     "stats": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import zmq
import zmq.asyncio

from radixserve import protocol as P
from radixserve.sampling_params import SamplingParams

API_KEY = os.environ.get("RADIXSERVE_API_KEY")  # (the router's clients carry their key: serve --api-key)


async def drive(args) -> dict:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.address)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(7, 500) for _ in range(96)] for _ in range(4)]
    records: dict[str, dict] = {}
    waiters: dict[str, asyncio.Event] = {}
    stats_box: list[dict] = []

    async def reader() -> None:
        while True:
            msg = P.decode(await sock.recv())
            if isinstance(msg, P.StatsReply):
                stats_box.append(msg.stats)
                continue
            rec = records.get(getattr(msg, "id", ""))
            if rec is None:
                continue
            if isinstance(msg, (P.Final, P.Error)):
                rec["replies"] += 1
                if rec["replies"] == 1:
                    rec["ended"] = time.time()
                    if isinstance(msg, P.Final):
                        rec["kind"], rec["worker"] = "ok", msg.worker
                    else:
                        rec["kind"], rec["code"] = "coded", msg.code
                    waiters[msg.id].set()
            elif isinstance(msg, P.Chunk):
                rec["chunks"] += 1

    async def one(n: int) -> None:
        rid = f"r{n}"
        if n % 2:
            tokens = rng.choice(prefixes) + [rng.randrange(7, 500) for _ in range(8)]
        else:
            tokens = [rng.randrange(7, 500) for _ in range(48)]
        records[rid] = {"id": rid, "sent": time.time(), "ended": None, "kind": "hung", "code": "", "worker": "", "replies": 0, "chunks": 0}
        waiters[rid] = asyncio.Event()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        await sock.send(P.encode(P.Generate(id=rid, token_ids=tokens, params=params, stream=n % 3 == 0, api_key=API_KEY)))
        try:
            await asyncio.wait_for(waiters[rid].wait(), args.deadline)
        except asyncio.TimeoutError:
            pass  # stays "hung"

    async def lane(k: int, counter) -> None:
        while time.time() < stop_at:
            await one(next(counter))

    import itertools

    counter = itertools.count()
    stop_at = time.time() + args.duration
    read_task = asyncio.ensure_future(reader())
    await asyncio.gather(*(lane(k, counter) for k in range(args.concurrency)))
    await asyncio.sleep(args.linger)  # a duplicate answer would arrive now
    await sock.send(P.encode(P.Stats(id="stats-1", api_key=API_KEY)))
    for _ in range(100):
        if stats_box:
            break
        await asyncio.sleep(0.1)
    read_task.cancel()
    sock.close()
    ctx.term()
    return {"requests": list(records.values()), "stats": stats_box[0] if stats_box else {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--duration", type=float, default=25.0)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--deadline", type=float, default=30.0)
    ap.add_argument("--linger", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = asyncio.run(drive(args))
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
