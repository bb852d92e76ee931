"""Decode.Generate as a plain HTTP/1.1 stream: what the router reads token by token.

grpc.aio pays its poller thread and a loop wake-up per message, which is per token at low
load; a chunked HTTP response read by the router's own asyncio client costs what an
OpenAI-compatible upstream's stream costs. Control calls stay gRPC.

    POST /v1/internal/generate      body: a GenerateRequest (protobuf)
    200, chunked, frames:           kind (1 byte) | length (4 bytes, big-endian) | payload
        EVENT  payload: a GenerateEvent (protobuf)
        ERROR  payload: JSON {"code": grpc status name, "details": str, "failed_endpoint": str,
                              "failed_role": str} — always the last frame

The client closing the connection cancels the request (as cancelling the gRPC call does).
"""

from __future__ import annotations

import json
import struct

PATH = "/v1/internal/generate"
CONTENT_TYPE = "application/x-splitfire-frames"
EVENT, ERROR = 0, 1
_HEADER = struct.Struct(">BI")
MAX_FRAME = 64 << 20


def encode(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def encode_error(code: str, details: str, failed_endpoint: str = "", failed_role: str = "") -> bytes:
    body = {"code": code, "details": details, "failed_endpoint": failed_endpoint, "failed_role": failed_role}
    return encode(ERROR, json.dumps(body).encode())


class FrameReader:
    """Cuts a byte stream into frames, whatever the read boundaries."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf + data if self._buf else data
        out: list[tuple[int, bytes]] = []
        pos, n = 0, len(buf)
        while n - pos >= _HEADER.size:
            kind, length = _HEADER.unpack_from(buf, pos)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
            end = pos + _HEADER.size + length
            if end > n:
                break
            out.append((kind, buf[pos + _HEADER.size:end]))
            pos = end
        self._buf = buf[pos:]
        return out
