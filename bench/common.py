"""Helpers shared by the ``python -m bench`` commands: options, token workloads, statistics,
progress on stderr, tables, JSON output and the ideal (infinite-cache) prefix hit rate."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

# Ids below this are the built-in tokenizers' special tokens (bos, eos, pad, roles, end):
# random workloads never use them, so no prompt contains an EOS.
FIRST_PLAIN_ID = 7

_START: dict[str, Any] = {}


# -- options -----------------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="model directory or .gguf file (default: the bench model, built once in ~/.cache/radixserve)")
    p.add_argument("--device", default="cpu", help="torch device for the engine (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of tables")
    p.add_argument(
        "--threads",
        type=threads_arg,
        default="auto",
        metavar="N|auto",
        help="torch intra-op threads; auto: the CPUs not already busy (1-minute load average) "
        "-- torch's worker threads slow down several-fold when they share cores",
    )


def threads_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return n


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def setup(args: argparse.Namespace) -> str:
    """Apply process-wide options; return the model directory to benchmark."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    mark_start()
    torch.set_num_threads(choose_threads(args.threads, torch.get_num_threads()))
    if args.model:  # a .gguf file: its converted directory (radixserve.model.gguf)
        from radixserve.model.default import resolve_model

        return str(resolve_model(args.model))
    from bench.models import bench_model_path

    return str(bench_model_path())


def mark_start() -> None:
    """Record the load average now, for :func:`machine_summary`'s ``load_average_at_start``."""
    _START["load"] = load_average()


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def choose_threads(requested: int | str, default: int) -> int:
    """``auto``: torch's default minus the CPUs other processes keep busy (at least 1).

    On a shared 2-core machine with a load average of 3, two torch threads run decode 3-7x
    slower than one: each op waits for a worker thread that is not scheduled.
    """
    load, cpus = load_average(), os.cpu_count() or 1
    if requested != "auto":
        threads = int(requested)
    else:
        busy = round(load) if load is not None else 0
        threads = max(1, min(default, cpus - busy))
        if threads < default:
            log(f"note: load average {load} on {cpus} CPUs before starting: using {threads} torch thread(s) instead of {default} (override with --threads N)")
    if load is not None and load > cpus - 0.5:
        log(
            f"warning: load average {load} on {cpus} CPUs: other processes compete for the cores, so the "
            f"numbers will be lower and noisier than on a quiet machine"
        )
    return threads


def git_revision() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside git."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) if rev else None


def machine_summary() -> dict[str, Any]:
    import platform

    import torch

    return {
        "git": git_revision(),
        "load_average_at_start": _START.get("load"),
        "load_average_at_end": load_average(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu_count']} CPUs, {m['torch_threads']} torch thread(s), load average "
        f"{fmt(m.get('load_average_at_start'), 2)} at start / {fmt(m.get('load_average_at_end'), 2)} at end; "
        f"git {m.get('git') or '-'}"
    )


# -- workloads ---------------------------------------------------------------------------------
def random_ids(rng, n: int, vocab_size: int) -> list[int]:
    """``n`` random token ids from ``numpy.random.Generator`` ``rng``, never special tokens."""
    return rng.integers(FIRST_PLAIN_ID, vocab_size, size=n).tolist()


def rng(*seed: int):
    import numpy as np

    return np.random.default_rng(list(seed))


# -- statistics --------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# -- ideal hit rate ----------------------------------------------------------------------------
class TokenTrie:
    """Every token sequence seen so far, for the ideal (infinite-cache) prefix hit rate.

    ``hit(tokens)`` is the longest prefix of ``tokens`` already seen, capped at ``len - 1`` (the
    last prompt token is always computed: its logits are needed), exactly what a perfect
    cache that never evicts could serve.
    """

    def __init__(self) -> None:
        self.root: dict = {}

    def hit(self, tokens: Sequence[int]) -> int:
        node, n, limit = self.root, 0, len(tokens) - 1
        while n < limit:
            node = node.get(tokens[n])
            if node is None:
                break
            n += 1
        return n

    def add(self, tokens: Iterable[int]) -> None:
        node = self.root
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
            node = nxt


def ideal_hit_tokens(events: Iterable[tuple[str, Sequence[int]]]) -> tuple[int, int]:
    """Walk a trace of ``("arrive", prompt)`` and ``("known", tokens)`` events in order.

    A prompt's ideal hit is its longest prefix among everything known before it; the prompt
    becomes known at its arrival, and ``known`` events add later-known tokens (a request's
    output, cacheable once it is generated). Returns (Σ ideal hit tokens, Σ prompt tokens).
    """
    trie = TokenTrie()
    hit = total = 0
    for kind, tokens in events:
        if kind == "arrive":
            hit += trie.hit(tokens)
            total += len(tokens)
        trie.add(tokens)
    return hit, total


# -- progress ----------------------------------------------------------------------------------
class Progress:
    """Throttled progress lines on stderr: one every ``every`` seconds at first, then spaced to
    about 5% of the elapsed time (a 30-minute run prints ~60 lines), plus the final one."""

    def __init__(self, label: str, total: int | None = None, *, every: float = 5.0, unit: str = "requests", enabled: bool = True):
        self.label, self.total, self.every, self.unit = label, total, every, unit
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.last = self.t0

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        now = time.perf_counter()
        elapsed = now - self.t0
        if not self.enabled or (not force and now - self.last < max(self.every, 0.05 * elapsed)):
            return
        self.last = now
        of = f"/{self.total}" if self.total is not None else ""
        tail = f", {extra}" if extra else ""
        if self.total and 0 < done < self.total:
            tail += f", ~{elapsed / done * (self.total - done):.0f} s to go at this rate"
        log(f"  {self.label}: {done}{of} {self.unit} done, {elapsed:.1f} s elapsed{tail}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- output ------------------------------------------------------------------------------------
def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:,.{digits}f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; numbers right-aligned, the first column left-aligned."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))
    lines = []
    for n, row in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _clean(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become null, tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def emit(args: argparse.Namespace, result: dict, render: Callable[[dict], str]) -> None:
    """``--json``: one JSON object on stdout; otherwise the human-readable report."""
    if args.json:
        json.dump(_clean(result), sys.stdout, indent=None, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(result).rstrip() + "\n")
    sys.stdout.flush()
