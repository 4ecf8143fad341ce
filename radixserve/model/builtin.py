"""Built-in stand-in model: a small random-weight Llama plus a locally built tokenizer.

radixserve must run with no model downloaded. On first use :func:`default_model_path`
deterministically builds a small Llama-architecture model with random weights and a
byte-level BPE tokenizer trained on a tiny corpus embedded below, saves it in ordinary
Hugging Face format (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a chat template, ``generation_config.json``) under a cache
directory, and returns that directory. The engine then loads it through the same path
as any real checkpoint (AutoConfig / AutoTokenizer / safetensors).

The model produces no meaningful text; it exists so that the whole serving stack
(tokenizer, chat template, prefix cache, paged KV, sampling, stop tokens) can be run
and tested anywhere, offline.

Nothing here touches the network: tokenizers are built from in-memory objects and
models from configs.

:func:`radixserve.testing.make_tiny_model_dir` builds tiny random checkpoints of each
supported architecture for tests (also importable from here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("radixserve")

__all__ = [
    "BUILTIN_VERSION",
    "BUILTIN_VOCAB_SIZE",
    "BUILTIN_SEED",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "builtin_config",
    "save_model_dir",
    "default_cache_dir",
    "default_model_path",
]

#: Bump when anything that changes the produced files changes (corpus, config, init).
BUILTIN_VERSION = "builtin-llama-v1"
BUILTIN_VOCAB_SIZE = 4096
BUILTIN_SEED = 0

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

_MAX_POSITIONS = 4096

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


# --------------------------------------------------------------------------------------
# small compatibility helpers (transformers 4.45 .. 5.x)
# --------------------------------------------------------------------------------------


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def dtype_kwargs(dtype: Any) -> dict[str, Any]:
    """``dtype=`` on transformers 5, ``torch_dtype=`` on 4.x (configs and from_config)."""
    return {"dtype": dtype} if _transformers_major() >= 5 else {"torch_dtype": dtype}


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------


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
        extra = [
            AddedToken(f"<|extra_{i}|>", special=False, normalized=False)
            for i in range(vocab_size - n)
        ]
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


# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------


def builtin_config(vocab_size: int = BUILTIN_VOCAB_SIZE, *, bos_token_id: int = 0, eos_token_id: int = 1,
                   pad_token_id: int | None = 2, **overrides):
    """LlamaConfig of the built-in stand-in model (~4.3M parameters, fp32).

    hidden 256, 4 layers, 4 heads / 2 KV heads (head_dim 64), intermediate 704, 4096
    positions, rope_theta 10000, tied embeddings. ``overrides`` replace any field.
    """
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=_MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        architectures=["LlamaForCausalLM"],
        **dtype_kwargs("float32"),
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------


def _reinit_weights(model, seed: int) -> None:
    """Re-initialise every parameter from one seeded generator, in name order.

    Matrices (and embeddings): N(0, 0.02); norm weights: 1; biases: 0. Independent of
    how a given transformers version initialises modules, so the bytes depend only on
    the config, the seed and torch's CPU normal_ kernel.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                p.zero_()
            elif p.ndim == 1:  # RMSNorm weights (input/post-attn/final norm, q/k norm)
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(p.dtype))


def _config_dtype(config):
    """The dtype a config declares (``dtype`` on v5, ``torch_dtype`` on v4), fp32 if none."""
    import torch

    dt = getattr(config, "dtype", None) if _transformers_major() >= 5 else None
    dt = dt or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dt, str):
        dt = getattr(torch, dt)
    return dt


