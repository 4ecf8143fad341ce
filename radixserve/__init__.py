"""radixserve: serve many LLM agents that share long prompts."""

from radixserve.errors import BadRequestError, ModelLoadError, RadixServeError, TooLongError
from radixserve.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "StreamChunk",
    "TokenLogprob",
    "RadixServeError",
    "BadRequestError",
    "TooLongError",
    "ModelLoadError",
    "ChoiceResult",
]
__version__ = "0.1.0"

_LAZY = {
    "Engine": "radixserve.engine.engine",
    "RequestOutput": "radixserve.engine.request",
    "StreamChunk": "radixserve.engine.request",
    "TokenLogprob": "radixserve.protocol",
    "ChoiceResult": "radixserve.engine.choice",
}


def __getattr__(name: str):
    """Import the engine (torch) only when used: the SDK (radixserve.client) stays light."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
