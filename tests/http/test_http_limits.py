"""Issue 13 item 4: nesting bombs, huge seeds, slow headers and too many connections."""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import socket
import threading
import time

import msgspec
import pytest
import zmq

from radixserve import protocol as P
from radixserve.serve.openai import Gateway, GatewayConfig, GatewayServer
from radixserve.serve.router import RouterConfig

from serve_cluster import running_router

pytestmark = pytest.mark.timeout(120)


def _deep_msgpack(tag: str, depth: int = 1000) -> bytes:
    """1,000 nested arrays in a free-form (Any) field, where the typed decoder must recurse."""
    field = "stats" if tag in ("stats_reply", "heartbeat") else "params"
    head = msgspec.msgpack.encode({"type": tag, "id": "deep-1", "worker": "w", field: {}})
    assert head.endswith(b"\x80")
    return head[:-1] + b"\x81\xa4stop" + b"\x91" * depth + b"\xa1x"


def test_deep_msgpack_is_a_decode_error():
    for tag in ("stats_reply", "heartbeat"):
        with pytest.raises(P.DecodeError, match="nests too deeply"):
            P.decode(_deep_msgpack(tag))


@pytest.fixture(scope="module")
def router():
    with running_router(RouterConfig(port=0)) as r:
        yield r


def test_deep_msgpack_gets_an_error_reply_and_the_router_stays_up(router):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(router.address)
    for tag in ("generate", "stats_reply", "heartbeat"):
        s.send(_deep_msgpack(tag))
        assert s.poll(10_000), f"no reply to a deeply nested {tag} frame"
        reply = P.decode(s.recv())
        assert isinstance(reply, P.Error) and reply.code == "bad_request"
        assert tag == "generate" or "deep" in reply.message
    s.send(P.encode(P.Health(id="h")))
    assert s.poll(10_000) and isinstance(P.decode(s.recv()), P.HealthReply)
    ctx.destroy(linger=0)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def gateway(router, request):
    """The guards hold with either HTTP protocol (serve uses httptools when it is installed)."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    gw = GatewayServer(
        Gateway(GatewayConfig(router=router.address, model_names=["m"])),
        "127.0.0.1",
        0,
        header_timeout_s=1.0,
        body_timeout_s=1.0,
        max_connections=40,
        http=request.param,
    ).start()
    yield gw
    gw.stop()


def _post(gw, body: bytes, timeout: float = 30.0):
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, data


def test_deep_json_and_huge_seed_are_400(gateway):
    status, data = _post(gateway, b'{"prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and "deep" in data["error"]["message"]
    status, data = _post(gateway, json.dumps({"prompt": [1, 2], "max_tokens": 2, "seed": 10**30}).encode())
    assert status == 400 and data["error"]["param"] == "seed"
    assert gateway.gateway.counters.get(("other", 500), 0) + gateway.gateway.counters.get(("completions", 500), 0) == 0


def test_unlistable_unknown_field_names_are_400_before_anything_runs(gateway, router):
    """Issue 49 item 13: an unknown field named "ж" (with n 16, streamed) got a 500 while its 16
    generations stayed in flight; a CR/LF in a field name dropped the connection. Unknown fields
    are listed in a response header, so their names must be printable ASCII: else 400, at once."""
    before = router.counters["requests"]
    for name in ("ж", "a\r\nb", "é", "tab\there"):
        body = {"prompt": [1, 2], "max_tokens": 2, "n": 16, "stream": True, name: 1}
        status, data = _post(gateway, json.dumps(body).encode(), timeout=5.0)
        assert status == 400 and data["error"]["param"] == name, (name, data)
        assert "printable ASCII" in data["error"]["message"] and repr(name) in data["error"]["message"]
    assert router.counters["requests"] == before and gateway.gateway.inflight == 0


def _closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    sock.settimeout(wait_s)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_request_head_is_bounded(gateway):
    """A head past 64 KiB is refused (400) and its connection closed, whichever the protocol."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000)
        reply = _read_response(s, 5.0)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:100]


