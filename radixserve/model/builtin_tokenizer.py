"""The built-in model's tokenizer: byte-level BPE trained, deterministically and offline, on a small
embedded corpus, with Llama-style special tokens and a chat template (see
:mod:`radixserve.model.builtin`)."""

from __future__ import annotations

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
#: Special tokens, in id order (ids 0..6).
SPECIAL_TOKENS = [BOS, EOS, PAD, SYSTEM, USER, ASSISTANT, END]

#: ``<|role|>content<|end|>`` per message, ``<|assistant|>`` as the generation prompt.
#: No BOS in the template: the tokenizer's post-processor adds ``<|bos|>`` when encoding
#: with ``add_special_tokens=True`` (Llama-style).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_MAX_POSITIONS = 4096  # the tokenizers' model_max_length (the model's max positions)

# A few KB of English about chess, janggi and board games: moves, FEN strings, numbers,
# punctuation. It only shapes which merges the BPE learns; any text at all still
# round-trips because the tokenizer is byte-level.
CORPUS = """\
Chess is a board game for two players, White and Black, played on a square board of
64 squares arranged in an eight-by-eight grid. Each player begins with 16 pieces: one
king, one queen, two rooks, two bishops, two knights and eight pawns. The object of the
game is to checkmate the opponent's king, which means the king is under attack and has
no legal move to escape. White always moves first. A game can also end in a draw by
stalemate, by threefold repetition, by the fifty-move rule, or by agreement.

Moves are written in algebraic notation. In long algebraic or UCI notation a move names
the starting square and the target square: e2e4, e7e5, g1f3, b8c6, f1b5, a7a6, b5a4,
g8f6, e1g1, f8e7, f1e1, b7b5, a4b3, d7d6, c2c3, e8g8, h2h3. A promotion adds the piece
letter, as in e7e8q or a2a1n. In standard algebraic notation (SAN) the same opening is
1. e4 e5 2. Nf3 Nc6 3. Bb5 a6 4. Ba4 Nf6 5. O-O Be7 6. Re1 b5 7. Bb3 d6 8. c3 O-O 9. h3.
Captures use an x (Bxc6, exd5, Nxe4), checks a plus sign (Qh5+), and mate a hash (Qxf7#).
The result is written 1-0, 0-1 or 1/2-1/2.

A position is described by Forsyth-Edwards Notation (FEN). The starting position is
rnbqkbnr/pppppppp/8/8/8/8/PPPPPPPP/RNBQKBNR w KQkq - 0 1
and after 1. e4 it is
rnbqkbnr/pppppppp/8/8/4P3/8/PPPP1PPP/RNBQKBNR b KQkq e3 0 1
and after 1... c5 it is
rnbqkbnr/pp1ppppp/8/2p5/4P3/8/PPPP1PPP/RNBQKBNR w KQkq c6 0 2.
Uppercase letters are White pieces, lowercase letters are Black pieces, digits count
empty squares, and slashes separate the ranks from rank 8 down to rank 1. Then come the
side to move (w or b), castling rights (K, Q, k, q or -), the en passant square, the
halfmove clock and the fullmove number.

Janggi, also called Korean chess, is played on a board of nine files and ten ranks, and
the pieces stand on the intersections of the lines rather than inside the squares. Each
side has a general, two guards, two horses, two elephants, two chariots, two cannons and
five soldiers. The general and the guards must stay inside the palace, a three-by-three
area marked with diagonal lines. The cannon moves along a line but must jump over exactly
one piece, and a cannon may not jump over another cannon or capture one. The elephant
moves one step orthogonally and then two steps diagonally, so it reaches farther than the
horse. The sides are called Cho (blue or green) and Han (red). A player may pass instead
of moving. If no one wins, the game is decided by points: chariot 13, cannon 7, horse 5,
elephant 3, guard 3 and soldier 2, and Han gets 1.5 extra points for moving second.
A janggi position in FEN looks like
rnba1abnr/4k4/1c5c1/p1p1p1p1p/9/9/P1P1P1P1P/1C5C1/4K4/RNBA1ABNR w - - 0 1.

Other board games include go, shogi, xiangqi, checkers, backgammon, reversi and
connect four. Go is played with black and white stones on a 19x19 grid; a group of
stones without liberties is captured. Shogi is Japanese chess on a 9x9 board, where
captured pieces can be dropped back into play. Xiangqi, the Chinese chess, has a river
across the middle of the board and a palace for each general, much like janggi.

An engine searches a game tree with minimax and alpha-beta pruning, evaluating positions
in centipawns: +0.35 means White is a little better, -1.20 means Black is better by more
than a pawn, and #3 means mate in three. At depth 20 it might visit 1,234,567 nodes in
0.85 seconds, about 1.45 million nodes per second. Ratings use the Elo system: a
beginner is around 800, a club player 1500 to 1800, a master 2200, and a grandmaster
2500 or more. Time controls such as 3+2, 15+10 or 90/40+30 give minutes plus seconds
of increment per move.

Q: What is the best first move? A: Many players like 1. e4 or 1. d4; both fight for
the center. Q: How many squares does a bishop control from d4 on an empty board?
A: Thirteen. Q: Can a pawn move backward? A: No, never! Q: Is "en passant" legal here?
A: Only right after the enemy pawn advanced two squares; otherwise it's not.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 32 64 100 128 256 512 1000 1024 2048 4096.
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > / \\ | - _ + = * & % $ # @ ~ ` ^
Dates and times: 2024-03-15, 12:30, 1997 (Deep Blue beat Kasparov), 1851 London.
"""


def _build_raw_tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")

    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=16,
    )
    # Train from a fixed list of lines, single pass, so the result depends only on CORPUS.
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)

    n = tok.get_vocab_size(with_added_tokens=True)
    if n < vocab_size:
        # Ordinary (non-special) added tokens: a random model samples these most of the
        # time, and they should show up as visible text, not vanish under
        # skip_special_tokens=True.
        extra = [AddedToken(f"<|extra_{i}|>", special=False, normalized=False) for i in range(vocab_size - n)]
        tok.add_tokens(extra)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != vocab_size:  # pragma: no cover - defensive
        raise RuntimeError(f"tokenizer vocab is {n}, wanted {vocab_size}")

    bos_id = tok.token_to_id(BOS)
    # Llama-style: encode(..., add_special_tokens=True) prepends <|bos|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def build_tokenizer(vocab_size: int, *, model_max_length: int = _MAX_POSITIONS):
    """Deterministically build a byte-level BPE tokenizer with exactly ``vocab_size`` ids.

    Trained on the embedded :data:`CORPUS`; special tokens (ids 0..6) are
    ``<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>``. If training
    learns fewer merges than needed the vocab is padded with (non-special) added tokens
    ``<|extra_N|>`` so that ``len(tokenizer) == vocab_size`` and every id below it decodes.
    """
    from transformers import PreTrainedTokenizerFast

    raw = _build_raw_tokenizer(vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:  # pragma: no cover - defensive
        raise RuntimeError(f"len(tokenizer) is {len(tokenizer)}, wanted {vocab_size}")
    return tokenizer
