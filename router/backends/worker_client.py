"""The backend for splitfire workers: streaming over gRPC (one channel per endpoint, reused)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from common.block_hash import HASH_BYTES
from common.tracing import grpc_metadata
from protos import frames, sampling, trailers
from protos import splitfire_pb2 as pb
from protos import splitfire_pb2_grpc as pbg
from router.api.chunks import Chunk, Logprob, WorkerError
from router.api.errors import bad_request
from router.backends.backend import Probe, TokenRelay
from router.backends.http_client import HTTPClient, HTTPClientError
from router.backends.mux_client import MuxClient
from router.core.endpoints import Endpoint

if TYPE_CHECKING:
    from router.api.protocol import GenRequest
    from router.backends.backend import Route

log = logging.getLogger("splitfire.router")

_FRAME_HEADERS = {"Content-Type": "application/x-protobuf", "Accept": frames.CONTENT_TYPE}
# A restarted worker must be reachable again within a health interval: gRPC's reconnect backoff
# otherwise grows to 120 s on a long-lived channel (a restarted worker was seen unused for 15-32 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
CHANNEL_OPTIONS = [*RECONNECT_OPTIONS, ("grpc.max_receive_message_length", 64 * 2**20), ("grpc.keepalive_time_ms", 10_000),
                   ("grpc.keepalive_timeout_ms", 5_000), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]
# Worker status → (retry elsewhere?, HTTP status if surfaced to the client)
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (False, 400),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (True, 429),
    grpc.StatusCode.UNAVAILABLE: (True, 503),
    grpc.StatusCode.DEADLINE_EXCEEDED: (True, 504),
    grpc.StatusCode.CANCELLED: (True, 503),
    grpc.StatusCode.INTERNAL: (True, 502),
    grpc.StatusCode.UNKNOWN: (True, 502),
}


def blamed_endpoint(e: grpc.aio.AioRpcError, called: str) -> tuple[str, str]:
    """(address, role) of the endpoint a failed call blames: the one the worker names in its
    trailing metadata (its prefill worker), else the worker called."""
    meta = dict(e.trailing_metadata() or ())
    failed = meta.get(trailers.FAILED_ENDPOINT)
    if isinstance(failed, str) and failed:
        return failed, str(meta.get(trailers.FAILED_ROLE) or "prefill")
    return called, "decode"


def add_event(c: Chunk | None, ev: pb.GenerateEvent) -> Chunk:
    """A worker's event as a Chunk, or folded into the Chunk of the same read."""
    if c is None:
        c = Chunk(text=ev.text, token_ids=list(ev.token_ids), prefill_mode=ev.prefill_mode)
    else:
        c.text += ev.text
        c.token_ids += ev.token_ids
        c.prefill_mode = c.prefill_mode or ev.prefill_mode
    if ev.logprobs:
        c.logprobs += [Logprob(lp.token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                       for lp in ev.logprobs]
    if ev.finish_reason:
        c.finish_reason = ev.finish_reason
        u = ev.usage
        c.prompt_tokens, c.completion_tokens, c.cached_tokens = u.prompt_tokens, u.completion_tokens, u.cached_tokens
        if ev.stop_string:
            c.stop_reason = ev.stop_string
        elif ev.HasField("stop_token_id"):
            c.stop_reason = ev.stop_token_id
    return c


def frame_error(payload: bytes, called: str) -> WorkerError:
    """An ERROR frame as the WorkerError the gRPC status would have given."""
    err = json.loads(payload)
    code = getattr(grpc.StatusCode, err.get("code", ""), grpc.StatusCode.UNKNOWN)
    retryable, status = _STATUS.get(code, (True, 502))
    failed = err.get("failed_endpoint") or called
    role = (err.get("failed_role") or "prefill") if err.get("failed_endpoint") else "decode"
    return WorkerError(f"{code.name}: {err.get('details') or code.name}", retryable=retryable, status=status,
                       failed=failed, failed_role=role)


def _token_sink(relay: TokenRelay) -> Callable[[int, bytes], bool]:
    """A mux stream's sink (`MuxStream.sink`): the frames that are plain tokens, to `relay`."""
    from_string = pb.GenerateEvent.FromString

    def sink(kind: int, payload: bytes) -> bool:
        if kind != frames.EVENT:
            return False
        try:
            ev = from_string(payload)
        except DecodeError:
            return False  # (the stream's reader parses it again and fails the stream with the error)
        if ev.finish_reason or ev.logprobs or ev.prefill_mode:
            return False
        return relay(ev.text, ev.token_ids)

    return sink


@dataclass
class KVSnapshot:
    stream: str  # the Redis stream of the worker's KV events
    epoch: str
    seq: int  # the last event the hashes include
    hashes: list[bytes]


class WorkerClient:
    token_level = True

    def __init__(self, stream: str = "mux") -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        # "mux": every token stream to a worker on one connection to its HTTP port when it serves that,
        # else "http": one HTTP stream each; "grpc": always gRPC.
        self.stream = stream
        self.http = HTTPClient()
        self.mux = MuxClient()

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await self.http.close()
        await self.mux.close()

    def generate(self, route: Route, req: GenRequest, generated: list[int], max_tokens: int, attempt: int,
                 timeout_s: float, relay: TokenRelay | None = None) -> AsyncIterator[Chunk]:
        """`generated`: this request's output from failed attempts (the worker continues after it).
        `relay`: on the multiplexed stream, plain token events go to it as they arrive (see `_generate_mux`)."""
        msg = pb.GenerateRequest(request_id=f"{req.id}-{req.prompt_index}-{attempt}",
                                 token_ids=req.prompt_token_ids + generated,
                                 sampling=sampling.to_proto(replace(req.sampling, max_tokens=max_tokens,
                                                                               resumed_tokens=len(generated))),
                                 tenant=req.tenant, prefill_endpoint=route.prefill.address if route.prefill else "",
                                 tenant_weight=req.weight, adapter=req.adapter, model=req.pool,
                                 priority=req.priority, traceparent=req.traceparent)
        ep = route.decode
        if self.stream == "mux" and ep.stream_port and ep.stream_mux:
            return self._generate_mux(ep, msg, timeout_s, relay)
        if self.stream in ("mux", "http") and ep.stream_port:
            return self._generate_http(ep, msg, timeout_s)
        return self._generate_grpc(ep.address, msg, timeout_s)

    async def _generate_grpc(self, decode: str, msg: pb.GenerateRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        call = pbg.DecodeStub(self.channel(decode)).Generate(msg, timeout=timeout_s,
                                                             metadata=grpc_metadata(msg.traceparent))
        try:
            async for ev in call:
                c = add_event(None, ev)
                yield c
                if ev.finish_reason:
                    # The final event carries everything; not waiting for the call's status saves
                    # ~0.15 ms on the last token (the worker has already counted the request done).
                    return
        except grpc.aio.AioRpcError as e:
            retryable, status = _STATUS.get(e.code(), (True, 502))
            details = e.details() or e.code().name
            failed, role = blamed_endpoint(e, decode)
            raise WorkerError(f"{e.code().name}: {details}", retryable=retryable, status=status, failed=failed,
                              failed_role=role) from e
        finally:
            call.cancel()

    async def _generate_http(self, ep: Endpoint, msg: pb.GenerateRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        """The same stream as frames over HTTP/1.1 (`protos/frames.py`): one Chunk per read."""
        base = f"http://{ep.address.rpartition(':')[0]}:{ep.stream_port}"
        resp = None
        try:
            resp = await self.http.request("POST", base, frames.PATH, msg.SerializeToString(), _FRAME_HEADERS, timeout_s)
            if resp.status != 200:
                body = (await resp.read_all())[:300].decode(errors="replace")
                raise WorkerError(f"decode worker {ep.address} answered {resp.status}: {body}", retryable=resp.status >= 500,
                                  status=502 if resp.status >= 500 else resp.status, failed=ep.address, failed_role="decode")
            reader = frames.FrameReader()
            while data := await resp.read_some():
                c = None
                for kind, payload in reader.feed(data):
                    if kind == frames.ERROR:
                        raise frame_error(payload, ep.address)
                    ev = pb.GenerateEvent.FromString(payload)
                    c = add_event(c, ev)
                    if ev.finish_reason:
                        self.http.release_after_end(resp)  # the chunked body's end may still be in flight
                        resp = None
                        yield c
                        return
                if c is not None:
                    yield c
            raise WorkerError(f"decode worker {ep.address}: stream ended without a finish", retryable=True,
                              status=502, failed=ep.address, failed_role="decode")
        except HTTPClientError as e:
            raise WorkerError(f"UNAVAILABLE: decode worker {ep.address}: {e}", retryable=True, status=503,
                              failed=ep.address, failed_role="decode") from e
        finally:
            if resp is not None:
                self.http.release(resp)  # closes it unless the stream ended: the worker cancels the request

    async def _generate_mux(self, ep: Endpoint, msg: pb.GenerateRequest, timeout_s: float,
                            relay: TokenRelay | None = None) -> AsyncIterator[Chunk]:
        """The same stream on the worker's one multiplexed connection (`router/mux_client.py`): one
        Chunk per read of the connection that carried frames of this stream.

        With `relay`, an event that is nothing but tokens (no finish, logprobs or prefill mode) is handed
        to it from the connection's read callback while this generator waits: `relay(text, token_ids)`
        returns True when it has taken them (then they are not yielded), False to have them yielded as
        usual. That skips the task switch and the generators' frames per token per stream."""
        try:
            conn = await self.mux.connection(ep.address.rpartition(":")[0], ep.stream_port)
        except HTTPClientError as e:
            raise WorkerError(f"UNAVAILABLE: decode worker {ep.address}: {e}", retryable=True, status=503,
                              failed=ep.address, failed_role="decode") from e
        sid, stream = conn.open(msg.SerializeToString())
        if relay is not None:
            stream.sink = _token_sink(relay)
        timer = asyncio.get_running_loop().call_later(
            timeout_s, conn.fail, sid, HTTPClientError(f"no complete response within {timeout_s:g} s"))
        ended = False
        try:
            while True:
                try:
                    got = await stream.take()
                except HTTPClientError as e:
                    raise WorkerError(f"UNAVAILABLE: decode worker {ep.address}: {e}", retryable=True, status=503,
                                      failed=ep.address, failed_role="decode") from e
                c = None
                for kind, payload in got:
                    if kind == frames.ERROR:
                        ended = True
                        raise frame_error(payload, ep.address)
                    ev = pb.GenerateEvent.FromString(payload)
                    c = add_event(c, ev)
                    if ev.finish_reason:
                        ended = True
                        yield c
                        return
                if c is not None:
                    yield c
        finally:
            timer.cancel()
            conn.finish(sid, cancel=not ended)  # a stream left early is cancelled on the worker

    async def load_adapter(self, ep: Endpoint, name: str, path: str, timeout_s: float, model: str = "") -> None:
        """A worker loads a LoRA adapter (into base model `model`, a worker hosting several; "": its first);
        its refusal (INVALID_ARGUMENT) becomes a 400 naming the problem."""
        try:
            await pbg.WorkerStub(self.channel(ep.address)).LoadAdapter(
                pb.LoadAdapterRequest(name=name, path=path, model=model), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise bad_request(e.details() or "the worker refused the adapter", param="lora_path") from e
            raise

    async def unload_adapter(self, ep: Endpoint, name: str, timeout_s: float) -> bool:
        """True: gone at once; False: requests still run under it on this worker."""
        r = await pbg.WorkerStub(self.channel(ep.address)).UnloadAdapter(pb.UnloadAdapterRequest(name=name),
                                                                         timeout=timeout_s)
        return not r.pending

    async def reset_prefix_cache(self, ep: Endpoint, timeout_s: float) -> str:
        r = await pbg.WorkerStub(self.channel(ep.address)).ResetPrefixCache(pb.ResetPrefixCacheRequest(),
                                                                           timeout=timeout_s)
        return f"{r.blocks_dropped} cached blocks dropped, {r.blocks_unshared} in-use blocks unshared"

    async def kv_blocks(self, ep: Endpoint, timeout_s: float) -> KVSnapshot | None:
        """What the worker's prefix cache holds and where its KV events go (None: it publishes none)."""
        r = await pbg.WorkerStub(self.channel(ep.address)).KVBlocks(pb.KVBlocksRequest(), timeout=timeout_s)
        if not r.enabled:
            return None
        return KVSnapshot(r.stream, r.epoch, r.seq, [r.hashes[i : i + HASH_BYTES] for i in range(0, len(r.hashes), HASH_BYTES)])

    async def probe(self, ep: Endpoint, timeout_s: float) -> Probe:
        stub = pbg.WorkerStub(self.channel(ep.address))
        h = await stub.Health(pb.HealthRequest(), timeout=timeout_s)
        probe = Probe(h.status == "serving", h.block_size, h.max_model_len, stream_port=h.stream_port,
                      stream_mux=h.stream_mux, adapters=list(h.adapters), model=h.model, hosted=list(h.models),
                      resident=list(h.resident), adapter_models=list(h.adapter_models))
        if probe.ok:
            # Load reconciliation is best effort: a slow Stats answer is not a sick worker.
            try:
                st = await stub.Stats(pb.StatsRequest(), timeout=timeout_s)
                probe.load = (st.prompt_tokens_in_flight, st.kv_tokens_held, st.decode_tokens_remaining)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
                log.info("event=stats_failed address=%s error=%r", ep.address, e)
        return probe
