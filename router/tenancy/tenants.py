"""API keys → tenants and what each key may do. The tenant scopes the prefix cache (tenants never share
KV blocks), weighs the tenant's share of admission and of the workers' batches, and each key carries
its quotas and scopes.

`--api-keys FILE`, one of:

- lines `key [tenant]` (the tenant defaults to the key's first 8 characters);
- `{"key": "tenant", ...}`;
- `{"keys": {"key": {"tenant": "a", "weight": 2, "max_concurrent": 32, "requests_per_minute": 600,
  "tokens_per_minute": 200000, "models": ["..."], "admin": false, "priority": 0, "min_priority": 0}, ...}}`
  (every setting optional; `priority` is the key's default request priority, lower is more important,
  and `min_priority` the most important one its requests may ask for).

The file is read again on SIGHUP, and when it changes on disk (`watch`: a Kubernetes Secret update
swaps the mounted file); streams already admitted keep going under the settings they started with. Keys are never logged: a key's id is a hash of it (`Caller.key_id`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from aiohttp import web

from router.api.errors import APIError

log = logging.getLogger("splitfire.router")

DEFAULT_TENANT = "default"
_SETTINGS = {"tenant", "weight", "max_concurrent", "requests_per_minute", "tokens_per_minute", "models", "admin",
             "priority", "min_priority"}
PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # vLLM's: any 32-bit integer, lower is more important


@dataclass(frozen=True)
class KeyPolicy:
    tenant: str
    weight: float = 1.0  # share of admission and of a worker's batch against other tenants
    max_concurrent: int | None = None  # requests in flight at once (None: no limit)
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    models: frozenset[str] | None = None  # the models and adapters this key may name (None: all)
    admin: bool = False  # may call the admin routes (prefix-cache reset, adapter loading)
    priority: int = 0  # the request priority when the body names none (lower is more important)
    min_priority: int | None = None  # the most important priority a request may ask for (None: any)

    @cached_property
    def limited(self) -> bool:
        """Any quota set (else the request skips the quota checks)."""
        return not (self.max_concurrent is None and self.requests_per_minute is None and self.tokens_per_minute is None)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    def priority_of(self, asked: int | None) -> int:
        """The priority a request runs at: the body's (validated there), or the key's default; a
        400 naming `priority` when it asks for more than the key's `min_priority` allows."""
        if asked is None:
            return self.priority
        if self.min_priority is not None and asked < self.min_priority:
            raise APIError(400, f"'priority' {asked} is more important than this API key may ask for (its most "
                           f"important is {self.min_priority}; lower numbers are more important)",
                           param="priority", code="priority_not_allowed")
        return asked


@dataclass(frozen=True)
class Caller:
    """Who is asking: the key's hashed id (never the key), and its policy."""

    key_id: str
    policy: KeyPolicy = field(default_factory=lambda: KeyPolicy(DEFAULT_TENANT, admin=True))

    @property
    def tenant(self) -> str:
        return self.policy.tenant


ANONYMOUS = Caller("-")  # no --api-keys: one tenant, no limits, admin


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _policy(where: str, raw: Any) -> KeyPolicy:
    if isinstance(raw, str):
        return KeyPolicy(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a key's settings must be a tenant name or an object")
    unknown = set(raw) - _SETTINGS
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {sorted(unknown)} (known: {sorted(_SETTINGS)})")

    def positive(name: str, kind: type) -> Any:
        v = raw.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v <= 0:
            raise ValueError(f"{where}: '{name}' must be a positive {'number' if kind is float else 'integer'}")
        return v

    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"{where}: 'tenant' (a name) is required")
    models = raw.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise ValueError(f"{where}: 'models' must be a list of model names")
    if not isinstance(raw.get("admin", False), bool):
        raise ValueError(f"{where}: 'admin' must be true or false")
    prio: dict[str, int] = {}
    for name in ("priority", "min_priority"):
        v = raw.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not PRIORITY_RANGE[0] <= v <= PRIORITY_RANGE[1]:
            raise ValueError(f"{where}: '{name}' must be a 32-bit integer (lower is more important)")
        prio[name] = v
    if "min_priority" in prio and prio.get("priority", 0) < prio["min_priority"]:
        raise ValueError(f"{where}: 'priority' ({prio.get('priority', 0)}) is more important than 'min_priority' "
                         f"({prio['min_priority']}) allows")
    return KeyPolicy(tenant, float(positive("weight", float) or 1.0), positive("max_concurrent", int),
                     positive("requests_per_minute", int), positive("tokens_per_minute", int),
                     frozenset(models) if models is not None else None, bool(raw.get("admin", False)),
                     prio.get("priority", 0), prio.get("min_priority"))


