"""A request body read as JSON the way every route needs it: UTF-8, standard JSON (no NaN or
Infinity), not nested past the parser's depth, no lone UTF-16 surrogate escapes — each refused with a
400 that says which."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from router.api.errors import bad_request

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> None:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from e
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise bad_request("request body nests JSON too deeply") from e
    if _SURROGATE_ESCAPE.search(text):  # a \uD8xx escape: fine in a pair, not alone
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request("request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff) in a string") from e
    return body
