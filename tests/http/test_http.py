"""The OpenAI-compatible HTTP gateway: a real `radixserve serve --http-port 0` driven over HTTP by
the official `openai` client (and raw http.client for what that client cannot send)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
import urllib.parse

import pytest

openai = pytest.importorskip("openai")

from radixserve import TooLongError  # noqa: E402
from radixserve import protocol as P  # noqa: E402
from radixserve.client import Client  # noqa: E402
from radixserve.serve.openai import DEFAULT_TENANT, Gateway, GatewayConfig, GatewayServer, Tenants, load_keys_file  # noqa: E402
from radixserve.serve.openai.errors import APIError  # noqa: E402

from conftest import random_prompts  # noqa: E402
from serve_cluster import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(120)

KEYS = {"key-main": "main", "key-a": "alice", "key-a2": "alice", "key-b": "bob"}
MAX_BODY = 1 << 20  # --max-frame-bytes bounds the HTTP body too


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    # 1 worker, tiny admission limits so overload is easy to provoke (at most 2 running + 2 queued)
    c = Cluster(
        llama_dir,
        1,
        "--api-keys-file",
        str(keys),
        "--api-key",
        "key-cli",
        "--max-inflight",
        "2",
        "--max-queue",
        "2",
        "--max-frame-bytes",
        str(MAX_BODY),
        http=True,
    )
    yield c
    c.stop()


def _client(server, key="key-main", cls=None):
    return (cls or openai.OpenAI)(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Authorization": "Bearer key-main", "Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


def _error(data: bytes) -> dict:
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ---------------------------------------------------------------------------------------- happy paths
def test_models_health_metrics(server):
    c = _client(server)
    models = c.models.list()
    assert [m.id for m in models.data] == ["llama"]
    assert c.models.retrieve("llama").id == "llama"
    status, _, body = _raw(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    c.completions.create(model="llama", prompt="hello", max_tokens=2)
    status, headers, body = _raw(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    assert "radixserve_router_requests_total" in text and "radixserve_http_requests_total" in text
    assert 'radixserve_worker_inflight{worker="w0"}' in text


def test_completion_text_ids_and_batch(server):
    c = _client(server)
    out = c.completions.create(model="llama", prompt="Play e2e4 or d2d4?", max_tokens=5, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    ch = out.choices[0]
    assert ch.finish_reason in ("length", "stop") and isinstance(ch.text, str)
    assert out.usage.prompt_tokens > 0 and 1 <= out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens >= 0  # always present
    ids = random_prompts([20], seed=3)[0]
    out = c.completions.create(model="llama", prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 20 and out.usage.completion_tokens == 4
    out = c.completions.create(model="llama", prompt=["one", "two", "three"], max_tokens=2, temperature=0)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    # streaming completion
    chunks = list(c.completions.create(model="llama", prompt=ids, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_return_token_ids(server):
    # vLLM's return_token_ids: the choice carries the generated ids, and each streamed chunk its
    # new ones (even a chunk whose text is empty: a token that ends inside a UTF-8 character)
    c = _client(server)
    ids = random_prompts([24], seed=4)[0]
    kw = dict(model="llama", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kw)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    out = c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}})
    got = out.choices[0].model_extra["token_ids"]
    assert len(got) == 6 and all(isinstance(t, int) for t in got)
    chunks = list(c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "return_token_ids": True}}, stream=True))
    streamed = [t for ch in chunks if ch.choices for t in (ch.choices[0].model_extra or {}).get("token_ids") or []]
    assert streamed == got
    assert sum(1 for ch in chunks if ch.choices and (ch.choices[0].model_extra or {}).get("token_ids")) >= 1


def test_chat_and_streaming_chat_agree(server):
    c = _client(server)
    messages = [{"role": "system", "content": "You are a chess agent."}, {"role": "user", "content": "Play e2e4 or d2d4?"}]
    out = c.chat.completions.create(model="llama", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens_details is not None
    stream = c.chat.completions.create(
        model="llama", messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == msg.content
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 8
    # the second call of the same conversation hit the cache (the whole prompt but its last token)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    # n=2 streamed: both choices finish, each once
    chunks = list(c.chat.completions.create(model="llama", messages=messages, max_tokens=3, n=2, stream=True, seed=5))
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1]


def test_raw_sse_ends_with_done(server):
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}).encode()
    status, headers, data = _raw(server, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_n_seed_and_stop(server):
    c = _client(server)
    prompt = "Tell me about the janggi cannon."
    kw = dict(model="llama", prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    a = c.completions.create(n=2, seed=1234, **kw)
    b = c.completions.create(n=2, seed=1234, **kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    assert [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)] == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    single = c.completions.create(seed=1234, **kw)
    assert single.choices[0].text == sorted(a.choices, key=lambda ch: ch.index)[0].text  # choice i: seed + i
    assert a.usage.completion_tokens == 16
    # chat n=2
    chat = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": prompt}], n=2, max_tokens=3, seed=7)
    assert sorted(ch.index for ch in chat.choices) == [0, 1]
    # stop strings: greedy output, then stop at a substring of it
    g = c.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = next(g[i : i + 2] for i in range(1, len(g) - 1) if "\ufffd" not in g[i : i + 2] and g[i : i + 2].strip())
    s = c.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert s.finish_reason == "stop" and s.text == g[: g.find(stop)]
    s2 = c.completions.create(model="llama", prompt=prompt, max_tokens=16, temperature=0, stop=stop, extra_body={"ignore_eos": True}).choices[0]
    assert s2.text == s.text


def test_cached_tokens_on_shared_prefix(server):
    c = _client(server)
    shared = random_prompts([120], seed=42)[0]
    first = c.completions.create(model="llama", prompt=shared + [11, 12, 13], max_tokens=2, temperature=0)
    second = c.completions.create(model="llama", prompt=shared + [21, 22, 23], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 120


def test_tenant_isolation(server):
    """Key A's prefix gives no cache hit to key B; two keys of the same tenant share their cache."""
    text = "Secret plan of tenant alice: " + "e2e4 d7d5 exd5 Qxd5 Nc3 Qa5 " * 12
    alice = _client(server, "key-a")
    first = alice.completions.create(model="llama", prompt=text + "A", max_tokens=2, temperature=0)
    again = alice.completions.create(model="llama", prompt=text + "B", max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 3
    same_tenant = _client(server, "key-a2").completions.create(model="llama", prompt=text + "C", max_tokens=2, temperature=0)
    assert same_tenant.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 3
    bob = _client(server, "key-b").completions.create(model="llama", prompt=text + "D", max_tokens=2, temperature=0)
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    # and a client cannot pick a namespace: a `user` (or unknown `namespace` field) changes nothing
    cli = _client(server, "key-cli").completions.create(
        model="llama", prompt=text + "E", max_tokens=2, temperature=0, user="alice", extra_body={"namespace": None}
    )
    assert cli.usage.prompt_tokens_details.cached_tokens == 0


def test_unknown_fields_are_ignored_and_listed(server):
    c = _client(server)
    raw = c.completions.with_raw_response.create(model="llama", prompt="hi", max_tokens=2, extra_body={"frobnicate": 1, "zzz": "x"})
    assert raw.status_code == 200
    assert raw.headers["x-radixserve-ignored-fields"] == "frobnicate,zzz"
    assert raw.parse().usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------- errors
def test_400_names_the_field(server):
    c = _client(server)
    cases = [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(extra_body={"top_k": -5}), "top_k"),
        (dict(logit_bias={"5": 10}), "logit_bias"),
        (dict(max_tokens=P.DEFAULT_LIMITS.max_tokens + 1), "max_tokens"),  # the router's cap (issue 48)
        (dict(stop=["x" * (P.DEFAULT_LIMITS.max_stop_chars + 1)]), "stop"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="llama", prompt="hi", **dict({"max_tokens": 2}, **kw))
        assert e.value.status_code == 400
        assert e.value.body["param"] == param and param in e.value.body["message"], (kw, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="llama", messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="llama", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:  # the router's cap, named as the body named it
        c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=P.DEFAULT_LIMITS.max_tokens + 1)
    assert e.value.body["param"] == "max_completion_tokens" and e.value.body["code"] is None
    with pytest.raises(openai.BadRequestError) as e:  # longer than the tiny model's 1024-token context
        c.completions.create(model="llama", prompt=[7] * 1500, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:  # token id outside the vocabulary (router/worker check)
        c.completions.create(model="llama", prompt=[5, 6, 10**6], max_tokens=2)
    assert "vocabulary" in e.value.body["message"]
    for body in (b"{not json", b"[1, 2]", b""):
        status, _, data = _raw(server, "POST", "/v1/completions", body)
        assert status == 400, body
        _error(data)
    status, _, data = _raw(server, "POST", "/v1/completions", json.dumps({"model": "llama", "prompt": 5}).encode())
    assert status == 400 and _error(data)["param"] == "prompt"


def test_max_tokens_past_the_context_is_refused_at_once(server):
    """Issue 49 item 2: max_tokens 8192 with the prompt "hi" was clipped to the context, ran for
    minutes and returned 200. HTTP and the SDK now refuse it at once, with the numbers (the tiny
    model's context is 1024 tokens)."""
    c = _client(server)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="llama", prompt=[9] * 10, max_tokens=1015, extra_body={"ignore_eos": True})
    body = e.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    assert "1015 + 10 prompt tokens exceeds the model's context (1024 tokens); at most 1014 fit" in body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=1024, extra_body={"ignore_eos": True})
    assert e.value.body["code"] == "context_length_exceeded"
    with Client(server.address, timeout=30, api_key=server.api_key) as sdk, pytest.raises(TooLongError, match="exceeds the model's context"):
        sdk.generate([9] * 10, max_tokens=1015, ignore_eos=True)
    assert time.monotonic() - t0 < 10


