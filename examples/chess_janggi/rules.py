"""Rules adapters: chess on python-chess, janggi on pyffish (Fairy-Stockfish).

Both games expose the same small interface (:class:`Game`): legal moves in UCI, ``push``, end of
game and result, FEN, an ASCII board with labelled files and ranks, material for the greedy
player. Janggi always asks pyffish with the START fen and the FULL move list: legality and the
end of the game depend on history (double pass, bikjang).
"""

from __future__ import annotations

import re

import chess
import chess.pgn

try:
    import pyffish as sf
except ImportError:  # pragma: no cover - games extra not installed
    sf = None

JANGGI = "janggi"
JANGGI_START = "rnba1abnr/4k4/1c5c1/p1p1p1p1p/9/9/P1P1P1P1P/1C5C1/4K4/RNBA1ABNR w - - 0 1"
JANGGI_VALUES = {"r": 13, "c": 7, "n": 5, "b": 3, "a": 3, "p": 2, "k": 0}
JANGGI_LEGEND = (
    "Legend: uppercase = Cho (moves first), lowercase = Han. K general, A guard, B elephant, "
    "N horse, R chariot, C cannon, P soldier; '.' empty. Palaces: files d-f, ranks 1-3 and 8-10."
)
CHESS_VALUES = {chess.PAWN: 1, chess.KNIGHT: 3, chess.BISHOP: 3, chess.ROOK: 5, chess.QUEEN: 9, chess.KING: 0}
UCI_RE = re.compile(r"\b([a-i](?:10|[1-9])[a-i](?:10|[1-9])[qrbn]?)\b")


class IllegalMove(ValueError):
    """A proposed move that is not legal here; ``str()`` is the reason (shown to the agent)."""


class Game:
    kind: str
    start_fen: str

    def __init__(self) -> None:
        self.moves: list[str] = []

    # interface
    def legal_moves(self) -> list[str]: ...
    def push(self, uci: str) -> None: ...
    def fen(self) -> str: ...
    def is_over(self) -> bool: ...
    def result(self) -> str: ...
    def ascii(self) -> str: ...
    def material(self) -> float: ...  # side to move's material minus the opponent's
    def after(self, uci: str) -> Game: ...

    @property
    def side_to_move(self) -> str: ...

    @property
    def ply(self) -> int:
        return len(self.moves)

    def parse(self, text: str) -> str:
        """The legal UCI move named in an agent's answer; raises :class:`IllegalMove` saying why."""
        found = UCI_RE.findall(text.lower())
        if not found:
            raise IllegalMove(f"no move in UCI notation (like {self.legal_moves()[0]}) found in the answer")
        legal = set(self.legal_moves())
        for move in found:
            if move in legal:
                return move
        raise IllegalMove(f"{found[0]} is not a legal move in this position")

    def push_checked(self, uci: str) -> None:
        if uci not in self.legal_moves():
            raise IllegalMove(f"{uci} is not legal")
        self.push(uci)


class ChessGame(Game):
    kind = "chess"

    def __init__(self, fen: str = chess.STARTING_FEN, moves: list[str] | None = None):
        super().__init__()
        self.start_fen = fen
        self.board = chess.Board(fen)
        for m in moves or []:
            self.push(m)

    @property
    def side_to_move(self) -> str:
        return "white" if self.board.turn == chess.WHITE else "black"

    def legal_moves(self) -> list[str]:
        return [m.uci() for m in self.board.legal_moves]

    def push(self, uci: str) -> None:
        self.board.push_uci(uci)
        self.moves.append(uci)

    def fen(self) -> str:
        return self.board.fen()

    def is_over(self) -> bool:
        return self.board.outcome(claim_draw=True) is not None

    def result(self) -> str:
        outcome = self.board.outcome(claim_draw=True)
        return outcome.result() if outcome else "*"

    def termination(self) -> str:
        outcome = self.board.outcome(claim_draw=True)
        return outcome.termination.name.lower() if outcome else "move cap"

    def ascii(self) -> str:
        rows = []
        for rank in range(7, -1, -1):
            cells = []
            for file in range(8):
                piece = self.board.piece_at(chess.square(file, rank))
                cells.append(piece.symbol() if piece else ".")
            rows.append(f"{rank + 1} | " + " ".join(cells))
        rows.append("    " + "-" * 15)
        rows.append("    a b c d e f g h")
        return "\n".join(rows)

    def material(self) -> float:
        score = 0
        for piece in self.board.piece_map().values():
            v = CHESS_VALUES[piece.piece_type]
            score += v if piece.color == self.board.turn else -v
        return score

    def after(self, uci: str) -> ChessGame:
        g = ChessGame.__new__(ChessGame)
        g.start_fen, g.moves, g.board = self.start_fen, self.moves + [uci], self.board.copy(stack=False)
        g.board.push_uci(uci)
        return g

    def san(self, uci: str) -> str:
        return self.board.san(chess.Move.from_uci(uci))

    def pgn(self, headers: dict[str, str] | None = None) -> str:
        game = chess.pgn.Game.from_board(self.board)
        for k, v in (headers or {}).items():
            game.headers[k] = v
        game.headers["Result"] = self.result()
        return str(game)