def test_partial_headers_time_out_and_connections_are_capped(gateway):
    socks = []
    for _ in range(60):  # more than the cap of 40
        s = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never finished
        socks.append(s)
    t0 = time.monotonic()
    closed = [_closed_by_peer(s, 10.0) for s in socks]
    assert all(closed), f"{closed.count(False)} slow connections still open"
    assert time.monotonic() - t0 < 20
    for s in socks:
        s.close()
    status, _ = _post(gateway, json.dumps({"prompt": [1], "seed": -1, "temperature": -1}).encode())
    assert status == 400  # and the gateway still answers


def _read_response(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends until it closes the connection (or ``wait_s`` passes)."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, OSError):
        pass
    return data


def test_request_bodies_must_arrive_in_time(gateway):
    """Issue 49 item 13: 50 connections trickling a body, 1 byte every 3 s, stayed open. A body
    must now arrive within the body timeout (1 s here) of its head: else 408, and the connection
    is closed; also when the answer (a 401, a 404) came before the body."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    socks = [socket.create_connection(("127.0.0.1", gateway.port), timeout=10) for _ in range(6)]
    for s in socks[:3]:
        s.sendall(head + b'{"prompt": ')  # and nothing more
    for s in socks[3:]:
        s.sendall(head.replace(b"/v1/completions", b"/nowhere"))
    t0 = time.monotonic()
    for _ in range(4):  # trickling, until the server closes the connection
        time.sleep(0.4)
        for s in socks:
            try:
                s.sendall(b" ")
            except OSError:
                pass
    replies = [_read_response(s, 5.0) for s in socks]
    assert time.monotonic() - t0 < 6
    for reply in replies[:3]:
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert err["code"] == "request_timeout" and "1 s" in err["message"]
    for reply in replies[3:]:
        assert reply.startswith(b"HTTP/1.1 404 ")  # answered at once, then closed when the body stayed late
    for s in socks:
        s.close()
    assert gateway.gateway.counters.get(("completions", 500), 0) == 0


def _health_keep_alive(port: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    conn.getresponse().read()
    return conn  # kept open, idle


def test_idle_connections_do_not_hold_the_connection_cap(gateway):
    """Issue 49 item 13: 205 idle keep-alive /health connections locked every tenant out (a
    global cap, new connections closed). Past the cap (40 here), a new connection now closes the
    one idle the longest; a connection busy with a request is never closed for it."""
    busy = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    busy.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode())
    time.sleep(0.2)  # no worker here: it waits in the router's queue, busy, until it leaves
    idle = [_health_keep_alive(gateway.port) for _ in range(45)]
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().status == 200  # not locked out
    conn.close()
    for c in idle:
        c.close()
    assert busy.sock is not None and not _closed_by_peer(busy.sock, 0.5)  # still waiting for its answer
    busy.close()


def test_client_leaving_a_non_streaming_request_is_not_a_500(gateway):
    """No worker here: the request waits in the router until the client hangs up."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode(), headers={"Content-Type": "application/json"})
    time.sleep(1.0)
    conn.close()
    deadline = time.monotonic() + 15
    counters = gateway.gateway.counters
    while counters.get(("completions", 499), 0) < 1:
        assert time.monotonic() < deadline, counters
        time.sleep(0.1)
    assert counters.get(("completions", 500), 0) == 0


# ---------------------------------------------------------------------------------------- issue 49 item 12
async def _max_lag(seconds: float, since: float | None = None, step: float = 0.01) -> float:
    """How long the loop's other tasks waited at worst during ``seconds``: the most a ``step``
    sleep overslept (and, with ``since``, how late this probe started)."""
    start = time.monotonic()
    worst = start - since if since is not None else 0.0
    while time.monotonic() - start < seconds:
        t0 = time.monotonic()
        await asyncio.sleep(step)
        worst = max(worst, time.monotonic() - t0 - step)
    return worst


def _block(loop, seconds: float) -> float:
    """Stall ``loop`` (of another thread) for ``seconds`` from now, so that frames queue up; returns
    when the stall ends (time.monotonic)."""
    started = threading.Event()
    loop.call_soon_threadsafe(lambda: (started.set(), time.sleep(seconds)))
    assert started.wait(10)
    return time.monotonic() + seconds


def test_a_health_flood_does_not_stall_the_router_loop(router):
    """Two sockets flooding health requests stalled the router's loop for as long as frames were
    queued (a victim's stream took 16.7 s, not 0.78 s): its receive loop never yielded. A backlog
    of 40,000 health frames now leaves the loop's other tasks waiting milliseconds, not seconds."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(router.address)
    frame = P.encode(P.Health(id="flood"))
    unblocked = _block(router.loop, 0.5)
    for _ in range(20_000):
        for s in socks:
            s.send(frame)
    since = max(unblocked, time.monotonic())  # the probe is due now, or when the stall ends
    lag = asyncio.run_coroutine_threadsafe(_max_lag(0.5, since=since), router.loop).result(60)
    ctx.destroy(linger=0)
    assert lag < 0.2, f"the router's loop stalled {lag:.2f} s behind a health flood"


def test_a_reply_flood_does_not_stall_the_client_loop():
    """The SDK's (and so the gateway's) receive loop yields to its event loop while frames are queued."""
    from radixserve.client import AsyncClient

    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.setsockopt(zmq.SNDHWM, 0)
    address = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"

    async def main():
        async with AsyncClient(address, timeout=10) as client:
            call = asyncio.ensure_future(client.health(timeout=60))
            assert await asyncio.to_thread(fake.poll, 10_000)
            identity, req = fake.recv_multipart()
            frame = P.encode(P.HealthReply(id="unknown", status="ok", workers=0, workers_alive=0))
            time.sleep(0.3)  # the loop stalls; meanwhile 50,000 stray replies queue up
            for _ in range(50_000):
                fake.send_multipart([identity, frame])
            fake.send_multipart([identity, P.encode(P.HealthReply(id=P.decode(req).id, status="ok", workers=0, workers_alive=0))])
            lag = await _max_lag(0.5)
            assert (await call)["status"] == "ok"
            return lag

    try:
        lag = asyncio.run(main())
    finally:
        ctx.destroy(linger=0)
    assert lag < 0.2, f"the client's loop stalled {lag:.2f} s behind a reply flood"


class _SlowTokenizer:
    """A real tokenizer that takes 1 s per call on a long text, and records every text's length."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        self.calls.append(len(text))
        if len(text) > 1000:
            time.sleep(1.0)
        return self.tok(text, **kw)


