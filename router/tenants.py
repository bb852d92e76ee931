"""API keys → tenants. The tenant scopes the prefix cache: tenants never share KV blocks."""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

from router.errors import APIError

DEFAULT_TENANT = "default"


class Tenants:
    def __init__(self, keys: dict[str, str] | None = None):
        self.keys = keys  # None = no authentication, everything is one tenant

    @classmethod
    def from_file(cls, path: str) -> Tenants:
        if not path:
            return cls(None)
        text = Path(path).read_text()
        if text.lstrip().startswith("{"):
            keys = {str(k): str(v) for k, v in json.loads(text).items()}
        else:
            keys = {}
            for n, line in enumerate(text.splitlines(), 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) > 2:
                    raise ValueError(f"{path}:{n}: expected 'key [tenant]'")
                keys[parts[0]] = parts[1] if len(parts) == 2 else parts[0][:8]
        if not keys:
            raise ValueError(f"{path}: no API keys")
        return cls(keys)

    def tenant_of(self, request: web.Request) -> str:
        if self.keys is None:
            return DEFAULT_TENANT
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("api-key", "")
        tenant = self.keys.get(key)
        if tenant is None:
            raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
        return tenant
