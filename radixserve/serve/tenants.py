"""API keys -> tenants -> cache namespaces: one rule for the router's ZMQ client socket and the
HTTP gateway (:mod:`radixserve.serve.openai.tenants` adds HTTP's 401 answers on top).

Each API key maps to a tenant; a tenant's requests run in the cache namespace
``"t-" + HMAC-SHA256(server secret, tenant)``, derived on the server, so no client can pick
another tenant's namespace (no cache hits on, and no TTFT or ``stats(probe=...)`` probing of,
another tenant's prompts). The secret is random per process unless ``RADIXSERVE_TENANT_SECRET``
is set (set it to keep namespaces stable across restarts or gateway replicas); ``serve`` hands
the router's to its gateway, so a tenant's ZMQ and HTTP requests share their cache. Keys are
looked up by their SHA-256 digest, so a lookup's time says nothing about the stored keys.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path

DEFAULT_TENANT = "default"
_COMMENT = re.compile(r"(?:^|\s)#")  # a comment starts a line or follows whitespace


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def tenant_for_key(key: str) -> str:
    """Tenant id of a key given without one (``--api-key``): derived from the key, not the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def load_keys_file(path: str | os.PathLike) -> dict[str, str]:
    """Keys file: a JSON object ``{"KEY": "TENANT", ...}``, or lines ``KEY [TENANT]`` (a key
    without a tenant is its own tenant). A ``#`` starts a comment at the start of a line or after
    whitespace only: inside a key (``sk-live#9f2Qx7``) it is part of the key."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError(f"{path}: a JSON keys file maps key strings to tenant strings")
        return {k: v for k, v in data.items() if k}
    keys: dict[str, str] = {}
    for line in text.splitlines():
        line = _COMMENT.split(line, 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{path}: expected 'KEY [TENANT]' per line, got {len(parts)} fields")
        keys[parts[0]] = parts[1] if len(parts) == 2 else tenant_for_key(parts[0])
    return keys


def configured_keys(api_key: list[str] | None, api_keys_file: str | None) -> dict[str, str]:
    """API keys -> tenants from ``--api-key`` (each its own tenant) and ``--api-keys-file``."""
    from radixserve.errors import RadixServeError

    keys = {key: tenant_for_key(key) for key in api_key or []}
    if api_keys_file:
        try:
            keys.update(load_keys_file(api_keys_file))
        except (OSError, ValueError) as exc:
            raise RadixServeError(f"--api-keys-file: {exc}") from None
    return keys


class TenantKeys:
    """API keys -> tenants (:meth:`tenant`) -> cache namespaces (:meth:`namespace`)."""

    def __init__(self, keys: dict[str, str] | None = None, secret: bytes | None = None):
        self._by_digest = {key_digest(k): t for k, t in (keys or {}).items()}
        env = os.environ.get("RADIXSERVE_TENANT_SECRET")
        self.secret = secret or (env.encode() if env else os.urandom(32))
        self._ns: dict[str, str | None] = {}

    @property
    def required(self) -> bool:
        """Keys are configured: every request must carry one."""
        return bool(self._by_digest)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of ``key``; None for a missing or unknown key (while keys are configured)."""
        if not self._by_digest:
            return DEFAULT_TENANT
        return self._by_digest.get(key_digest(key)) if key else None

    def namespace(self, tenant: str) -> str | None:
        """The cache namespace of ``tenant`` (None: the default tenant of a keyless server)."""
        if tenant == DEFAULT_TENANT and not self._by_digest:
            return None
        ns = self._ns.get(tenant)
        if ns is None:
            ns = "t-" + hmac.new(self.secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            self._ns[tenant] = ns
        return ns