def test_401_without_or_with_a_wrong_key(server):
    for key in ("wrong-key", "Bearer"):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(server, key).completions.create(model="llama", prompt="hi", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] in ("invalid_api_key", "missing_api_key")
    status, headers, data = _raw(server, "POST", "/v1/chat/completions", b"{}", headers={"Authorization": ""})
    assert status == 401 and _error(data)["code"] == "missing_api_key"
    assert headers["www-authenticate"] == "Bearer"
    status, _, _ = _raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401
    # issue 49 item 13: /metrics (the fleet's counters, cached tokens included) needs a key too
    for auth in ("", "Bearer nope"):
        status, _, data = _raw(server, "GET", "/metrics", headers={"Authorization": auth})
        assert status == 401 and _error(data)["code"] in ("missing_api_key", "invalid_api_key")
    status, _, _ = _raw(server, "GET", "/health", headers={"Authorization": ""})
    assert status == 200  # health stays open


def test_404_unknown_model_and_route(server):
    c = _client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    status, _, data = _raw(server, "GET", "/v1/nothing-here")
    assert status == 404 and _error(data)["code"] == "not_found"
    status, _, data = _raw(server, "GET", "/v1/completions")
    assert status == 405 and _error(data)


def test_413_body_too_large(server):
    c = _client(server)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="llama", prompt="a" * (MAX_BODY + 10), max_tokens=2)
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    # chunked upload (no Content-Length) is bounded while reading
    u = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=iter([b'{"prompt": "' + b"a" * 65536] * 20),
            headers={"Authorization": "Bearer key-main", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        r = conn.getresponse()
        assert r.status == 413 and _error(r.read())["code"] == "request_too_large"
    finally:
        conn.close()


def test_503_when_overloaded_with_retry_after(server):
    """2 in flight + 2 queued fit; the rest of a burst is refused at once with Retry-After. The
    worker is paused during the burst (under the 3 s heartbeat timeout), so no call can finish and
    free its place before the last one arrives: the tiny model's 300 tokens take a fraction of a
    second."""
    worker = server.pids["w0"]

    async def main():
        async with _client(server, cls=openai.AsyncOpenAI) as c:

            async def one(i):
                return await c.completions.with_raw_response.create(
                    model="llama", prompt=[7 + i] * 8, max_tokens=300, temperature=0, extra_body={"ignore_eos": True}
                )

            tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
            os.kill(worker, signal.SIGSTOP)
            try:
                await asyncio.wait(tasks, timeout=1.5)  # the refusals come back at once
            finally:
                os.kill(worker, signal.SIGCONT)
            return await asyncio.gather(*tasks, return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    assert len(ok) == 4 and len(refused) == 4, results
    for r in refused:
        assert r.status_code == 503 and r.body["code"] == "overloaded"
        assert int(r.response.headers["retry-after"]) >= 1
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------------------------------- 500 + units
class _FakeRouter:
    """A ZMQ ROUTER that answers every generate with an ``internal`` error (a broken fleet)."""

    def __init__(self):
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped:
            if not self.sock.poll(100):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = P.decode(frame)
            if isinstance(msg, P.Generate):
                self.sock.send_multipart([ident, P.encode(P.Error(id=msg.id, code="internal", message="engine step failed"))])
            elif isinstance(msg, P.Health):
                self.sock.send_multipart([ident, P.encode(P.HealthReply(id=msg.id, status="degraded", workers=1, workers_alive=0))])

    def close(self):
        self.stopped = True
        self.thread.join(2)
        self.sock.close()
        self.ctx.term()


def test_500_and_degraded_health_from_a_broken_fleet():
    router = _FakeRouter()
    gw = GatewayServer(Gateway(GatewayConfig(router=router.address, model_names=["m"])), "127.0.0.1", 0).start()
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2)
        assert e.value.status_code == 500 and e.value.body["type"] == "server_error"
        with pytest.raises(openai.InternalServerError):  # streaming: the error comes before any token
            list(c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2, stream=True))
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 503 and r.getheader("Retry-After")
        conn.close()
    finally:
        gw.stop()
        router.close()


