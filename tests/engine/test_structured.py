"""Structured output (xgrammar token masks): JSON schema, any JSON, regex and choices on tiny random
models (with a mask even random weights must produce valid output), greedy under a mask against an
independent oracle (transformers logits masked by brute force), validation, the wire, the OpenAI
gateway end to end, and chess/janggi moves constrained to the legal ones."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from radixserve import Engine, SamplingParams  # noqa: E402
from radixserve import protocol as P  # noqa: E402
from radixserve.engine.structured import StructuredOutput  # noqa: E402
from radixserve.errors import BadRequestError  # noqa: E402

from conftest import random_prompts  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "move": {"type": "string", "enum": ["e2e4", "d2d4", "g1f3"]},
        "confident": {"type": "boolean"},
        "eval": {"type": "integer", "minimum": -99, "maximum": 99},
        "why": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["open", "attack", "safe"]}, "maxItems": 3},
    },
    "required": ["move", "confident", "eval", "why", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(llama_dir):
    e = Engine(llama_dir, kv_cache_tokens=16384, max_running=64, debug_checks=True)
    yield e
    e.shutdown()


def _sampled(n: int, structured, max_tokens: int = 200, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured, **kw) for i in range(n)]


def test_every_json_schema_output_parses_and_validates(engine):
    prompts = random_prompts([5, 17, 40, 3] * 6, seed=1)
    params = _sampled(len(prompts), StructuredOutput(json_schema=SCHEMA), max_tokens=300)
    params[0] = SamplingParams(max_tokens=300, temperature=0.0, structured=StructuredOutput(json_schema=SCHEMA))
    outs = engine.generate(prompts, params)
    texts = set()
    for out in outs:
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        texts.add(out.text)
    assert len(texts) > 5  # sampling under the mask still varies (the test is not one fixed string)
    # compiled once, matched many times
    assert engine.grammars.compile(StructuredOutput(json_schema=SCHEMA)) is engine.grammars.compile(StructuredOutput(json_schema=dict(SCHEMA)))


def test_json_object_regex_and_choice(engine):
    prompts = random_prompts([9, 30] * 8, seed=2)
    # Any JSON object: a random model may write one endless string, so only the finished ones
    # must parse (many finish); a schema with bounded strings (above) always finishes.
    outs = engine.generate(prompts, _sampled(len(prompts), {"json_object": True}, max_tokens=100))
    finished = [out for out in outs if out.finish_reason == "stop"]
    assert len(finished) >= 4
    for out in finished:
        assert isinstance(json.loads(out.text), dict), out.text
    regex = r"(white|black) (plays|resigns) [a-h][1-8][a-h][1-8]"
    for out in engine.generate(prompts, _sampled(len(prompts), StructuredOutput(regex=regex))):
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    choices = ["knight to f3", "e2e4", "resign", "ab", "abc"]
    seen = set()
    for out in engine.generate(prompts, _sampled(len(prompts), StructuredOutput(choice=choices))):
        assert out.finish_reason == "stop" and out.text in choices, out.text
        seen.add(out.text)
    assert len(seen) > 1


def test_mixed_batch_leaves_unconstrained_rows_alone(engine):
    """A structured request in a batch does not change its batch-mates' greedy tokens."""
    prompts = random_prompts([12, 20, 7], seed=3)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate(prompts, plain)
    mixed = engine.generate(
        prompts + prompts[:1], [plain] * 3 + [SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(regex="[xyz]{3}"))]
    )
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert re.fullmatch("[xyz]{3}", mixed[3].text)


def _allowed(tokenizer, text: str, choices: list[str], vocab: int, eos: set[int]) -> torch.Tensor:
    """Brute force, no xgrammar: tokens whose text keeps ``text`` a prefix of some choice, plus EOS
    once ``text`` is a whole choice."""
    ok = torch.zeros(vocab, dtype=torch.bool)
    for t in range(vocab):
        piece = tokenizer.decode([t])
        if t in eos:
            ok[t] = text in choices
        elif piece and any(c.startswith(text + piece) for c in choices):
            ok[t] = True
    return ok


def test_greedy_with_mask_equals_greedy_of_independently_masked_logits(engine, llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    tok = engine.tokenizer
    eos = set(engine.loaded.eos_token_ids)
    vocab = engine.vocab_size
    choices = ["knight to f3", "knight takes", "e2e4", "ab", "abc", "castle"]
    prompts = random_prompts([6, 25, 13, 40], seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, structured=StructuredOutput(choice=choices))
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts + prompts[:2], [params] * len(prompts) + [plain] * 2)  # mixed batch
    for prompt, out in zip(prompts, outs):
        ids, text, expect = list(prompt), "", []
        with torch.no_grad():
            for _ in range(30):
                logits = model(torch.tensor([ids])).logits[0, -1, :vocab]
                mask = _allowed(tok, text, choices, vocab, eos)
                t = int(logits.masked_fill(~mask, float("-inf")).argmax())
                expect.append(t)
                ids.append(t)
                if t in eos:
                    break
                text += tok.decode([t])
        assert out.token_ids == expect, (out.text, tok.decode(expect))
        assert out.text in choices and out.finish_reason == "stop"


