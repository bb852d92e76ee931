"""One-line structured logs: `ts level logger event key=value ...`, request id on every request line."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("SPLITFIRE_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def kv(**fields: object) -> str:
    """`key=value` pairs for a log line; values with spaces are quoted."""
    parts = []
    for k, v in fields.items():
        s = str(v)
        parts.append(f'{k}="{s}"' if (" " in s or not s) else f"{k}={s}")
    return " ".join(parts)