def test_tenants_and_keys_file(tmp_path):
    t = Tenants({"k1": "acme", "k2": "acme", "k3": "globex"}, secret=b"s" * 32)
    assert t.authenticate("Bearer k1") == t.authenticate("bearer k2") == "acme"
    ns_a, ns_g = t.namespace("acme"), t.namespace("globex")
    assert ns_a != ns_g and "acme" not in ns_a and len(ns_a) <= P.DEFAULT_LIMITS.max_namespace_chars
    assert Tenants({"k1": "acme"}, secret=b"other" * 8).namespace("acme") != ns_a  # salted by the server secret
    assert Tenants().namespace(DEFAULT_TENANT) is None  # no keys: one shared default tenant
    assert Tenants().authenticate(None) == DEFAULT_TENANT
    f = tmp_path / "keys.txt"
    f.write_text("# comment\nsk-one acme\nsk-two\n\nsk-three acme  # trailing\n")
    keys = load_keys_file(f)
    assert keys["sk-one"] == keys["sk-three"] == "acme" and keys["sk-two"].startswith("key-")
    assert "sk-two" not in keys["sk-two"]
    # issue 49 item 14: a '#' inside a key is part of it (it was cut there: 'sk-live' got in)
    f.write_text("sk-live#9f2Qx7 tenantC\n#sk-commented tenantD\nsk-x#y\t# a comment\n")
    keys = load_keys_file(f)
    assert keys["sk-live#9f2Qx7"] == "tenantC" and keys["sk-x#y"].startswith("key-") and len(keys) == 2
    t = Tenants(keys)
    assert t.authenticate("Bearer sk-live#9f2Qx7") == "tenantC"
    with pytest.raises(APIError) as err:
        t.authenticate("Bearer sk-live")
    assert err.value.status == 401