def test_apply_grammar_masks_matches_the_bitmask(engine):
    """The sampler step masks exactly the tokens xgrammar's bitmask forbids, in the right rows."""
    from radixserve.engine.request import Request
    from radixserve.engine.sampler import apply_grammar_masks

    spec = StructuredOutput(choice=["e2e4", "d2d4"])
    reqs = [Request(rid=str(i), prompt_ids=[7], params=SamplingParams()) for i in range(3)]
    reqs[1].decode.grammar = engine.grammars.matcher(spec)
    logits = torch.randn(3, engine.vocab_size)
    masked = apply_grammar_masks(logits.clone(), reqs)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    allowed = torch.isfinite(masked[1])
    expect = {
        t
        for t in range(engine.vocab_size)
        if t not in engine.loaded.eos_token_ids and any(c.startswith(engine.tokenizer.decode([t])) for c in ("e2e4", "d2d4"))
    }
    assert set(allowed.nonzero()[:, 0].tolist()) == expect
    assert torch.equal(masked[1][allowed], logits[1][allowed])


def test_structured_survives_preemption(llama_dir):
    with Engine(llama_dir, kv_cache_tokens=160, max_running=16, debug_checks=True) as e:
        prompts = random_prompts([30] * 8, seed=5)
        outs = e.generate(prompts, _sampled(8, StructuredOutput(json_schema=SCHEMA), max_tokens=120))
        assert e.stats()["preemptions"] > 0
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_validation_errors_name_the_field(engine):
    cases = [
        (dict(), "structured"),
        (dict(regex="a", choice=["a"]), "structured"),
        (dict(choice=[]), "structured.choice"),
        (dict(choice=["x" * 300]), "structured.choice"),
        (dict(regex="(unclosed"), "structured.regex"),
        (dict(json_schema={"type": "no-such-type"}), "structured.json_schema"),
        (dict(json_schema="{not json"), "structured.json_schema"),
    ]
    for kw, field in cases:
        with pytest.raises(BadRequestError) as e:
            engine.make_request([7, 8, 9], SamplingParams(structured=StructuredOutput(**kw)))
        assert e.value.field == field, (kw, e.value)
    with pytest.raises(BadRequestError) as e:
        SamplingParams(structured={"choise": ["a"]})
    assert e.value.field == "structured"
    assert engine.generate([7, 8, 9], SamplingParams(max_tokens=8, structured={"choice": ["ok"]}))[0].text == "ok"


def test_structured_params_cross_the_wire():
    spec = StructuredOutput(json_schema=SCHEMA)
    msg = P.Generate(id="r1", prompt="hi", params=SamplingParams(structured=spec))
    back = P.decode(P.encode(msg))
    assert back.params.structured == spec and back.params.structured.json_schema == SCHEMA
    P.validate_generate(back)
    bad = P.Generate(id="r2", prompt="hi", params=SamplingParams(structured=StructuredOutput(choice=["a"] * 5000)))
    with pytest.raises(BadRequestError):
        P.validate_generate(P.decode(P.encode(bad)))


# --------------------------------------------------------------------------- chess / janggi
class _Position:
    """A snapshot of a game: what legal_move_constraint and the check need."""

    def __init__(self, game):
        self.kind, self.fen, self.legal = game.kind, game.fen(), game.legal_moves()

    def legal_moves(self) -> list[str]:
        return self.legal


def _positions(n: int, seed: int, plies: int = 60) -> list[_Position]:
    """Every position along random games (chess and janggi in turn) until there are ``n``."""
    from examples.chess_janggi.rules import ChessGame, JanggiGame

    rng = random.Random(seed)
    out: list[_Position] = []
    while len(out) < n:
        game = ChessGame() if len(out) // plies % 2 == 0 else JanggiGame()
        for _ in range(plies):
            if len(out) == n or game.is_over():
                break
            pos = _Position(game)
            out.append(pos)
            game.push(rng.choice(pos.legal))
    return out


def test_constrained_moves_are_legal_1000_positions(llama_dir):
    """1,000 positions (half chess, half janggi), a random-weight model sampling at T=1 under a
    choice grammar over each position's legal moves: 0 illegal."""
    from examples.chess_janggi.agents import legal_move_constraint

    games = _positions(1000, seed=11)
    assert {g.kind for g in games} == {"chess", "janggi"}
    with Engine(llama_dir, kv_cache_tokens=65536, max_running=128, max_batched_tokens=8192) as e:
        prompts = [f"{g.kind}, your move:" for g in games]  # the mask, not the prompt, makes moves legal
        params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, structured=legal_move_constraint(g)) for i, g in enumerate(games)]
        outs = e.generate(prompts, params)
    illegal = [(g.fen, o.text) for g, o in zip(games, outs) if o.text.strip() not in g.legal_moves()]
    assert illegal == [] and all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 100  # many different moves were played


