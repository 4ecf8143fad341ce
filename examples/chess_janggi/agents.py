"""Game agents: an LLM agent over the radixserve SDK, a random mover and a one-ply greedy player.

The LLM agent's prompt is a long system prompt (rules and strategy) shared by every agent of a
game type, followed by a short per-move part: side, ASCII board, FEN, recent moves, legal moves.
With ``render`` (the model's chat template, :func:`chat_renderer`) the system prompt is the system
message, then one worked example exchange, then the position as the user's turn. So every agent of a
game hits the same cached system prompt, and one agent's consecutive prompts share nothing past it
(the board changes), which is the realistic fleet workload.

Move selection (``mode``):
* ``choose``: score every legal move as a continuation of the prompt (``AsyncClient.choose``):
  legal by construction;
* ``generate``: free generation, parsed (the first legal UCI move anywhere in the answer); an
  unparsable or illegal answer is re-prompted with the reason (as the next chat turn), at most
  ``max_retries`` times, then it falls back to ``choose``. Every illegal attempt and every fallback
  is counted;
* ``constrained``: generation under a grammar that admits exactly the legal moves
  (:func:`legal_move_constraint`, xgrammar token masks on the server): legal by construction,
  one call per move, no retries;
* ``tools``: an OpenAI tool call through the official ``openai`` client and the HTTP gateway: the
  agent gets the position and one tool, ``make_move(move)``, whose ``move`` is an ``enum`` of the
  legal moves (:func:`make_move_tool`), and ``tool_choice`` names it; the server's tool grammar
  makes the call's arguments valid, so the move is legal by construction. The worked example is a
  tool call too (:func:`tool_messages`). A call that is missing or illegal counts as an illegal
  attempt and falls back to ``choose``.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from examples.chess_janggi.rules import JANGGI_LEGEND, Game, IllegalMove

CHESS_SYSTEM = """You are a chess engine assistant playing a full game of chess against an opponent.
Rules of chess, briefly. The board has eight files a to h and eight ranks 1 to 8. White moves first, then the
players alternate. A king moves one square in any direction and may never move into check. A queen moves any
number of squares along ranks, files and diagonals. A rook moves along ranks and files; a bishop along
diagonals; neither may jump. A knight moves in an L shape: two squares in one direction and one square to the
side, and it may jump over pieces. A pawn moves one square forward, or two from its starting rank, and captures
one square diagonally forward; en passant capture is allowed right after an enemy pawn's double step; a pawn
reaching the last rank promotes (write the piece letter at the end, like e7e8q). Castling moves the king two
squares toward a rook (e1g1, e1c1, e8g8, e8c8) when neither has moved, the squares between are empty and the
king does not pass through check. Checkmate wins; stalemate, threefold repetition, the fifty-move rule and
insufficient material are draws.
Strategy. In the opening, control the centre with pawns and pieces, develop knights before bishops, castle
early, do not move the same piece twice without reason and do not bring the queen out too early. In the
middlegame, look first for checks, captures and threats, for both sides; keep pieces protected; trade when
ahead in material; put rooks on open files; avoid weakening the pawns in front of your king. In the endgame,
activate the king, push passed pawns and use the rooks behind them. Material values: pawn 1, knight 3,
bishop 3, rook 5, queen 9.
Notation. Moves are written in UCI: the from-square and the to-square, like e2e4 or g8f6, plus a promotion
letter when needed. Uppercase letters on the board are White's pieces (K king, Q queen, R rook, B bishop,
N knight, P pawn), lowercase letters are Black's, and '.' is an empty square. Rank 8 is printed at the top.
You will be shown the position and the list of legal moves. Answer with exactly one legal move in UCI.
"""

JANGGI_SYSTEM = (
    """You are a janggi (Korean chess) assistant playing a full game of janggi against an opponent.
