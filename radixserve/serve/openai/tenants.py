"""API keys -> tenants -> cache namespaces.

Each API key maps to a tenant; a tenant's requests carry the namespace
``HMAC-SHA256(server secret, tenant)`` so tenants never share cached prefixes (no TTFT probing of
another tenant's prompts). The secret is random per process unless ``RADIXSERVE_TENANT_SECRET`` is
set (set it to keep namespaces stable across restarts or gateway replicas). Without configured
keys every request is the default tenant (namespace ``None``, the SDK's).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path

from radixserve.serve.openai.errors import APIError

DEFAULT_TENANT = "default"
_COMMENT = re.compile(r"(?:^|\s)#")  # a comment starts a line or follows whitespace


def _key_digest(key: str) -> bytes:
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


class Tenants:
    """API keys -> tenants -> cache namespaces (salts derived on the server)."""

    def __init__(self, keys: dict[str, str] | None = None, secret: bytes | None = None):
        self._by_digest = {_key_digest(k): t for k, t in (keys or {}).items()}
        env = os.environ.get("RADIXSERVE_TENANT_SECRET")
        self._secret = secret or (env.encode() if env else os.urandom(32))
        self._ns: dict[str, str | None] = {}

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; raises 401."""
        if not self._by_digest:
            return DEFAULT_TENANT
        if not authorization:
            raise APIError(401, "You didn't provide an API key. Send 'Authorization: Bearer YOUR_KEY'.",
                           code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
        scheme, _, key = authorization.strip().partition(" ")
        tenant = self._by_digest.get(_key_digest(key.strip())) if scheme.lower() == "bearer" else None
        if tenant is None:  # lookup by digest: no timing signal about the stored keys
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def namespace(self, tenant: str) -> str | None:
        """The cache namespace of ``tenant`` (None: the default tenant of a keyless server)."""
        if tenant == DEFAULT_TENANT and not self._by_digest:
            return None
        ns = self._ns.get(tenant)
        if ns is None:
            ns = "t-" + hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
            self._ns[tenant] = ns
        return ns
