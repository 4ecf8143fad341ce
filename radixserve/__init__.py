"""radixserve: serve many LLM agents that share long prompts."""

import os as _os

# OpenMP threads that spin at barriers collapse when the cores are shared with other work: on
# this project's 2-core machine under load, a 2-thread fleet run took 39-45 s spinning vs 10-13 s
# with passive waits (python -m bench peers --engines radixserve --workloads fleet --agents 16
# --turns 2). libgomp reads this once, when torch loads, so it only applies if radixserve is
# imported first; a value the user set wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixserve.errors import BadRequestError, ModelLoadError, RadixServeError, TooLongError
from radixserve.sampling_params import SamplingParams

__all__ = [
    "Engine", "SamplingParams", "RequestOutput", "StreamChunk", "TokenLogprob",
    "RadixServeError", "BadRequestError", "TooLongError", "ModelLoadError", "ChoiceResult",
]
__version__ = "0.1.0"

_LAZY = {"Engine": "radixserve.engine.engine", "RequestOutput": "radixserve.engine.request",
         "StreamChunk": "radixserve.engine.request", "TokenLogprob": "radixserve.protocol",
         "ChoiceResult": "radixserve.engine.choice"}


def __getattr__(name: str):
    """Import the engine (torch) only when used: the SDK (radixserve.client) stays light."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