class JanggiGame(Game):
    kind = "janggi"

    def __init__(self, fen: str = JANGGI_START, moves: list[str] | None = None, variant: str = JANGGI):
        if sf is None:
            raise ImportError("janggi needs pyffish: pip install 'radixserve[games]'")
        super().__init__()
        self.variant = variant
        self.start_fen = fen
        self.moves = list(moves or [])
        self._legal: list[str] | None = None
        self._fen: str | None = None

    @property
    def side_to_move(self) -> str:
        return "cho" if self.fen().split()[1] == "w" else "han"

    def legal_moves(self) -> list[str]:
        if self._legal is None:
            self._legal = sf.legal_moves(self.variant, self.start_fen, self.moves)
        return list(self._legal)

    def push(self, uci: str) -> None:
        self.moves.append(uci)
        self._legal = self._fen = None

    def fen(self) -> str:
        if self._fen is None:
            self._fen = sf.get_fen(self.variant, self.start_fen, self.moves)
        return self._fen

    def is_over(self) -> bool:
        return not self.legal_moves() or sf.is_immediate_game_end(self.variant, self.start_fen, self.moves)[0]

    def result(self) -> str:
        if not self.is_over():
            return "*"
        value = sf.game_result(self.variant, self.start_fen, self.moves)  # for the side to move
        if value == 0:
            return "1/2-1/2"
        stm_wins = value > 0
        cho_to_move = self.side_to_move == "cho"
        return "1-0" if stm_wins == cho_to_move else "0-1"

    def termination(self) -> str:
        if not self.is_over():
            return "move cap"
        if len(self.moves) >= 2 and all(self._is_pass(m) for m in self.moves[-2:]):
            return "double pass (counting)"
        return "checkmate or rule end"

    @staticmethod
    def _is_pass(uci: str) -> bool:
        m = re.fullmatch(r"([a-i](?:10|[1-9]))([a-i](?:10|[1-9]))", uci)
        return bool(m) and m.group(1) == m.group(2)

    def board_rows(self) -> list[list[str]]:
        rows = []
        for row in self.fen().split()[0].split("/"):
            cells: list[str] = []
            for n, ch in re.findall(r"(\d+)|(.)", row):
                cells.extend(["."] * int(n) if n else [ch])
            rows.append(cells)
        return rows  # rank 10 first

    def ascii(self) -> str:
        lines = []
        for i, cells in enumerate(self.board_rows()):
            lines.append(f"{10 - i:>2} | " + " ".join(cells))
        lines.append("     " + "-" * 17)
        lines.append("     a b c d e f g h i")
        return "\n".join(lines)

    def material(self) -> float:
        cho = han = 0.0
        for cells in self.board_rows():
            for ch in cells:
                if ch == ".":
                    continue
                v = JANGGI_VALUES.get(ch.lower(), 0)
                if ch.isupper():
                    cho += v
                else:
                    han += v
        han += 1.5
        return cho - han if self.side_to_move == "cho" else han - cho

    def after(self, uci: str) -> JanggiGame:
        return JanggiGame(self.start_fen, self.moves + [uci], self.variant)

    def record(self) -> dict:
        return {"variant": self.variant, "start_fen": self.start_fen, "moves": list(self.moves), "result": self.result(), "termination": self.termination()}


def perft(game: Game, depth: int) -> int:
    """Leaf count at ``depth`` plies (janggi counts passes; a finished game is a leaf-less node)."""
    if depth == 0:
        return 1
    moves = game.legal_moves()
    if depth == 1:
        return len(moves)
    return sum(perft(game.after(m), depth - 1) for m in moves)
