"""The sampler's cost per decode step: :class:`radixserve.engine.sampler.Sampler` alone on a batch
of fp32 logits, by batch size and sampling parameters (greedy, temperature, top-k, top-p, min-p,
rows with their own seed). A step of a sampled batch pays this on top of the forward pass, so at
a small model's few-millisecond steps it decides the step time. Prints the median ms per step and
microseconds per row, on ``--threads`` threads, for a vocabulary of ``--vocab`` tokens (32000:
the bench model's; SmolLM2's is 49152)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

HELP = "the sampler's time per step by batch size and sampling parameters"

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "min_p=0.05": dict(temperature=1.0, min_p=0.05),
    "seeded": dict(temperature=1.0, seed=7),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", default="1,16,64", help="comma list of batch sizes")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list from " + ",".join(CASES))
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    from radixserve.engine.request import Request
    from radixserve.engine.sampler import Sampler
    from radixserve.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    g = torch.Generator().manual_seed(0)
    results = []
    for case in cases:
        for batch in batches:
            params = SamplingParams(max_tokens=16, **CASES[case])
            reqs = [Request(rid=f"r{i}", prompt_ids=[1], params=params, generator=sampler.generator_for(params.seed)) for i in range(batch)]
            # logits with a realistic spread: a few strong candidates over a long tail
            logits = torch.randn(batch, args.vocab, generator=g) * 2.0
            times = []
            for rep in range(args.repeats + 2):
                t0 = time.perf_counter()
                sampler(logits, reqs)
                if rep >= 2:
                    times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            results.append(dict(case=case, batch=batch, ms_per_step=ms, us_per_row=ms * 1e3 / batch))
    if args.json:
        print(json.dumps(dict(vocab=args.vocab, threads=args.threads, results=results)))
        return 0
    print(f"sampler, vocab {args.vocab}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'case':<14}{'batch':>6}{'ms/step':>10}{'us/row':>9}")
    for r in results:
        print(f"{r['case']:<14}{r['batch']:>6}{r['ms_per_step']:>10.3f}{r['us_per_row']:>9.1f}")
    return 0
