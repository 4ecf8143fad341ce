"""The OpenAI request Structs (radixserve/serve/openai/schema.py) without a server: every bad field
is a 400 naming it, good bodies become the SamplingParams the engine gets."""

from __future__ import annotations

import pytest

from radixserve import protocol as P
from radixserve.errors import BadRequestError, RouterLostError, RouterRefusedError, error_from_code
from radixserve.serve.openai.errors import APIError, api_error_from
from radixserve.serve.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_tools,
    known_fields,
    max_tokens_field,
    parse_request,
    refuse_unsupported,
    sampling_params,
)

LIMITS = P.Limits()


def _params(body: dict, chat: bool = False):
    req = parse_request(body, chat)
    refuse_unsupported(req)
    if isinstance(req, ChatRequest):
        chat_tools(req, None)  # tools are checked against the chat template (None: the fallback's format)
    return sampling_params(req)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": ["x"] * 99}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"user": 5}, "user"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": 1}}, "stream_options"),
        ({"model": 5}, "model"),
        ({"prompt": 5}, "prompt"),
        ({"suffix": "x"}, "suffix"),
        ({"echo": True}, "echo"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        # issue 49 item 13: ranges the request Structs left open were 500s (SamplingParams refused them)
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"temperature": 1000}, "temperature"),
    ],
)
def test_completion_fields_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        _params(body)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, chat, param",
    [
        ({"max_tokens": LIMITS.max_tokens + 1}, False, "max_tokens"),
        ({"max_tokens": LIMITS.max_tokens + 1}, True, "max_tokens"),
        ({"max_completion_tokens": LIMITS.max_tokens + 1, "max_tokens": 5}, True, "max_completion_tokens"),
        ({"stop": ["x" * (LIMITS.max_stop_chars + 1)]}, False, "stop"),
    ],
)
def test_server_limits_are_checked_by_the_router_and_the_400_names_the_field(body, chat, param):
    """Issue 48: max_tokens and the stop strings are checked once, by the router
    (limits.validate_generate), not by the gateway as well; its error, back over the wire, is a
    400 naming the field the body set."""
    body = {"messages": [{"role": "user", "content": "hi"}], **body} if chat else body
    params, _ = _params(body, chat)  # the gateway passes them on ...
    with pytest.raises(BadRequestError) as e:  # ... and the router refuses them
        P.validate_generate(P.Generate(id="x", prompt="hi", params=params), LIMITS)
    wire = error_from_code(e.value.code, str(e.value))  # what the gateway's client raises
    err = api_error_from(wire, "messages" if chat else "prompt", max_tokens_field(parse_request(body, chat)))
    assert err.status == 400 and err.param == param and err.message.startswith(f"{param}: ") and err.code is None
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"tools": [{}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_fields_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        _params(body, chat=True)
    assert e.value.status == 400 and e.value.param == param


def test_good_bodies_become_sampling_params():
    params, n = _params(
        {
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 1,
            "top_k": 0,
            "seed": 7,
            "n": 3,
            "best_of": 3,
            "stop": "END",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "logprobs": 2,
            "presence_penalty": 0.5,
            "guided_choice": ["a", "b"],
            "user": "u",
        }
    )
    assert n == 3
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.0, -1, 7)
    assert params.stop == ["END"] and params.stop_token_ids == [2] and params.ignore_eos and params.logprobs == 2
    assert params.presence_penalty == 0.5 and params.structured.choice == ["a", "b"]
    assert _params({"stop": ["", ""]})[0].stop is None  # empty stop strings are dropped
    assert _params({})[0].max_tokens == 16  # OpenAI's completions default


def test_chat_defaults_logprobs_and_response_format():
    params, n = _params({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert n == 1 and params.max_tokens is None and params.logprobs is None  # None: until the context is full
    params, _ = _params(
        {"max_completion_tokens": 4, "max_tokens": 9, "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"}}, chat=True
    )
    assert params.max_tokens == 4 and params.logprobs == 3 and params.structured.json_object
    assert _params({"logprobs": True}, chat=True)[0].logprobs == 0
    assert _params({"response_format": {"type": "text"}, "tool_choice": "none"}, chat=True)[0].structured is None


def test_messages_parts_and_unknown_fields():
    req = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}], "name": "x"}], "frobnicate": 1}, chat=True)
    assert isinstance(req, ChatRequest) and req.messages[0].content[0].text == "a"
    assert "frobnicate" not in known_fields(True) and "messages" in known_fields(True)
    assert "prompt" in known_fields(False) and "messages" not in known_fields(False)
    assert isinstance(parse_request({"prompt": [1, 2]}, chat=False), CompletionRequest)


def test_per_choice_seeds_stay_in_the_seed_range():
    """Issue 49 item 13: seed 2**64 - 1 with n 2 gave choice 1 the seed 2**64, which no frame can
    carry (a 500). Choice i's seed is seed + i, wrapped to 0 past 2**64 - 1."""
    from radixserve.serve.openai.app import _jobs

    params, n = _params({"seed": 2**64 - 1, "n": 3})
    jobs = _jobs(["hi"], params, n)
    assert [sp.seed for _, _, sp in jobs] == [2**64 - 1, 0, 1]
    for _, prompt, sp in jobs:
        P.encode(P.Generate(id="x", prompt=prompt, params=sp))
    assert [sp.seed for _, _, sp in _jobs(["hi"], _params({"seed": -3, "n": 2})[0], 2)] == [-3, -2]


@pytest.mark.parametrize("exc, code", [(RouterLostError("gone"), "router_lost"), (RouterRefusedError("at its client cap"), "router_refused")])
def test_a_lost_or_refused_router_is_a_503_with_retry_after(exc, code):
    """The gateway's own connection to the router failing is the service being unavailable (503,
    retry later), not a server bug (500)."""
    err = api_error_from(exc)
    assert (err.status, err.code, err.type) == (503, code, "server_error") and err.headers["Retry-After"] == "5"
