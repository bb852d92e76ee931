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

Multiplexed: one connection per router and worker carries every stream between them, so a step's
tokens for all of them leave the worker in one write and reach the router in one read (the plain
stream above costs a socket write and a read per token per stream).

    POST /v1/internal/mux           chunked request body and chunked response, both open for as long
                                    as the connection lives; frames in both directions:
                                    kind (1 byte) | stream id (4 bytes) | length (4 bytes) | payload
        router -> worker  OPEN    payload: a GenerateRequest (protobuf) — starts stream `id`
                          CANCEL  payload: empty — the router's client went away
        worker -> router  EVENT   payload: a GenerateEvent; the one with a finish_reason is the last
                          ERROR   payload: JSON as above; the last of its stream

A stream id is the router's, never reused on a connection while its stream lives. The connection
closing fails (router) or cancels (worker) every stream on it.
"""

from __future__ import annotations

import json
import struct

PATH = "/v1/internal/generate"
CONTENT_TYPE = "application/x-splitfire-frames"
MUX_PATH = "/v1/internal/mux"
MUX_CONTENT_TYPE = "application/x-splitfire-mux"
EVENT, ERROR, OPEN, CANCEL = 0, 1, 2, 3
_HEADER = struct.Struct(">BI")
_MUX_HEADER = struct.Struct(">BII")
MAX_FRAME = 64 << 20


def encode(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def encode_mux(kind: int, stream: int, payload: bytes) -> bytes:
    return _MUX_HEADER.pack(kind, stream, len(payload)) + payload


def error_payload(code: str, details: str, failed_endpoint: str = "", failed_role: str = "") -> bytes:
    body = {"code": code, "details": details, "failed_endpoint": failed_endpoint, "failed_role": failed_role}
    return json.dumps(body).encode()


def encode_error(code: str, details: str, failed_endpoint: str = "", failed_role: str = "") -> bytes:
    return encode(ERROR, error_payload(code, details, failed_endpoint, failed_role))


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


class MuxReader:
    """Cuts a multiplexed byte stream into (kind, stream id, payload) frames, whatever the read
    boundaries."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        buf = self._buf + data if self._buf else data
        out: list[tuple[int, int, bytes]] = []
        pos, n, size = 0, len(buf), _MUX_HEADER.size
        unpack = _MUX_HEADER.unpack_from
        while n - pos >= size:
            kind, stream, length = unpack(buf, pos)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME}")
            end = pos + size + length
            if end > n:
                break
            out.append((kind, stream, buf[pos + size:end]))
            pos = end
        self._buf = buf[pos:]
        return out