Rules of janggi, briefly. The board has nine files a to i and ten ranks 1 to 10; pieces stand on the
intersections. Cho (uppercase, at the bottom) moves first; Han (lowercase, at the top) gets 1.5 points of
compensation. Each side has a palace of three by three points (files d to f, ranks 1 to 3 for Cho and 8 to 10
for Han) with diagonal lines through its corners and centre. The general (K) and the guards (A) move one step
along the palace lines and never leave the palace. The horse (N) moves one point orthogonally and then one
point diagonally outward; it is blocked when the orthogonal point is occupied. The elephant (B) moves one
point orthogonally and then two points diagonally outward; it is blocked at either intermediate point. The
chariot (R) moves any distance along files and ranks, and along the palace diagonals. The cannon (C) must
jump over exactly one piece, the screen, to move or to capture; the screen may not be a cannon, and a cannon
never captures a cannon. The soldier (P) moves one point forward or sideways, and forward along the diagonals
inside the enemy palace. A player may pass instead of moving (written as the general moving to its own
square, like e2e2 or e9e9) unless in check. Two passes in a row end the game by counting points: chariot 13,
cannon 7, horse 5, elephant 3, guard 3, soldier 2, and 1.5 for Han. Checkmating the general wins. Generals
facing each other on an open file (bikjang) must be resolved.
Strategy. Develop the chariots early along the open edge files, bring the horses out before the elephants,
keep the guards close to the general, use the cannons with a screen in front of the enemy palace and keep a
screen-free file for your own general. Trade cannons for horses when the board opens up. Look first for
checks, captures and threats, for both sides, and keep your pieces protected.
Notation. Moves are written in UCI: the from-point and the to-point, like b1c3 or h10g8 (rank 10 has two
digits). """
    + JANGGI_LEGEND
    + """
You will be shown the position and the list of legal moves. Answer with exactly one legal move in UCI.
"""
)

SYSTEM_PROMPTS = {"chess": CHESS_SYSTEM, "janggi": JANGGI_SYSTEM}
_SUBMITTED = itertools.count()  # submission order of SDK calls, over all agents (for the ideal hit rate)


def position_text(game: Game, recent: int = 8) -> str:
    """This position: side, board, FEN, recent and legal moves."""
    side = game.side_to_move
    last = game.moves[-recent:]
    history = " ".join(last) if last else "(none: this is the first move)"
    return (
        f"Position after {game.ply} plies. You play {side.capitalize()}.\n"
        f"Board:\n{game.ascii()}\n"
        f"FEN: {game.fen()}\n"
        f"Recent moves: {history}\n"
        f"Legal moves: {' '.join(game.legal_moves())}"
    )


def move_prompt(game: Game, recent: int = 8) -> str:
    """Plain-text prompt (no chat template): the shared system prompt, then this position."""
    return f"{SYSTEM_PROMPTS[game.kind]}\n{position_text(game, recent)}\nYour move:"


#: The worked example of the chat prompts: the answer to the starting position (a horse move in janggi).
EXAMPLE_MOVES = {"chess": "e2e4", "janggi": "b1c3"}


def example_exchange(kind: str) -> list[dict]:
    """One worked example (the starting position and a move), the same for every agent of a game,
    so it is part of the shared, cached prefix. Small models answer in the example's format with it
    (SmolLM2-135M without it describes the board instead of moving)."""
    from examples.chess_janggi.rules import ChessGame, JanggiGame

    start = ChessGame() if kind == "chess" else JanggiGame()
    return [{"role": "user", "content": position_text(start) + "\nYour move:"}, {"role": "assistant", "content": EXAMPLE_MOVES[kind]}]


def move_messages(game: Game, recent: int = 8) -> list[dict]:
    """Chat form: the shared system prompt and worked example, then this position as the user's turn."""
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[game.kind]},
        *example_exchange(game.kind),
        {"role": "user", "content": position_text(game, recent) + "\nYour move:"},
    ]


def make_move_tool(game: Game) -> dict:
    """The ``make_move`` function tool of a position: its one argument an ``enum`` of the legal moves."""
    return {
        "type": "function",
        "function": {
            "name": "make_move",
            "description": "Play one legal move, in UCI notation.",
            "parameters": {
                "type": "object",
                "properties": {"move": {"type": "string", "enum": game.legal_moves()}},
                "required": ["move"],
                "additionalProperties": False,
            },
        },
    }


