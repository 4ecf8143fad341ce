"""Tool calling without a server: checked tools (400s naming the field), the call format chosen from
the chat template, rendering history through the template (native and fallback), parsing whole and
streamed (equal by construction, checked at random cut points), the grammar of each format, and an
engine on a tiny random model whose calls, under the grammar, all parse and validate."""

from __future__ import annotations

import json
import random
import zlib

import pytest

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")

from radixserve import Engine, SamplingParams  # noqa: E402
from radixserve.sampling_params import StructuredOutput  # noqa: E402
from radixserve.serve.openai.app import Gateway  # noqa: E402
from radixserve.serve.openai.errors import APIError  # noqa: E402
from radixserve.serve.openai.prompts import chat_messages  # noqa: E402
from radixserve.serve.openai.schema import chat_tools, parse_request, sampling_params  # noqa: E402
from radixserve.tools import FORMATS, MAX_TOOLS, MAX_TOOLS_CHARS, CallStream, detect_format, parse_calls  # noqa: E402
from radixserve.tools.chat import FALLBACK_PROMPT, render_chat, tool_request  # noqa: E402
from radixserve.tools.spec import ToolCallsSpec, ToolSchema  # noqa: E402

from conftest import random_prompts  # noqa: E402
from tool_schemas import random_tools  # noqa: E402

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MOVE = {
    "type": "function",
    "function": {
        "name": "make_move",
        "parameters": {"type": "object", "properties": {"move": {"type": "string", "enum": ["e2e4", "d2d4"]}}, "required": ["move"]},
    },
}
USER = {"role": "user", "content": "weather in Paris?"}

QWEN_LIKE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _chat(body: dict, template: str | None = PLAIN):
    req = parse_request({"messages": [USER], **body}, chat=True)
    return req, chat_tools(req, template)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "make_move"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER] + [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * MAX_TOOLS_CHARS}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        ({"functions": [WEATHER["function"]], "function_call": {"name": "nope"}}, "function_call"),
    ],
)
def test_bad_tools_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        _chat(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param)


def test_tools_with_another_grammar_need_tool_choice_none():
    req, tools = _chat({"tools": [WEATHER], "response_format": {"type": "json_object"}})
    params, _ = sampling_params(req)
    with pytest.raises(APIError) as e:
        Gateway._with_tool_grammar(req, params, tools)
    assert e.value.param == "response_format"
    req, tools = _chat({"tools": [WEATHER], "tool_choice": "none", "response_format": {"type": "json_object"}})
    assert Gateway._with_tool_grammar(req, sampling_params(req)[0], tools).structured.json_object
    req, tools = _chat({"tools": [WEATHER, MOVE], "tool_choice": {"type": "function", "function": {"name": "make_move"}}, "parallel_tool_calls": False})
    spec = Gateway._with_tool_grammar(req, sampling_params(req)[0], tools).structured.tool_calls
    assert (spec.format, [t.name for t in spec.tools], spec.mode, spec.parallel) == ("hermes", ["make_move"], "required", False)
    _, legacy = _chat({"functions": [MOVE["function"]], "function_call": {"name": "make_move"}})
    assert legacy.choice.name == "make_move" and legacy.choice.mode == "required"


