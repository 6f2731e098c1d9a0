"""API keys -> tenants. The tenant is the prefix-cache salt, so two tenants never share cached blocks."""
from __future__ import annotations

import hashlib

from worker_runtime.auth import bearer_token
from router.api.openai_api import APIError


class Authenticator:
    """Checks `Authorization: Bearer <key>`. With no keys configured every request is tenant-less."""

    def __init__(self, api_keys: dict[str, str]):
        # Keys are looked up by their digest: the lookup's timing then says nothing about a key's prefix.
        self.tenants = {_digest(key): tenant for key, tenant in api_keys.items()}

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant; raises a 401 APIError for a missing or unknown key."""
        if not self.enabled:
            return None
        key = bearer_token(authorization)
        if key is None:
            raise _unauthorized("missing API key: send `Authorization: Bearer <key>`")
        tenant = self.tenants.get(_digest(key))
        if tenant is None:
            raise _unauthorized("invalid API key")
        return tenant


def cache_salt(tenant: str | None, request_salt: str | None) -> str | None:
    """The salt of the request's first KV block: the tenant, then the request's own `cache_salt`.

    The tenant is length-prefixed, so no choice of `cache_salt` by one tenant can produce another
    tenant's salt."""
    if tenant is None:
        return request_salt
    salt = f"tenant:{len(tenant)}:{tenant}"
    return f"{salt}/{request_salt}" if request_salt else salt


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
