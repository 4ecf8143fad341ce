"""API keys -> tenants -> cache namespaces, for HTTP: :class:`Tenants` answers a missing or wrong
``Authorization`` header with 401. The keys, the keys file and the namespace rule are
:mod:`radixserve.serve.tenants`' (shared with the router's ZMQ client socket). Without configured
keys every request is the default tenant (namespace ``None``, the SDK's).
"""

from __future__ import annotations

from radixserve.serve.openai.errors import APIError
from radixserve.serve.tenants import DEFAULT_TENANT, TenantKeys, load_keys_file, tenant_for_key

__all__ = ["DEFAULT_TENANT", "Tenants", "load_keys_file", "tenant_for_key"]


class Tenants(TenantKeys):
    """API keys -> tenants -> cache namespaces (salts derived on the server)."""

    def authenticate(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; raises 401."""
        if not self.required:
            return DEFAULT_TENANT
        if not authorization:
            raise APIError(
                401, "You didn't provide an API key. Send 'Authorization: Bearer YOUR_KEY'.", code="missing_api_key", headers={"WWW-Authenticate": "Bearer"}
            )
        scheme, _, key = authorization.strip().partition(" ")
        tenant = self.tenant(key.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:  # lookup by digest: no timing signal about the stored keys
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant
