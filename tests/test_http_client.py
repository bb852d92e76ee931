"""The router's lean HTTP/1.1 client: framing, keep-alive reuse, stale sockets, failures, flow control."""

from __future__ import annotations

import asyncio
import random

import pytest
from aiohttp import web

from router.backends.http_client import HTTPClient, HTTPClientError, Origin, Response


def _feed(raw: bytes, cuts: list[int]) -> Response:
    loop = asyncio.new_event_loop()
    try:
        r = Response(loop, Origin.parse("http://x"))
        prev = 0
        for c in [*cuts, len(raw)]:
            r.data_received(raw[prev:c])
            prev = c
        return r
    finally:
        loop.close()


CHUNKED = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n1;ext=1\r\n \r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: t\r\n\r\n")


def test_chunked_body_decodes_at_every_split_point():
    for cut in range(1, len(CHUNKED)):
        r = _feed(CHUNKED, [cut])
        assert r.status == 200 and r.complete is False  # body not read yet
        assert bytes(r._body) == b"hello abcdefghijklmnopqrstuvwxyz", cut
        assert r._complete and r.keep_alive
    rng = random.Random(0)
    for _ in range(200):  # many small reads
        cuts = sorted(rng.sample(range(1, len(CHUNKED)), 12))
        assert bytes(_feed(CHUNKED, cuts)._body) == b"hello abcdefghijklmnopqrstuvwxyz"


def test_whole_chunks_fast_path_agrees_with_the_byte_loop():
    """Reads of whole SSE-event chunks take the split fast path; a CRLF inside a chunk's data, a
    chunk cut by the read, and the last chunk must all come out the same."""
    events = [b"data: {\"a\":%d,\"pad\":\"%s\"}\n\n" % (i, b"p" * 40) for i in range(40)]
    events += [b"odd\r\ndata\r\n", b"x" * 300]
    body = b"".join(events)
    framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed
    head = raw.index(b"\r\n\r\n") + 4
    whole = Response(asyncio.new_event_loop(), Origin.parse("http://x"))
    whole._raw += b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events[:40])  # C speed, one step
    whole._whole_chunks()
    assert bytes(whole._body) == b"".join(events[:40]) and not whole._raw
    for cut in range(head, len(raw)):
        r = _feed(raw, [head, cut])
        assert bytes(r._body) == body and r._complete and not r._raw, cut
    rng = random.Random(1)
    for _ in range(200):
        r = _feed(raw, sorted(rng.sample(range(1, len(raw)), 30)))
        assert bytes(r._body) == body and r._complete


def test_content_length_close_delimited_and_interim_heads():
    r = _feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 4\r\n\r\nnope", [30])
    assert (r.status, bytes(r._body), r._complete, r.keep_alive) == (404, b"nope", True, True)
    r = _feed(b"HTTP/1.0 200 OK\r\n\r\nstreamed until close", [])
    assert r.status == 200 and not r.keep_alive and not r._complete  # ends with connection_lost
    r.connection_lost(None)
    assert r._complete
    r = _feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", [])
    assert r._complete and not r.keep_alive
    r = _feed(b"HTTP/1.1 204 No Content\r\n\r\n", [])
    assert r._complete and r.keep_alive


def test_garbage_is_an_error_not_a_hang():
    bad_chunk = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for raw in (b"SSH-2.0-OpenSSH\r\n\r\n", bad_chunk + b"zz\r\n", bad_chunk + b"-5\r\nabc\r\n"):
        r = _feed(raw, [])
        assert isinstance(r._exc, HTTPClientError)


