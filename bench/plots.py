"""PNG figures from the JSON the other commands write (matplotlib, the ``bench`` extra).

* ``--timeline F.jsonl`` (from ``python -m bench serve --timeline``): TTFT and queue depth per
  second -> ``serve_timeline.png``;
* ``--simulate F.json`` (stdout of ``python -m bench simulate --json``): hit rate per policy as
  bars, grouped by capacity, ideal as a line -> ``simulate_hit_rate.png``;
* ``--throughput F.json`` (stdout of ``python -m bench throughput --json``): aggregate and per
  stream tokens/s against concurrency -> ``throughput.png``.

Any subset of the three; files go to ``--out`` (default ``bench/plots``).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import log

HELP = "PNG plots from serve --timeline, simulate --json and throughput --json outputs"


def add_arguments(p) -> None:
    p.add_argument("--timeline", default=None, metavar="F.jsonl", help="from `python -m bench serve --timeline`")
    p.add_argument("--simulate", default=None, metavar="F.json", help="stdout of `python -m bench simulate --json`")
    p.add_argument("--throughput", default=None, metavar="F.json", help="stdout of `python -m bench throughput --json`")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "plots"), help="output folder")
    p.add_argument("--title", default="", help="suffix for every figure title (e.g. the machine)")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load_json(path: str) -> dict:
    text = Path(path).read_text()
    # accept a file with log lines around the object: take the last line that parses
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise


def _save(plt, fig, dest: Path) -> Path:
    fig.tight_layout()
    fig.savefig(dest)
    plt.close(fig)
    return dest


def plot_timeline(path: str, out: Path, title: str = "") -> Path:
    plt = _plt()
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    t = [r["t_s"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, dpi=100)
    pts = [(r["t_s"], r["ttft_mean_s"], r["ttft_max_s"]) for r in rows if r.get("ttft_mean_s") is not None]
    if pts:
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label="mean")
        ax1.plot([p[0] for p in pts], [p[2] for p in pts], "^:", ms=3, label="max")
        ax1.legend(loc="upper left", fontsize=8)
    ax1.set_ylabel("TTFT (s)")
    ax1.set_title("TTFT of requests whose first token came in that second" + (f" -- {title}" if title else ""), fontsize=10)
    ax1.grid(alpha=0.3)
    ax2.step(t, [r.get("queue_depth_max") or 0 for r in rows], where="post", label="queue depth (max)")
    ax2.step(t, [r.get("inflight_max") or 0 for r in rows], where="post", ls="--", label="in flight, client (max)")
    ax2.set_ylabel("requests")
    ax2.set_xlabel("time since start (s)")
    ax2.legend(loc="upper left", fontsize=8)
    ax2.grid(alpha=0.3)
    return _save(plt, fig, out / "serve_timeline.png")


def plot_simulate(path: str, out: Path, title: str = "") -> Path:
    plt = _plt()
    res = _load_json(path)
    rows = [r for r in res["rows"] if r["policy"] != "ideal" and r.get("workers", 1) == 1]
    caps = sorted({r["capacity"] for r in rows if r["capacity"] is not None})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["capacity"] is not None))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(policies) * max(1, len(caps)) * 0.6 + 2), 4.5), dpi=100)
    width = 0.8 / max(1, len(caps))
    ideal = res.get("ideal")
    top = max([100 * r["hit_rate"] for r in rows] + [100 * (ideal or 0), 1.0])
    for j, cap in enumerate(caps):
        vals = [next((100 * r["hit_rate"] for r in rows if r["policy"] == p and r["capacity"] == cap), 0.0) for p in policies]
        xs = [i + (j - (len(caps) - 1) / 2) * width for i in range(len(policies))]
        ax.bar(xs, vals, width, label=f"capacity {cap:,}")
        for x, v in zip(xs, vals):  # inside the bar top (clear of the ideal line), above short bars
            inside = v > 0.1 * top
            ax.text(
                x,
                v - 0.01 * top if inside else v + 0.01 * top,
                f"{v:.1f}",
                ha="center",
                va="top" if inside else "bottom",
                fontsize=8,
                color="white" if inside else "black",
            )
    if ideal is not None:
        ax.axhline(100 * ideal, color="k", ls="--", lw=1, label=f"ideal (infinite cache) {100 * ideal:.2f}%")
    ax.set_ylim(0, top * 1.2)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels(policies, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("token-weighted hit rate (%)")
    ax.set_title("prefix-cache hit rate per policy" + (f" -- {title}" if title else ""), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, out / "simulate_hit_rate.png")


def plot_throughput(path: str, out: Path, title: str = "") -> Path:
    plt = _plt()
    res = _load_json(path)
    rows = sorted(res["engine"], key=lambda r: r["concurrency"])
    c = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    ax.plot(c, [r["aggregate_tok_s"] for r in rows], "o-", label="aggregate (tok/s)")
    ax.plot(c, [r["per_stream_tok_s"] for r in rows], "s--", label="per stream (tok/s)")
    for x, r in zip(c, rows):
        ax.annotate(f"{r['aggregate_tok_s']:.0f}", (x, r["aggregate_tok_s"]), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if any(r.get("serial_tok_s") for r in rows):
        ax.plot(c, [r.get("serial_tok_s") for r in rows], "x:", label="serial transformers (tok/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(c)
    ax.set_xticklabels([str(x) for x in c])
    ax.set_xlabel("concurrency (requests at once)")
    ax.set_ylabel("generated tokens/s")
    cfg = res.get("config", {})
    ax.set_title(
        f"decode throughput, {cfg.get('prompt_len', '?')}-token prompts, {cfg.get('gen_len', '?')} new tokens" + (f" -- {title}" if title else ""), fontsize=10
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(plt, fig, out / "throughput.png")


def run(args) -> int:
    if not (args.timeline or args.simulate or args.throughput):
        log("nothing to plot: pass --timeline, --simulate and/or --throughput")
        return 2
    try:
        _plt()
    except ImportError:
        log("matplotlib is not installed: pip install matplotlib (or the 'bench' extra)")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.timeline:
        written.append(plot_timeline(args.timeline, out, args.title))
    if args.simulate:
        written.append(plot_simulate(args.simulate, out, args.title))
    if args.throughput:
        written.append(plot_throughput(args.throughput, out, args.title))
    for p in written:
        print(p)
    return 0