def tool_messages(game: Game, recent: int = 8) -> list[dict]:
    """Chat form for tool calling: the shared system prompt, the worked example as a ``make_move``
    call and its result, then this position."""
    from examples.chess_janggi.rules import ChessGame, JanggiGame

    start = ChessGame() if game.kind == "chess" else JanggiGame()
    example = {"id": "call_example", "type": "function", "function": {"name": "make_move", "arguments": json.dumps({"move": EXAMPLE_MOVES[game.kind]})}}
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[game.kind]},
        {"role": "user", "content": position_text(start) + "\nYour move:"},
        {"role": "assistant", "content": None, "tool_calls": [example]},
        {"role": "tool", "tool_call_id": "call_example", "content": "played " + EXAMPLE_MOVES[game.kind]},
        {"role": "user", "content": position_text(game, recent) + "\nYour move:"},
    ]


def chat_renderer(tokenizer) -> Callable[[list[dict]], str] | None:
    """``messages -> prompt text`` through the tokenizer's chat template (None if it has none)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    return lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass
class MoveStats:
    """What one agent's decisions cost; the fleet sums these."""

    calls: int = 0  # SDK calls (choose or generate)
    llm_moves: int = 0
    latency_s: list[float] = field(default_factory=list)  # per move, end to end
    ttft_s: list[float] = field(default_factory=list)  # per SDK call, as the server measured
    query_tokens: int = 0
    cached_tokens: int = 0
    illegal_attempts: int = 0
    fallbacks: int = 0
    tool_calls: int = 0  # mode tools: the calls the model made
    requests: list[tuple] = field(default_factory=list)  # (seq, "choose", prompt, choices) | (seq, "generate", prompt, completion ids)


