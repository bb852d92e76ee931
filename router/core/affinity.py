"""`x-session-affinity`: a session stays on its (prefill, decode) pair while that pair is
healthy and not overloaded. Pins live in Redis so several routers agree, or in process
memory when no Redis is configured."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("splitfire.router")


@dataclass(frozen=True)
class Pin:
    prefill: str  # "" when the decode endpoint prefills itself (colocated or no prefill pool)
    decode: str

    def encode(self) -> str:
        return f"{self.prefill}|{self.decode}"

    @classmethod
    def decode_str(cls, raw: str) -> Pin | None:
        prefill, sep, decode = raw.partition("|")
        return cls(prefill, decode) if sep and decode else None


class PinStore(Protocol):
    async def get(self, key: str) -> str | None: ...
    async def set(self, key: str, value: str, ttl_s: float) -> None: ...


class MemoryPinStore:
    def __init__(self, max_entries: int = 1_000_000):
        self._data: dict[str, tuple[str, float]] = {}
        self.max_entries = max_entries

    async def get(self, key: str) -> str | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] < time.monotonic():
            del self._data[key]
            return None
        return item[0]

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        if len(self._data) >= self.max_entries:
            now = time.monotonic()
            for k in [k for k, (_, exp) in self._data.items() if exp < now]:
                del self._data[k]
            if len(self._data) >= self.max_entries:
                self._data.pop(next(iter(self._data)))
        self._data[key] = (value, time.monotonic() + ttl_s)


class RedisPinStore:
    def __init__(self, client):  # redis.asyncio.Redis
        self.r = client

    async def get(self, key: str) -> str | None:
        v = await self.r.get(key)
        return v.decode() if isinstance(v, bytes) else v

    async def set(self, key: str, value: str, ttl_s: float) -> None:
        await self.r.set(key, value, px=int(ttl_s * 1000))


class SessionAffinity:
    """Pins are an optimisation: when the store fails (Redis down), this router's own copy of the
    pins it set or read answers instead, the failure is logged, and the client never sees it."""

    def __init__(self, store: PinStore, ttl_s: float, local: MemoryPinStore | None = None):
        self.store = store
        self.ttl_s = ttl_s
        self.store_errors = 0
        # Write-through copy for a shared store; None when the store is already in-process.
        self.local = None if isinstance(store, MemoryPinStore) else (local or MemoryPinStore())

    @staticmethod
    def key(tenant: str, session: str) -> str:
        return f"splitfire:affinity:{tenant}:{session}"

    def _failed(self, op: str, e: Exception) -> None:
        self.store_errors += 1
        if self.store_errors == 1 or self.store_errors % 1000 == 0:
            log.warning("event=affinity_store_error op=%s errors=%d fallback=local error=%r", op, self.store_errors, e)

    async def lookup(self, tenant: str, session: str) -> Pin | None:
        key = self.key(tenant, session)
        try:
            raw = await self.store.get(key)
        except Exception as e:
            self._failed("get", e)
            raw = await self.local.get(key) if self.local is not None else None
        else:
            if raw and self.local is not None:
                await self.local.set(key, raw, self.ttl_s)
        return Pin.decode_str(raw) if raw else None

    async def pin(self, tenant: str, session: str, pin: Pin) -> None:
        key, value = self.key(tenant, session), pin.encode()
        if self.local is not None:
            await self.local.set(key, value, self.ttl_s)
        try:
            await self.store.set(key, value, self.ttl_s)
        except Exception as e:
            self._failed("set", e)
