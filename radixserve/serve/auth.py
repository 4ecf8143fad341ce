"""Worker authentication: a shared secret, ZMQ CURVE on the worker socket, a model fingerprint.

Clients and workers talk to the router on separate sockets. The worker socket is a CURVE server:
every connection is authenticated and encrypted (CurveZMQ). Both key pairs are derived from one
shared secret (64 hex characters), so knowing the secret is what makes a peer a worker:

- router key pair: ``sha256("radixserve-router-v1" + secret)`` as the CURVE secret key;
- worker key pair: ``sha256("radixserve-worker-v1" + secret)`` (every worker uses the same one).

The router's ZAP handler accepts only the worker public key; a peer without the secret cannot
finish the handshake, so not one of its frames reaches the router (it cannot register, receive
prompts, answer requests or evict a real worker). ``radixserve serve`` generates a secret at
start and hands it to its local workers in the environment (``RADIXSERVE_WORKER_SECRET``);
``--worker-secret-file`` reads it from a file instead (created with mode 0600 when missing), which
remote workers then read with ``radixserve worker --secret-file``.

At registration the worker also sends its model fingerprint (:func:`model_fingerprint`: a hash
of the checkpoint's config.json and the tokenizer's vocabulary); the router refuses a worker
whose fingerprint differs from its own model's (it would decode with the wrong tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.utils.z85 as z85
from zmq.auth.thread import ThreadAuthenticator

from radixserve.errors import RadixServeError

log = logging.getLogger("radixserve.auth")

ENV_SECRET = "RADIXSERVE_WORKER_SECRET"
SECRET_HEX_CHARS = 64
ZAP_DOMAIN = "radixserve-workers"
CLIENT_ZAP_DOMAIN = "radixserve-clients"  # the client socket's: no credentials, a bound on connections


class AuthError(RadixServeError):
    """A missing, weak or unprotected worker secret (``serve`` and ``worker`` exit 2 with it)."""


def new_secret() -> str:
    return secrets.token_hex(SECRET_HEX_CHARS // 2)


_GENERATE = "serve writes one with --worker-secret-file, or generate one: python -c 'import secrets; print(secrets.token_hex(32))'"


def check_secret(secret: str) -> str:
    """``secret`` stripped; raises :class:`AuthError` unless it is at least 32 hex characters and
    not an obviously weak one: fewer than 8 distinct digits (all zeros), or a shorter string repeated."""
    secret = secret.strip()
    try:
        ok = len(secret) >= 32 and bytes.fromhex(secret)
    except ValueError:
        ok = False
    if not ok:
        raise AuthError(f"the worker secret must be at least 32 hex characters ({_GENERATE})")
    digits = secret.lower()
    if len(set(digits)) < 8 or digits in (digits + digits)[1:-1]:
        raise AuthError(f"the worker secret is weak: a few digits or a short pattern repeated; use a random one ({_GENERATE})")
    return secret


def read_secret_file(path: str, *, create: bool = False) -> str:
    """The secret in ``path``; with ``create``, a new one is written there (mode 0600) when missing."""
    p = Path(path).expanduser()
    if not p.exists():
        if not create:
            raise AuthError(f"secret file {p} does not exist")
        secret = new_secret()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        log.info("wrote a new worker secret to %s", p)
        return secret
    mode = p.stat().st_mode & 0o777
    if mode & 0o077:
        raise AuthError(f"secret file {p} is open to group or others (mode {mode:04o}); whoever reads it can pose as a worker: run chmod 600 {p}")
    return check_secret(p.read_text())


def worker_secret(secret_file: str | None = None) -> str:
    """A worker's secret: ``--secret-file``, else ``$RADIXSERVE_WORKER_SECRET``."""
    if secret_file:
        return read_secret_file(secret_file)
    secret = os.environ.get(ENV_SECRET)
    if not secret:
        raise AuthError(f"no worker secret: pass --secret-file FILE (the router's --worker-secret-file) or set {ENV_SECRET}")
    return check_secret(secret)


def _keypair(label: str, secret: str) -> tuple[bytes, bytes]:
    raw = hashlib.sha256(label.encode() + bytes.fromhex(secret)).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def router_keys(secret: str) -> tuple[bytes, bytes]:
    return _keypair("radixserve-router-v1", secret)


def worker_keys(secret: str) -> tuple[bytes, bytes]:
    return _keypair("radixserve-worker-v1", secret)


def gateway_key(secret: str) -> str:
    """The API key the in-process HTTP gateway sends the router with each request: the router
    trusts the namespace it names (the gateway derived it from the HTTP tenant's own key). It
    derives from the worker secret, so only holders of that secret know it."""
    return "gw-" + hashlib.sha256(b"radixserve-gateway-v1" + bytes.fromhex(secret)).hexdigest()


def require_curve() -> None:
    if not zmq.has("curve"):
        raise AuthError("this libzmq was built without CURVE; install pyzmq from its wheels (they bundle it)")


def make_server(sock: zmq.Socket, secret: str) -> None:
    """Make ``sock`` (the router's worker socket, before bind) a CURVE server."""
    require_curve()
    public, private = router_keys(secret)
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    if hasattr(zmq, "ZAP_ENFORCE_DOMAIN"):
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit


def make_client(sock: zmq.Socket, secret: str) -> None:
    """Make ``sock`` (a worker's DEALER, before connect) a CURVE client of the router."""
    require_curve()
    public, private = worker_keys(secret)
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_serverkey = router_keys(secret)[0]


class _OnlyWorkers:
    def __init__(self, secret: str, counters: dict | None):
        self.allowed = worker_keys(secret)[0]
        self.counters = counters

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.allowed
        if not ok:
            if self.counters is not None:
                self.counters["refused_workers"] = self.counters.get("refused_workers", 0) + 1
            log.warning("refused a worker connection with an unknown CURVE key")
        return ok


class _RouterAuthenticator(ThreadAuthenticator):
    """The router's one ZAP handler: CURVE keys on the worker domain (:class:`_OnlyWorkers`), and
    on the client domain (NULL mechanism) a new connection is let in while ``admit_client()``."""

    admit_client: Callable[[], bool] = staticmethod(lambda: True)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6 and msg[0] == b"1.0" and msg[2] == CLIENT_ZAP_DOMAIN.encode():
            ok = self.admit_client()
            self._send_zap_reply(msg[1], b"200" if ok else b"400", b"OK" if ok else b"too many client connections")
            return
        await super().handle_zap_message(msg)


def start_authenticator(ctx, secret: str, counters: dict | None = None, admit_client: Callable[[], bool] | None = None):
    """A ZAP handler on ``ctx`` that lets only holders of the secret in on the worker socket,
    and clients in while ``admit_client()`` (a socket in :data:`CLIENT_ZAP_DOMAIN`). It runs in
    its own thread (on a sync shadow of the same libzmq context), so it is up before the first
    connection, whether or not an event loop runs yet."""
    auth = _RouterAuthenticator(zmq.Context.shadow(ctx.underlying), log=logging.getLogger("radixserve.zap"))
    if admit_client is not None:
        auth.admit_client = admit_client
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_OnlyWorkers(secret, counters))
    return auth


def model_fingerprint(model_dir: str | os.PathLike, vocab_size: int) -> str:
    """``sha256(config.json, canonical)[:16]`` and the tokenizer's vocabulary size."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
        blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    except (OSError, ValueError):
        blob = b""
    return f"{hashlib.sha256(blob).hexdigest()[:16]}:{vocab_size}"
