"""A checked completion request, ready to run: one job per prompt and choice."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from radixserve.sampling_params import SamplingParams
from radixserve.serve.openai import responses as R
from radixserve.tools.chat import ToolRequest


@dataclass
class Prepared:
    """A checked completion request, ready to run: one job (index, prompt, SamplingParams) per choice."""

    chat: bool
    model: str
    jobs: list[tuple[int, Any, SamplingParams]]
    n: int
    stream: bool
    include_usage: bool
    namespace: str | None
    headers: dict[str, str]
    return_token_ids: bool = False
    tools: ToolRequest | None = None  # chat with tools: the output is parsed for calls
    max_tokens_param: str = "max_tokens"  # the field that set max_tokens (chat: maybe max_completion_tokens)

    @property
    def route(self) -> str:
        return "chat" if self.chat else "completions"

    def response(self, choices: list, usage: R.Usage | None = None, chunk: bool = False, rid: str | None = None, created: int | None = None) -> R.Response:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return R.Response(
            id=rid or self.new_id(),
            object=obj,
            created=created or int(time.time()),
            model=self.model,
            choices=choices,
            usage=R.UNSET if usage is None else usage,
        )

    def new_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex


def choice_jobs(prompts: list, params: SamplingParams, n: int) -> list[tuple[int, Any, SamplingParams]]:
    """One job per prompt and choice; with a seed, choice i of a prompt uses ``seed + i``, wrapped
    to 0 past the top of a seed's range (2**64 - 1)."""
    jobs = []
    for pi, prompt in enumerate(prompts):
        for i in range(n):
            sp = params
            if n > 1 and params.seed is not None:
                seed = params.seed + i
                sp = msgspec.structs.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)
            jobs.append((pi * n + i, prompt, sp))
    return jobs