class RandomAgent:
    """A uniformly random legal move (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.stats = MoveStats()

    async def select(self, game: Game) -> str:
        return self.rng.choice(game.legal_moves())


class GreedyAgent(RandomAgent):
    """One ply, material only: the move after which the opponent is worst off; ties at random."""

    name = "greedy"

    async def select(self, game: Game) -> str:
        best, best_moves = None, []
        for move in game.legal_moves():
            score = -game.after(move).material()
            if best is None or score > best:
                best, best_moves = score, [move]
            elif score == best:
                best_moves.append(move)
        return self.rng.choice(best_moves)


class LLMAgent:
    """An agent whose moves come from a radixserve server through :class:`AsyncClient`."""

    name = "llm"

    def __init__(
        self,
        client,
        *,
        mode: str = "choose",
        max_retries: int = 3,
        temperature: float = 0.0,
        seed: int | None = None,
        normalize: str = "mean",
        max_tokens: int = 8,
        namespace: str | None = None,
        record: bool = False,
        render: Callable[[list[dict]], str] | None = None,
        openai=None,
        model: str | None = None,
    ):
        if mode not in ("choose", "generate", "constrained", "tools"):
            raise ValueError(f"mode must be choose, generate, constrained or tools, got {mode!r}")
        if mode == "tools" and (openai is None or model is None):
            raise ValueError("mode tools needs openai (an openai.AsyncOpenAI on the server's HTTP API) and model")
        self.client = client
        self.mode = mode
        self.max_retries = max_retries
        self.temperature = temperature
        self.seed = seed
        self.normalize = normalize
        self.max_tokens = max_tokens
        self.namespace = namespace
        self.record = record
        self.render = render  # chat template: prompts are messages rendered by it; None: plain text
        self.openai, self.model = openai, model
        self.stats = MoveStats()

    def _prompt(self, game: Game) -> str:
        return move_prompt(game) if self.render is None else self.render(move_messages(game))

    async def select(self, game: Game) -> str:
        start = time.monotonic()
        prompt = self._prompt(game)
        move = None
        if self.mode == "constrained":
            move = await self._constrained(game, prompt)
        elif self.mode == "tools":
            move = await self._tool_call(game)
            if move is None:
                self.stats.fallbacks += 1
        elif self.mode == "generate":
            move = await self._generate(game, prompt)
            if move is None:
                self.stats.fallbacks += 1
        if move is None:
            move = await self._choose(game, prompt)
        self.stats.llm_moves += 1
        self.stats.latency_s.append(time.monotonic() - start)
        return move

    async def _choose(self, game: Game, prompt: str) -> str:
        legal = game.legal_moves()
        # Plain prompts end with "Your move:", so a move follows a space; chat prompts end with the
        # assistant header, so the answer starts with the move itself.
        choices = [m for m in legal] if self.render is not None else [" " + m for m in legal]
        seed = None if self.seed is None else self.seed + game.ply
        if self.record:
            self.stats.requests.append((next(_SUBMITTED), "choose", prompt, choices))
        result = await self.client.choose(prompt, choices, normalize=self.normalize, temperature=self.temperature, seed=seed, namespace=self.namespace)
        self._account(result.timings.ttft_s, result.usage.query_tokens, result.usage.cached_tokens)
        return legal[result.index]

    async def _generate(self, game: Game, prompt: str) -> str | None:
        """Free generation, parsed; re-prompted with the reason; None after max_retries failures."""
        text = prompt
        messages = move_messages(game)
        for attempt in range(1 + self.max_retries):
            seed = None if self.seed is None else self.seed * 1000 + game.ply * 10 + attempt
            seq = next(_SUBMITTED)
            out = await self.client.generate(text, max_tokens=self.max_tokens, temperature=self.temperature, seed=seed, stop=["\n"], namespace=self.namespace)
            if self.record:  # the engine caches the completion too
                self.stats.requests.append((seq, "generate", text, out.token_ids))
            self._account(out.timings.ttft_s, out.usage.prompt_tokens, out.usage.cached_tokens)
            try:
                return game.parse(out.text)
            except IllegalMove as exc:
                self.stats.illegal_attempts += 1
                retry = f"That answer was rejected: {exc}. Answer again with one legal move."
                if self.render is None:
                    text = f"{text}{out.text}\n{retry}\nYour move:"
                else:
                    messages += [{"role": "assistant", "content": out.text}, {"role": "user", "content": retry}]
                    text = self.render(messages)
        return None

    async def _constrained(self, game: Game, prompt: str) -> str | None:
        """One generation whose tokens can only spell a legal move; None (then choose) if the
        server ended it early (max_tokens too small for the longest move)."""
        seed = None if self.seed is None else self.seed * 1000 + game.ply * 10
        seq = next(_SUBMITTED)
        out = await self.client.generate(
            prompt,
            max_tokens=max(self.max_tokens, 16),
            temperature=self.temperature,
            seed=seed,
            namespace=self.namespace,
            structured=legal_move_constraint(game),
        )
        if self.record:
            self.stats.requests.append((seq, "generate", prompt, out.token_ids))
        self._account(out.timings.ttft_s, out.usage.prompt_tokens, out.usage.cached_tokens)
        move = out.text.strip()
        if move not in game.legal_moves():
            self.stats.illegal_attempts += 1
            return None
        return move

    async def _tool_call(self, game: Game) -> str | None:
        """One chat completion with the ``make_move`` tool forced; the move of its call, or None."""
        seed = None if self.seed is None else self.seed * 1000 + game.ply * 10
        resp = await self.openai.chat.completions.create(
            model=self.model,
            messages=tool_messages(game),
            tools=[make_move_tool(game)],
            parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "make_move"}},
            max_tokens=max(self.max_tokens, 32),
            temperature=self.temperature,
            seed=seed,
        )
        details = resp.usage.prompt_tokens_details
        self._account(None, resp.usage.prompt_tokens, details.cached_tokens if details else 0)  # HTTP: no TTFT
        calls = resp.choices[0].message.tool_calls or []
        self.stats.tool_calls += len(calls)
        try:
            move = json.loads(calls[0].function.arguments)["move"] if calls else None
        except (ValueError, KeyError, TypeError):
            move = None
        if move not in game.legal_moves():
            self.stats.illegal_attempts += 1
            return None
        return move

    def _account(self, ttft: float | None, query: int, cached: int) -> None:
        self.stats.calls += 1
        if ttft is not None:
            self.stats.ttft_s.append(ttft)
        self.stats.query_tokens += query
        self.stats.cached_tokens += cached


def legal_move_constraint(game: Game):
    """Structured output admitting exactly one legal move, after a space (as the choose mode
    scores them): ``StructuredOutput(choice=[" e2e4", " d2d4", ...])``."""
    from radixserve.engine.structured import StructuredOutput

    return StructuredOutput(choice=[" " + m for m in game.legal_moves()])