def _gateway_inflight(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, body = _raw(server, "GET", "/metrics")
    return next(s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples if s.name == "radixserve_http_inflight")


def test_client_disconnect_aborts_the_request(server):
    """Clients that go away (mid-stream, and while a non-streaming call runs) abort their router
    requests. The worker is paused while they leave: on the tiny model a request's ~1000 tokens
    take a fraction of a second, so an unpaused worker can finish one before its client is gone,
    and the test would not be testing an abort."""

    def counters():
        with Client(server.address, api_key=server.api_key) as sdk:
            return sdk.stats()["router"]

    def wait(cond, what: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    before = counters()["counters"]["aborted"]
    worker = server.pids["w0"]
    c = _client(server)
    stream = c.completions.create(model="llama", prompt=[9] * 10, max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(worker, signal.SIGSTOP)  # under the 3 s heartbeat timeout: the router keeps it
    try:
        stream.close()  # the client goes away mid-stream
        # and a non-streaming request whose client goes away once the router has dispatched it
        u = urllib.parse.urlparse(server.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"prompt": [8] * 10, "max_tokens": 1000, "ignore_eos": True}).encode(),
            headers={"Authorization": "Bearer key-main", "Content-Type": "application/json"},
        )
        wait(lambda: counters()["gauges"]["inflight"] == 2, "the router never dispatched the request", 1.0)
        conn.close()
        wait(lambda: _gateway_inflight(server) == 0, "the gateway never saw the clients leave", 1.0)
        time.sleep(0.2)  # the cancelled calls' aborts reach the router
    finally:
        os.kill(worker, signal.SIGCONT)
    wait(lambda: counters()["counters"]["aborted"] >= before + 2, "the router never saw the aborts")
    assert _client(server).completions.create(model="llama", prompt="still serving", max_tokens=2).choices


def test_logprobs_formatting():
    """The gateway's OpenAI logprobs objects, for when the router protocol carries them."""
    import msgspec

    gw = Gateway(GatewayConfig(router="tcp://127.0.0.1:1"))
    lps = [(5, -0.5, [(5, -0.5), (6, -1.5)]), (7, -0.1, [(7, -0.1)])]
    chat = msgspec.to_builtins(gw._logprobs(lps, chat=True))  # as the JSON body has it
    assert [c["logprob"] for c in chat["content"]] == [-0.5, -0.1]
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-0.5, -1.5]
    comp = gw._logprobs(lps, chat=False)
    assert comp["token_logprobs"] == [-0.5, -0.1] and comp["tokens"] == ["5", "7"]
    assert gw._logprobs(None, chat=True) is None


def test_logprobs_end_to_end(server, llama_dir):
    """Chat and completion logprobs come back through router and gateway, equal to the engine's."""
    from radixserve import Engine, SamplingParams

    ids = random_prompts([16], seed=41)[0]
    c = _client(server)
    out = c.completions.create(model="llama", prompt=ids, max_tokens=3, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    reference = Engine(llama_dir, kv_cache_tokens=1024).generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2))[0]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in reference.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2, 2, 2]
    chat = c.chat.completions.create(model="llama", messages=[{"role": "user", "content": "e2e4?"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
