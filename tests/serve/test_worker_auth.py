"""Issue 13 item 2: no peer poses as a worker. An in-process router, raw ZMQ peers on loopback."""

from __future__ import annotations

import time

import pytest
import zmq

from radixserve import protocol as P
from radixserve.client import Client
from radixserve.serve import auth
from radixserve.serve.router import RouterConfig

from serve_cluster import running_router

pytestmark = pytest.mark.timeout(120)

FINGERPRINT = "0123456789abcdef:4096"


@pytest.fixture()
def router():
    with running_router(RouterConfig(port=0, model_fingerprint=FINGERPRINT, heartbeat_timeout_s=1.5, forget_dead_s=1.0)) as r:
        yield r


def _dealer(ctx, address: str, identity: bytes, secret: str | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, identity)
    if secret is not None:
        auth.make_client(s, secret)
    s.connect(address)
    return s


def _register(name: str, fingerprint: str = FINGERPRINT, pid: int = 4242) -> bytes:
    return P.encode(P.Register(worker=name, pid=pid, fingerprint=fingerprint, max_model_len=4096))


def _recv(sock, timeout_s: float = 5.0):
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return P.decode(sock.recv(), max_frame_bytes=P.WORKER_MAX_FRAME_BYTES)


def _stats(router) -> dict:
    with Client(router.address, timeout=10) as c:
        return c.stats()


def test_the_real_secret_registers(router):
    """Positive control: a peer holding the secret and the same model joins."""
    ctx = zmq.Context()
    w = _dealer(ctx, router.worker_address, b"w0", router.secret)
    w.send(_register("w0"))
    assert isinstance(_recv(w), P.Ping)
    assert _stats(router)["workers"]["w0"]["alive"]
    ctx.destroy(linger=0)


@pytest.mark.parametrize("kind", ["no-curve", "wrong-secret", "stolen-router-key"])
def test_rogue_registration_without_the_secret_is_refused(router, kind):
    ctx = zmq.Context()
    if kind == "stolen-router-key":  # knows the router's public key, not the workers' secret key
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.IDENTITY, b"w0")
        public, private = zmq.curve_keypair()
        rogue.curve_publickey, rogue.curve_secretkey = public, private
        rogue.curve_serverkey = auth.router_keys(router.secret)[0]
        rogue.connect(router.worker_address)
    else:
        rogue = _dealer(ctx, router.worker_address, b"w0", "ab" * 32 if kind == "wrong-secret" else None)
    for _ in range(3):
        if rogue.poll(200, zmq.POLLOUT):
            rogue.send(_register("w0"), flags=zmq.NOBLOCK)
    assert _recv(rogue, 2.0) is None  # nothing came back: never registered, never sent work
    stats = _stats(router)
    assert stats["workers"] == {} and stats["router"]["gauges"]["workers"] == 0
    if kind == "stolen-router-key":  # the ZAP handler denied its key
        assert stats["router"]["counters"].get("refused_workers", 0) >= 1
    ctx.destroy(linger=0)


def test_fake_register_on_the_client_socket_cannot_kill_w0(router):
    ctx = zmq.Context()
    w0 = _dealer(ctx, router.worker_address, b"w0", router.secret)
    w0.send(_register("w0", pid=1111))
    assert isinstance(_recv(w0), P.Ping)
    fake = _dealer(ctx, router.address, b"attacker")
    for i in range(2000):  # 2000 fake registrations, one of them naming w0
        fake.send(_register("w0" if i == 0 else f"fake{i}", pid=9999))
    replies = [_recv(fake) for _ in range(2000)]
    assert all(isinstance(r, P.Error) and r.code == "bad_request" for r in replies)
    stats = _stats(router)
    assert list(stats["workers"]) == ["w0"] and stats["workers"]["w0"]["pid"] == 1111
    assert stats["workers"]["w0"]["alive"] and stats["router"]["counters"]["worker_deaths"] == 0
    with Client(router.address, timeout=10) as c:
        assert c.health()["workers"] == 1  # fake registrations do not accumulate
    ctx.destroy(linger=0)


def test_worker_of_another_model_is_refused(router):
    ctx = zmq.Context()
    w = _dealer(ctx, router.worker_address, b"other", router.secret)
    w.send(_register("other", fingerprint="fedcba9876543210:32000"))
    reply = _recv(w)
    assert isinstance(reply, P.Refused) and "fingerprint" in reply.reason
    stats = _stats(router)
    assert stats["workers"] == {} and stats["router"]["counters"]["refused_workers"] == 1
    ctx.destroy(linger=0)


def test_silent_remote_worker_is_dropped(router):
    """A remote worker that stops heartbeating is declared dead, then forgotten."""
    ctx = zmq.Context()
    w = _dealer(ctx, router.worker_address, b"gone", router.secret)
    w.send(_register("gone"))
    assert isinstance(_recv(w), P.Ping)
    w.close(linger=0)
    deadline = time.monotonic() + 20
    while "gone" in _stats(router)["workers"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert _stats(router)["router"]["counters"]["worker_deaths"] == 1
    ctx.destroy(linger=0)


def test_secret_checks(tmp_path):
    with pytest.raises(auth.AuthError):
        auth.check_secret("short")
    path = tmp_path / "s"
    first = auth.read_secret_file(str(path), create=True)
    assert auth.read_secret_file(str(path)) == first and (path.stat().st_mode & 0o777) == 0o600
    assert auth.router_keys(first) != auth.worker_keys(first)
    # issue 49 item 14: weak secrets and a secret file others can read are refused
    for weak in ("0" * 64, "ab" * 32, "0123456789abcdef" * 4, "00000000000000000000000000000001"):
        with pytest.raises(auth.AuthError, match="weak"):
            auth.check_secret(weak)
    path.chmod(0o644)
    with pytest.raises(auth.AuthError, match=f"mode 0644.*chmod 600 {path}$"):
        auth.read_secret_file(str(path))