def test_llm_agent_constrained_mode_plays_legal_moves():
    from examples.chess_janggi.agents import LLMAgent
    from examples.chess_janggi.rules import ChessGame, JanggiGame
    from radixserve.model.builtin import default_model_path

    class Client:
        def __init__(self, engine):
            self.engine = engine
            self.lock = threading.Lock()

        async def generate(self, prompt, *, namespace=None, **sampling):
            def run():
                with self.lock:
                    return self.engine.generate(prompt, SamplingParams(**sampling))[0]

            out = await asyncio.to_thread(run)

            class Reply:
                text, token_ids = out.text, out.token_ids
                usage = P.Usage(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens, completion_tokens=len(out.token_ids))
                timings = P.Timings(queue_s=out.queue_s, ttft_s=out.ttft_s, e2e_s=out.e2e_s)

            return Reply

    with Engine(str(default_model_path()), kv_cache_tokens=32768) as e:
        client = Client(e)

        async def play():
            stats = []
            for game in (ChessGame(), JanggiGame()):
                agent = LLMAgent(client, mode="constrained", seed=5, temperature=1.0)
                for _ in range(4):
                    move = await agent.select(game)
                    game.push_checked(move)  # raises on an illegal move
                stats.append(agent.stats)
            return stats

        for s in asyncio.run(play()):
            assert s.llm_moves == 4 and s.calls == 4 and s.illegal_attempts == 0 and s.fallbacks == 0


# --------------------------------------------------------------------------- server: SDK and OpenAI HTTP
@pytest.fixture(scope="module")
def http_server(llama_dir):
    from serve_cluster import Cluster

    c = Cluster(llama_dir, 1, http=True)
    yield c
    c.stop()


def test_openai_response_format_end_to_end(http_server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=http_server.url, api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Your move, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "move", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        r = c.chat.completions.create(model="llama", messages=msgs, max_tokens=300, temperature=1.0, seed=seed, response_format=rf)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = c.chat.completions.create(model="llama", messages=msgs, max_tokens=100, temperature=1.0, seed=0, n=8, response_format={"type": "json_object"})
    finished = [ch.message.content for ch in r.choices if ch.finish_reason == "stop"]  # see test_json_object_...
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    # streaming under a grammar
    parts = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(model="llama", messages=msgs, max_tokens=300, temperature=1.0, seed=9, response_format=rf, stream=True)
        if ch.choices
    ]
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    # vLLM-style extensions on /v1/completions
    r = c.completions.create(
        model="llama", prompt="pick:", max_tokens=20, temperature=1.0, seed=1, n=4, extra_body={"guided_choice": ["e2e4", "d2d4", "resign"]}
    )
    assert all(ch.text in ("e2e4", "d2d4", "resign") and ch.finish_reason == "stop" for ch in r.choices)
    r = c.completions.create(model="llama", prompt="square:", max_tokens=20, temperature=1.0, seed=2, extra_body={"guided_regex": "[a-h][1-8]"})
    assert re.fullmatch("[a-h][1-8]", r.choices[0].text)
    # bad grammars are 400s naming the field; the server keeps serving
    for kw, param in ((dict(response_format={"type": "yaml"}), "response_format"), (dict(response_format={"type": "json_schema"}), "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="llama", messages=msgs, max_tokens=5, **kw)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="llama", prompt="x", max_tokens=5, extra_body={"guided_regex": "(oops"})
    assert "regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="llama", prompt="x", max_tokens=5, extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert e.value.body["param"] == "guided_choice"


def test_sdk_generate_and_stream_structured(http_server):
    from radixserve.client import Client

    with Client(http_server.address, timeout=60) as c:
        out = c.generate("pick:", max_tokens=20, temperature=1.0, seed=3, structured=StructuredOutput(choice=["yes", "no"]))
        assert out.text in ("yes", "no") and out.finish_reason == "stop"
        out = c.generate([7, 8, 9], max_tokens=300, temperature=1.0, seed=4, structured={"json_schema": SCHEMA})
        jsonschema.validate(json.loads(out.text), SCHEMA)
        chunks = list(c.stream("go:", max_tokens=30, temperature=1.0, seed=5, structured=StructuredOutput(regex="(white|black) [a-h][1-8]")))
        assert re.fullmatch("(white|black) [a-h][1-8]", chunks[-1].text)
        with pytest.raises(BadRequestError) as e:
            c.generate("x", max_tokens=4, structured=StructuredOutput(regex="(oops"))
        assert "structured.regex" in str(e.value)
        assert c.generate("x", max_tokens=2).finish_reason in ("stop", "length")