def _chat(port: int, content: str, timeout: float = 30.0) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2}).encode())
    r = conn.getresponse()
    data = json.loads(r.read() or b"{}")
    conn.close()
    return r.status, data, time.monotonic() - t0


def test_long_chats_are_refused_untokenized_and_do_not_hold_up_short_ones(llama_dir):
    """Six 1.9M-character chats were each tokenized (under one global lock) before being refused,
    and another tenant's "hi" took 10 s. A chat longer than any prompt that fits the context is
    now refused untokenized; long ones are tokenized in a pool, short ones at once. (No worker,
    no queue: every chat that is tokenized ends in a 503 from the router, at once.)"""
    from radixserve.serve.router import load_tokenizer

    tok = _SlowTokenizer(load_tokenizer(llama_dir))
    with running_router(RouterConfig(port=0, max_model_len=32, max_queue=0)) as r:
        limit = r.prompt_char_limit()
        config = GatewayConfig(router=r.address, model_names=["m"], inline_tokenize_chars=256)
        gw = GatewayServer(Gateway(config, tok), "127.0.0.1", 0).start()
        try:
            status, data, _ = _chat(gw.port, "x" * (limit + 1))
            assert status == 400 and data["error"]["code"] == "context_length_exceeded", data
            assert data["error"]["param"] == "messages" and f"{limit + 1} characters" in data["error"]["message"]
            assert max(tok.calls) < limit  # refused before the tokenizer saw it
            long = [threading.Thread(target=_chat, args=(gw.port, "y" * 1500)) for _ in range(4)]
            for t in long:
                t.start()
            time.sleep(0.3)  # two of them are being tokenized (1 s each), two wait for the pool
            status, data, took = _chat(gw.port, "hi")
            assert status == 503 and data["error"]["code"] == "overloaded", data  # tokenized, then refused
            assert took < 0.5, f"a short chat waited {took:.2f} s behind long ones"
            for t in long:
                t.join(30)
        finally:
            gw.stop()


