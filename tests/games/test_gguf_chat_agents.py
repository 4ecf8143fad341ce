"""The game agents' chat-template prompts (what they send on a real instruct model), with a fake client."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from examples.chess_janggi.agents import LLMAgent, chat_renderer, move_messages
from examples.chess_janggi.rules import ChessGame


def _render(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


class FakeClient:
    def __init__(self, answers):
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.choices = None

    async def generate(self, prompt, **_):
        self.prompts.append(prompt)
        return SimpleNamespace(
            text=self.answers.pop(0), token_ids=[1], timings=SimpleNamespace(ttft_s=0.01), usage=SimpleNamespace(prompt_tokens=10, cached_tokens=5)
        )

    async def choose(self, prompt, choices, **_):
        self.prompts.append(prompt)
        self.choices = list(choices)
        return SimpleNamespace(index=choices.index("d2d4"), timings=SimpleNamespace(ttft_s=0.01), usage=SimpleNamespace(query_tokens=10, cached_tokens=5))


def test_generate_mode_with_chat_template_parses_and_reprompts_as_a_conversation():
    client = FakeClient(["The board has eight files.", "I play e2e4."])
    agent = LLMAgent(client, mode="generate", render=_render)
    move = asyncio.run(agent.select(ChessGame()))
    assert move == "e2e4" and agent.stats.illegal_attempts == 1 and agent.stats.fallbacks == 0
    first, second = client.prompts
    assert first == _render(move_messages(ChessGame()))
    assert first.startswith("<system>You are a chess") and "<assistant>e2e4</assistant>" in first  # worked example
    assert second.startswith(first.removesuffix("<assistant>"))  # the same conversation, continued
    assert "<assistant>The board has eight files.</assistant><user>That answer was rejected: no move" in second


def test_choose_mode_with_chat_template_scores_bare_moves():
    client = FakeClient([])
    agent = LLMAgent(client, mode="choose", render=_render)
    game = ChessGame()
    assert asyncio.run(agent.select(game)) == "d2d4"
    assert client.choices == game.legal_moves()  # no leading space after the assistant header


def test_chat_renderer_uses_the_tokenizers_template():
    assert chat_renderer(None) is None
    assert chat_renderer(SimpleNamespace(chat_template=None)) is None

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert tokenize is False and add_generation_prompt is True
            return _render(messages)

    assert chat_renderer(Tok())(move_messages(ChessGame())).endswith("Your move:</user><assistant>")