class _Tok:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        from transformers.utils.chat_template_utils import render_jinja_template

        return render_jinja_template([messages], chat_template=self.chat_template, add_generation_prompt=True, **kw)[0][0]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize(
    "messages, param",
    [
        ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages[1].tool_call_id"),
        ([USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}], "messages[2].tool_call_id"),
        (
            [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([USER, {"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[1].tool_calls[0]"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls"),
    ],
)
def test_tool_messages_need_a_matching_call(messages, param):
    req = parse_request({"messages": messages, "tools": [WEATHER]}, chat=True)
    with pytest.raises(APIError) as e:
        chat_messages(req, _Tok(PLAIN), chat_tools(req, PLAIN))
    assert e.value.status == 400 and e.value.param == param, e.value.message


# ------------------------------------------------------------------------------- formats and rendering
def test_call_format_comes_from_the_chat_template():
    assert detect_format(PLAIN).name == "hermes"  # no tools in the template: the fallback prompt's format
    assert detect_format(QWEN_LIKE).name == "hermes"
    assert detect_format("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] [").name == "mistral"
    assert detect_format('{% if tools %}Respond as {"name": fn, "parameters": {...}}{% endif %}').name == "llama3"
    with pytest.raises(Exception) as e:
        detect_format("{% for t in tools %}<function={{ t.name }}>{% endfor %}")
    assert e.value.field == "tools" and all(f in e.value.message for f in ("hermes", "llama3", "mistral"))


def test_history_renders_natively_and_through_the_fallback():
    history = [
        {"role": "system", "content": "Be brief."},
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text, req = render_chat(_Tok(PLAIN), history, [WEATHER])
    assert req is not None and not req.native and req.fmt.name == "hermes"
    prompt = FALLBACK_PROMPT.format(tools=json.dumps(WEATHER))
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>\n")
    # the call as the grammar writes it (the arguments text as sent), the result as a user message
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    ) in text
    text, req = render_chat(_Tok(QWEN_LIKE), history, [WEATHER])
    assert req is not None and req.native
    assert text.startswith("<|im_start|>system\n<tools>" + json.dumps(WEATHER))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    text, req = render_chat(_Tok(PLAIN), [USER])
    assert req is None and text == "<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------- parsing
def _reassemble(fmt, text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, str]]]:
    stream = CallStream(fmt)
    content, calls = "", {}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for delta, tcs in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += delta or ""
        for tc in tcs:
            c = calls.setdefault(tc["index"], {"name": "", "arguments": "", "ids": []})
            c["ids"] += [tc["id"]] if "id" in tc else []
            c["name"] += tc["function"].get("name", "")
            c["arguments"] += tc["function"]["arguments"]
    assert all(len(c["ids"]) == 1 for c in calls.values())  # the id comes once, with the name
    return content or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streamed_calls_reassemble_to_the_whole_parse(name):
    fmt, rng = FORMATS[name], random.Random(3)
    two = fmt.calls_text([("make_move", '{"move": "e2e4"}'), ("get_weather", '{"city": "Pa}ris", "x": {"y": [1, 2]}}')])
    cases = {
        "calls only": two,
        "text then calls": "Let me check. " + two,
        "text only": "No calls, just text.",
        "a call cut off": "Hm. " + two[: two.index("e2e4") + 2],
    }
    for what, text in cases.items():
        content, calls = parse_calls(fmt, text)
        whole = (content, [(c.name, c.arguments) for c in calls])
        if what == "calls only":
            assert whole == (None, [("make_move", '{"move": "e2e4"}'), ("get_weather", '{"city": "Pa}ris", "x": {"y": [1, 2]}}')])
        if what == "text then calls":
            assert content.strip() == "Let me check." and len(calls) == 2
        if what == "text only":
            assert whole == (text, [])
        if what == "a call cut off":  # ended otherwise (a stop string): not a call, its text stays content;
            assert whole == (text, [])  # at max_tokens (cut_off), a call with its arguments so far, as streamed
            content, calls = parse_calls(fmt, text, cut_off=True)
            whole = (content, [(c.name, c.arguments) for c in calls])
            assert whole == ("Hm. ", [("make_move", '{"move": "e2')])
        for _ in range(20):
            assert _reassemble(fmt, text, rng) == whole, (what, text)
    # keys in another order: a call still, its arguments re-serialized
    content, calls = parse_calls(FORMATS["hermes"], '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert (
        calls[0].id.startswith("call_")
        and len(parse_calls(FORMATS["mistral"], two if name == "mistral" else FORMATS["mistral"].calls_text([("f", "{}")]))[1][0].id) == 9
    )


# ------------------------------------------------------------------------------------------- grammar
@pytest.fixture(scope="module")
def engine(llama_dir):
    e = Engine(llama_dir, kv_cache_tokens=16384, max_running=64)
    yield e
    e.shutdown()


TWO = [ToolSchema("make_move", MOVE["function"]["parameters"]), ToolSchema("get_weather", WEATHER["function"]["parameters"])]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_admits_the_format_and_nothing_else(engine, name):
    fmt = FORMATS[name]
    one = fmt.calls_text([("make_move", '{"move": "e2e4"}')])
    both = fmt.calls_text([("make_move", '{"move": "e2e4"}'), ("get_weather", '{"city": "Paris"}')])
    texts = {
        "one": one,
        "both": both,
        "text": "Hello there",
        "text+call": "Sure. " + one,
        "bad enum": one.replace("e2e4", "e2e5"),
        "unknown tool": one.replace("make_move", "make_mov"),
        "extra key": one.replace('"e2e4"}', '"e2e4", "x": 1}'),
    }
    expect = {
        ("required", True): {"one", "both"},
        ("required", False): {"one"},
        ("auto", True): {"one", "both", "text", "text+call"},
        ("auto", False): {"one", "text", "text+call"},
        ("none", True): {"text"},
    }
    eos = engine.grammars._stop[0]
    for (mode, parallel), ok in expect.items():
        spec = StructuredOutput(tool_calls=ToolCallsSpec(format=name, tools=TWO, mode=mode, parallel=parallel))
        spec.validate()
        got = set()
        for what, text in texts.items():
            m = engine.grammars.matcher(spec)
            if m.accept_string(text) and m.accept_token(eos) and m.is_terminated():
                got.add(what)
        assert got == ok, (mode, parallel)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_engine_calls_under_the_grammar_parse_and_validate(engine, name):
    """Random weights, random schemas: with ``required`` every output is one or more calls whose
    arguments validate; ``auto`` may write text, but every call it opens validates; ``none`` never
    opens one."""
    rng, fmt = random.Random(zlib.crc32(name.encode())), FORMATS[name]  # (not hash(): it differs from run to run)
    jobs = []
    for i, prompt in enumerate(random_prompts([rng.randint(3, 30) for _ in range(24)], seed=5)):
        tools = tool_request(None, random_tools(rng), ["required", "auto", "none"][i % 3], parallel_tool_calls=i % 2 == 0)
        spec = ToolCallsSpec(
            format=name, tools=tool_request(None, [t.as_openai() for t in tools.tools]).spec.tools, mode=tools.choice.mode, parallel=tools.parallel
        )
        jobs.append((prompt, tools, spec))
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i, structured=StructuredOutput(tool_calls=spec)) for i, (_, _, spec) in enumerate(jobs)]
    outs = engine.generate([p for p, _, _ in jobs], params)
    finished = 0
    for (_, _, spec), out in zip(jobs, outs):
        content, calls = parse_calls(fmt, out.text)
        schemas = {t.name: t.parameters for t in spec.tools}
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        if spec.mode == "none":
            assert fmt.trigger not in out.text and not calls
        elif spec.mode == "required" and out.finish_reason == "stop":
            finished += 1
            assert calls and (content is None) and (spec.parallel or len(calls) == 1), out.text
    assert finished >= 4  # most required outputs end by themselves (the rest hit max_tokens)