@contextlib.contextmanager
def _quiet_progress_bars():
    """Hide transformers' "Writing model shards" bar while saving, then restore."""
    try:
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
    except Exception:  # pragma: no cover - very old/new transformers
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _add_legacy_rope_keys(path: Path) -> None:
    """transformers 5 writes only ``rope_parameters``; also write ``rope_theta`` and
    ``rope_scaling`` so transformers 4.x and hand-written loaders read the same RoPE.
    transformers 5 reads the file back identically."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.get("rope_parameters")
    if not isinstance(rp, dict) or "rope_theta" not in rp:
        return
    cfg.setdefault("rope_theta", rp["rope_theta"])
    if rp.get("rope_type", "default") != "default" and "rope_scaling" not in cfg:
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(path: Path, tokenizer) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4.x as well as 5.x.

    transformers 5 saves the chat template only as ``chat_template.jinja`` and names the
    class ``TokenizersBackend`` (unknown to 4.x). Also put the template in
    ``tokenizer_config.json`` and name the class ``PreTrainedTokenizerFast`` (an alias of
    ``TokenizersBackend`` in 5.x). Record that there is no unk token."""
    template = getattr(tokenizer, "chat_template", None)
    tc_path = path / "tokenizer_config.json"
    if not tc_path.is_file():
        return
    tc = json.loads(tc_path.read_text())
    if template:
        tc["chat_template"] = template
    if tc.get("tokenizer_class") in (None, "TokenizersBackend"):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if getattr(tokenizer, "unk_token", None) is None:
        # Explicitly none. transformers 5 loads model_type "qwen2" dirs with Qwen2Tokenizer
        # whatever tokenizer_class says, and that class would otherwise add an
        # "<|endoftext|>" unk token at id vocab_size, one past the model's vocab.
        tc["unk_token"] = None
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_model_dir(path: str | os.PathLike, config, *, seed: int, tokenizer=None,
                   generation_config: dict[str, Any] | None = None) -> Path:
    """Create a random-weight model from ``config`` and save it (and ``tokenizer``) at ``path``.

    Deterministic for a fixed torch version: weights come from ``seed`` alone (see
    :func:`_reinit_weights`). The directory is built next to the target and renamed into
    place, so concurrent callers never observe a half-written directory. If ``path``
    already holds a ``config.json`` it is returned untouched.

    ``generation_config``: extra fields for ``generation_config.json`` (e.g. a list of
    ``eos_token_id``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if _is_model_dir(path):
        return path
    save_dtype = _config_dtype(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
        model = model.to(torch.float32)
        _reinit_weights(model, seed)
        if save_dtype != torch.float32:
            model = model.to(save_dtype)
        if generation_config:
            for k, v in generation_config.items():
                setattr(model.generation_config, k, v)
        save_kwargs: dict[str, Any] = {}
        if _transformers_major() < 5:
            save_kwargs["safe_serialization"] = True  # v5: always safetensors, kwarg ignored
        with _quiet_progress_bars():
            model.save_pretrained(tmp, **save_kwargs)
        _add_legacy_rope_keys(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _patch_tokenizer_config(tmp, tokenizer)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, path)
        except OSError:
            if _is_model_dir(path):  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return path
            # A stale non-model directory sits at the target: move it aside, retry once.
            stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
            os.rename(path, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_model_dir(path):
            return path
        raise
    return path


# --------------------------------------------------------------------------------------
# the default (built-in) model
# --------------------------------------------------------------------------------------


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$RADIXSERVE_CACHE``, else ``~/.cache/radixserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RADIXSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "radixserve"


def build_builtin_model_dir(path: str | os.PathLike, vocab_size: int = BUILTIN_VOCAB_SIZE,
                            config=None, *, seed: int = BUILTIN_SEED) -> Path:
    """Build (if absent) a stand-in model with :func:`build_tokenizer` at ``path``.

    ``config`` defaults to :func:`builtin_config`; its vocab/special ids are taken from
    the tokenizer.
    """
    path = Path(path)
    if _is_model_dir(path):
        return path
    tokenizer = build_tokenizer(vocab_size, model_max_length=(
        config.max_position_embeddings if config is not None else _MAX_POSITIONS))
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if config is None:
        config = builtin_config(vocab_size, **ids)
    else:
        config.vocab_size = vocab_size
        for k, v in ids.items():
            setattr(config, k, v)
    end_id = tokenizer.convert_tokens_to_ids(END)
    gen = {**ids, "eos_token_id": [ids["eos_token_id"], end_id]}
    return save_model_dir(path, config, seed=seed, tokenizer=tokenizer, generation_config=gen)


def default_model_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the built-in stand-in model, creating it on first use (~1 s)."""
    path = default_cache_dir(cache_dir) / BUILTIN_VERSION
    if _is_model_dir(path):
        return path
    logger.info("creating the built-in stand-in model (random weights, no meaningful output) at %s", path)
    t0 = time.perf_counter()
    build_builtin_model_dir(path, BUILTIN_VOCAB_SIZE, seed=BUILTIN_SEED)
    logger.info("built-in stand-in model ready in %.1fs", time.perf_counter() - t0)
    return path