def read_keys(path: str) -> dict[str, KeyPolicy]:
    text = Path(path).read_text()
    keys: dict[str, KeyPolicy] = {}
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from e
        entries = doc["keys"] if isinstance(doc.get("keys"), dict) else doc
        for k, v in entries.items():
            keys[str(k)] = _policy(f"{path}: key {key_id(str(k))}", v)
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(f"{path}:{n}: expected 'key [tenant]'")
            keys[parts[0]] = KeyPolicy(parts[1] if len(parts) == 2 else parts[0][:8])
    if not keys:
        raise ValueError(f"{path}: no API keys")
    return keys


class Tenants:
    def __init__(self, keys: dict[str, KeyPolicy] | None = None, path: str = ""):
        self.keys = keys  # None = no authentication, everything is one tenant
        self.path = path
        self._callers = {k: Caller(key_id(k), p) for k, p in (keys or {}).items()}

    @classmethod
    def from_file(cls, path: str) -> Tenants:
        if not path:
            return cls(None)
        return cls(read_keys(path), path)

    def _stamp(self) -> tuple[float, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime, st.st_size

    async def watch(self, interval_s: float = 2.0) -> None:
        """Reload when the file's modification time or size changes."""
        seen = self._stamp()
        while True:
            await asyncio.sleep(interval_s)
            now = self._stamp()
            if now is not None and now != seen:
                seen = now
                self.reload()

    def reload(self) -> None:
        """Read the file again (SIGHUP). A file that no longer parses keeps the current keys, said loudly."""
        if not self.path:
            return
        try:
            keys = read_keys(self.path)
        except (OSError, ValueError) as e:
            log.error("event=api_keys_reload_failed path=%s error=%s (the current keys stay)", self.path, e)
            return
        self.keys = keys
        self._callers = {k: Caller(key_id(k), p) for k, p in keys.items()}
        log.info("event=api_keys_reloaded path=%s keys=%d tenants=%d", self.path, len(keys),
                 len({p.tenant for p in keys.values()}))

    def caller(self, request: web.Request) -> Caller:
        if self.keys is None:
            return ANONYMOUS
        auth = request.headers.get("Authorization", "")
        # Bearer (OpenAI), api-key (Azure's), x-api-key (Anthropic's)
        key = (auth[7:].strip() if auth.lower().startswith("bearer ")
               else request.headers.get("api-key") or request.headers.get("x-api-key") or "")
        caller = self._callers.get(key)
        if caller is None:
            raise APIError(401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key")
        return caller

    def by_key_id(self, kid: str) -> Caller | None:
        """The caller whose key hashes to `kid` (work done later on a key's behalf: a batch), or None when
        that key is gone from the file."""
        if self.keys is None:
            return ANONYMOUS if kid == ANONYMOUS.key_id else None
        return next((c for c in self._callers.values() if c.key_id == kid), None)

    def admin(self, request: web.Request) -> Caller:
        """The caller of an admin route: refused unless its key is marked admin."""
        caller = self.caller(request)
        if not caller.policy.admin:
            raise APIError(403, "this route needs an admin API key", type_="permission_error", code="admin_only")
        return caller