@pytest.fixture
async def server():
    state = {"requests": 0, "peers": set()}

    async def stream(request: web.Request) -> web.StreamResponse:
        state["requests"] += 1
        state["peers"].add(request.transport.get_extra_info("peername"))
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pad = "x" * body.get("pad", 0)
        for i in range(body["n"]):
            await resp.write(f"data: {i}{pad}\n\n".encode())
        await resp.write_eof()
        return resp

    async def plain(request: web.Request) -> web.Response:
        state["requests"] += 1
        return web.Response(status=503, text="busy " + request.headers.get("x-test", ""))

    async def die(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: partial\n\n")
        request.transport.close()
        return resp

    app = web.Application()
    app.router.add_post("/base/stream", stream)
    app.router.add_get("/base/plain", plain)
    app.router.add_post("/base/die", die)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/base", state
    await runner.cleanup()


@pytest.fixture
async def client():
    c = HTTPClient()
    yield c
    await c.close()


async def _read(client: HTTPClient, url: str, n: int) -> bytes:
    r = await client.request("POST", url, "/stream", f'{{"n": {n}}}'.encode(), {"Content-Type": "application/json"})
    try:
        assert r.status == 200
        return await r.read_all()
    finally:
        client.release(r)


async def test_streams_and_reuses_one_keep_alive_connection(server, client):
    url, state = server
    for n in (1, 50, 3):
        assert await _read(client, url, n) == b"".join(f"data: {i}\n\n".encode() for i in range(n))
    assert state["requests"] == 3 and len(state["peers"]) == 1
    r = await client.request("GET", url, "/plain", headers={"x-test": "hdr"})
    assert (r.status, await r.read_all()) == (503, b"busy hdr")
    client.release(r)
    assert len(state["peers"]) == 1


async def test_abandoned_response_is_not_reused(server, client):
    url, state = server
    r = await client.request("POST", url, "/stream", b'{"n": 5000}')
    assert await r.read_some()
    client.release(r)  # not read to the end: must be closed, not pooled
    assert await _read(client, url, 2) == b"data: 0\n\ndata: 1\n\n"
    assert len(state["peers"]) == 2


async def test_stale_idle_connection_is_retried_once_on_a_fresh_one(server, client):
    url, state = server
    await _read(client, url, 1)
    (conn,) = client._idle[Origin.parse(url)]
    conn.transport.pause_reading()  # the close below stays unnoticed, as after a server's idle timeout
    conn.transport.get_extra_info("socket").shutdown(2)
    assert await _read(client, url, 2) == b"data: 0\n\ndata: 1\n\n"
    assert state["requests"] == 2 and len(state["peers"]) == 2  # the retry went out on a new socket


async def test_failures_raise_with_context(server, client):
    url, _ = server
    r = await client.request("POST", url, "/die", b"{}")
    with pytest.raises(HTTPClientError, match="mid-response"):
        await r.read_all()
    client.release(r)
    with pytest.raises(HTTPClientError, match="cannot connect"):
        await client.request("GET", "http://127.0.0.1:1", "/x")


async def test_slow_reader_pauses_the_socket(server, client):
    url, _ = server
    r = await client.request("POST", url, "/stream", b'{"n": 8000, "pad": 1000}')
    await asyncio.sleep(0.5)  # the server writes ~8 MB while nobody reads
    assert r._paused and len(r._body) < 3 * 2**20
    total = len(await r.read_all())
    assert total == sum(len(f"data: {i}\n\n") + 1000 for i in range(8000))
    client.release(r)


async def test_deadline_fails_a_silent_upstream(client):
    done = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await done.wait()  # then nothing: a hung upstream
        writer.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        r = await client.request("POST", f"http://127.0.0.1:{port}", "/x", b"{}", timeout_s=0.5)
        assert await r.read_some() == b"hello"
        with pytest.raises(HTTPClientError, match=r"within 0\.5 s"):
            await r.read_some()
        assert 0.4 < loop.time() - t0 < 3
        client.release(r)
        assert not client._idle.get(Origin.parse(f"http://127.0.0.1:{port}"))
    finally:
        done.set()
        srv.close()


async def test_ipv6_literal_upstream(client):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=request.headers["Host"])

    app = web.Application()
    app.router.add_get("/h", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "::1", 0)
        await site.start()
    except OSError:
        await runner.cleanup()
        pytest.skip("no IPv6 loopback here")
    port = site._server.sockets[0].getsockname()[1]
    try:
        r = await client.request("GET", f"http://[::1]:{port}", "/h")
        assert (r.status, await r.read_all()) == (200, f"[::1]:{port}".encode())
        client.release(r)
    finally:
        await runner.cleanup()


async def test_connection_released_after_its_content_is_pooled_when_the_body_ends(client):
    """An SSE stream is done at [DONE], but the chunked body's end may come later: the connection
    goes back to the pool when it does, and is closed when it never does."""
    ends = {"delay": 0.05}

    async def late_end(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(ends["delay"])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/s", late_end)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    origin = Origin.parse(url)
    try:
        r = await client.request("POST", url, "/s", b"{}")
        assert await r.read_some() == b"data: [DONE]\n\n"
        client.release_after_end(r)
        assert not client._idle.get(origin) and r in client._ending
        await asyncio.sleep(0.3)
        assert client._idle[origin] == [r] and not client._ending  # pooled once the end arrived
        ends["delay"] = 1.0
        r2 = await client.request("POST", url, "/s", b"{}")
        assert r2 is r  # and reused
        await r2.read_some()
        client.release_after_end(r2, timeout_s=0.2)
        await asyncio.sleep(0.5)
        assert not client._idle[origin] and not client._ending and r2.transport.is_closing()
    finally:
        await runner.cleanup()
