"""The gateway's fast refusal (issue 49, HTTP overload at 10x capacity): a completion the router
would refuse ``overloaded`` (its published admission view says so) is answered 503 at once,
before routing and body, without a call to the router; anything else goes to the router as before."""

from __future__ import annotations

import http.client
import json

import pytest

from radixserve import protocol as P
from radixserve.serve.openai import Gateway, GatewayConfig, GatewayServer, Tenants

pytestmark = pytest.mark.timeout(60)


class _Client:
    """Stands for the router client: records the generates it is asked for, each done at once."""

    def __init__(self) -> None:
        self.calls: list[str | None] = []

    async def generate(self, prompt, *, namespace=None, **_):
        from radixserve.client import Completion

        self.calls.append(namespace)
        return Completion(
            request_id="x",
            text="ok",
            token_ids=[5],
            finish_reason="length",
            usage=P.Usage(prompt_tokens=len(prompt), cached_tokens=0, completion_tokens=1),
            timings=P.Timings(queue_s=0.0, ttft_s=0.0, e2e_s=0.0),
        )

    async def stats(self, timeout=None):
        return {"router": {"max_prompt_chars": 65536}, "workers": {"w0": {"alive": True, "max_model_len": 4096}}}

    async def close(self):
        pass


def _post(port: int, path: str, body: dict, key: str | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
    finally:
        conn.close()


@pytest.fixture(params=["httptools", "h11"])
def gateway(request):
    """A gateway with two keyed tenants, a fake router client, and an admission view that refuses
    the tenants named in ``refusing`` (what it was asked is in ``asked``); over either protocol."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    client, refusing, asked = _Client(), set(), []

    def admission(tenant: str) -> bool:
        asked.append(tenant)
        return tenant in refusing

    tenants = Tenants({"key-a": "alice", "key-b": "bob"}, b"s" * 32)
    gw = Gateway(GatewayConfig(router="tcp://127.0.0.1:1", model_names=["m"]), tenants=tenants, client=client, admission=admission)
    app, app_calls = gw.app, []

    async def counting(scope, receive, send):  # what reached the ASGI app
        app_calls.append(scope.get("path"))
        await app(scope, receive, send)

    gw.app = counting
    server = GatewayServer(gw, "127.0.0.1", 0, http=request.param).start()
    try:
        yield server.port, client, refusing, asked, tenants, request.param, app_calls
    finally:
        server.stop()


def test_refused_at_once_without_a_call_to_the_router(gateway):
    port, client, refusing, asked, tenants, protocol, app_calls = gateway
    alice = f"http:{tenants.namespace('alice')}"
    refusing.add(alice)
    for path, body in (("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}), ("/v1/chat/completions", {"messages": "not even checked"})):
        status, headers, data = _post(port, path, body, "key-a")
        assert status == 503 and data["error"]["code"] == "overloaded" and data["error"]["type"] == "server_error", data
        assert set(data["error"]) == {"message", "type", "param", "code"}
        assert int(headers["retry-after"]) >= 1
    assert client.calls == [] and asked == [alice, alice]
    # httptools: answered as soon as the head was in, before any ASGI cycle; h11: before routing
    assert app_calls == ([] if protocol == "httptools" else ["/v1/completions", "/v1/chat/completions"])
    # bob's share is not full: his request goes to the router
    status, _, data = _post(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4}, "key-b")
    assert status == 200 and data["choices"][0]["text"] == "ok"
    assert client.calls == [tenants.namespace("bob")] and asked[-1] == f"http:{tenants.namespace('bob')}"


def test_a_request_without_a_valid_key_is_answered_401_not_503(gateway):
    port, client, refusing, asked, tenants, _, _ = gateway
    refusing.add(f"http:{tenants.namespace('alice')}")
    for key in (None, "wrong"):
        status, _, data = _post(port, "/v1/completions", {"prompt": [1], "max_tokens": 4}, key)
        assert status == 401, data
    assert asked == [] and client.calls == []


def test_the_router_view_is_not_asked_for_other_routes(gateway):
    port, client, refusing, asked, tenants, _, _ = gateway
    refusing.add(f"http:{tenants.namespace('alice')}")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": "Bearer key-a"})
    assert conn.getresponse().status == 200
    conn.close()
    assert asked == []
