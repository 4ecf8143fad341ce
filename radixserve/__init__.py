"""radixserve: serve many LLM agents that share long prompts."""

from radixserve.engine.engine import Engine
from radixserve.engine.request import RequestOutput, StreamChunk, TokenLogprob
from radixserve.errors import BadRequestError, ModelLoadError, RadixServeError, TooLongError
from radixserve.sampling_params import SamplingParams

__all__ = [
    "Engine", "SamplingParams", "RequestOutput", "StreamChunk", "TokenLogprob",
    "RadixServeError", "BadRequestError", "TooLongError", "ModelLoadError",
]
__version__ = "0.1.0"