def test_the_gateway_tokenizer_is_safe_to_share_between_threads(llama_dir):
    """What the global lock was for: a fast tokenizer's backend settings (truncation, padding) are
    reset by the first call that differs, a mutable borrow that fails ("Already borrowed") while
    another thread encodes. The gateway sets them once, before any thread uses it."""
    from concurrent.futures import ThreadPoolExecutor

    from radixserve.serve.openai.prompts import chat_ids
    from radixserve.serve.router import load_tokenizer

    tok = load_tokenizer(llama_dir)
    tok.backend_tokenizer.enable_truncation(8)
    tok.backend_tokenizer.enable_padding(length=16)
    Gateway(GatewayConfig(router="tcp://127.0.0.1:1"), tok)
    assert tok.backend_tokenizer.truncation is None and tok.backend_tokenizer.padding is None
    messages = [{"role": "user", "content": "e2e4 " * 2000}]
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: chat_ids(messages, tok, P.Limits()), range(32)))
    assert all(x == ids[0] for x in ids) and len(ids[0]) > 2000


class _LogprobsClient:
    """Stands for the router client: every generate ends at once with ``tokens`` tokens, each with
    20 alternatives; health and stats answer at once."""

    def __init__(self, tokens: int):
        self.lps = [P.TokenLogprob(token_id=i % 500, logprob=-1.0, top=[((i + k) % 500, -2.0) for k in range(20)]) for i in range(tokens)]

    async def generate(self, prompt, **_):
        from radixserve.client import Completion

        return Completion(
            request_id="x",
            text="",
            token_ids=[lp.token_id for lp in self.lps],
            finish_reason="length",
            usage=P.Usage(prompt_tokens=len(prompt), cached_tokens=0, completion_tokens=len(self.lps)),
            timings=P.Timings(queue_s=0.0, ttft_s=0.0, e2e_s=0.0),
            logprobs=self.lps,
        )

    async def health(self, timeout=None):
        return {"status": "ok", "workers": 1, "workers_alive": 1}

    async def stats(self, timeout=None):
        return {"router": {"max_prompt_chars": 65536}, "workers": {"w0": {"alive": True, "max_model_len": 4096}}}

    async def close(self):
        pass


def test_logprobs_do_not_stall_other_requests(llama_dir):
    """n 8 x 1,500 tokens x top_logprobs 20 raised others' /health to 2.56 s (and a spurious 503):
    every token and alternative was detokenized on the loop. Now each id is decoded once, and a
    large response is built off the loop."""
    from radixserve.serve.router import load_tokenizer

    gw = GatewayServer(
        Gateway(GatewayConfig(router="tcp://127.0.0.1:1", model_names=["m"]), load_tokenizer(llama_dir), client=_LogprobsClient(1500)), "127.0.0.1", 0
    ).start()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 8, "logprobs": True, "top_logprobs": 20, "max_tokens": 1500}).encode()
    result = {}

    def heavy():
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=body)
        r = conn.getresponse()
        result["status"], result["body"] = r.status, r.read()  # decoded later: json.loads holds the GIL
        conn.close()

    gc.collect()  # the test's own garbage (a tokenizer loaded) must not make the collection measured here
    try:
        t = threading.Thread(target=heavy)
        t.start()
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            conn.close()
            worst = max(worst, time.monotonic() - t0)
        t.join()
    finally:
        gw.stop()
    choices = json.loads(result["body"])["choices"]
    assert result["status"] == 200 and len(choices) == 8
    assert all(len(c["logprobs"]["content"]) == 1500 and len(c["logprobs"]["content"][0]["top_logprobs"]) == 20 for c in choices)
    assert worst < 0.3, f"/health took {worst:.2f} s while a logprobs response was built"
