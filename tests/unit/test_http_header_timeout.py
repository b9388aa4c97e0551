"""A connection whose request head does not arrive within HEADER_READ_TIMEOUT_S is answered 408
(JSON) and closed (issue 16, item 7); a keep-alive connection idle between requests is not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from tests.unit.model_free_app import model_free_settings, served_port

SECRET = "operator-secret-0123456789"


async def _read_all(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    started = time.monotonic()
    data = b""
    while time.monotonic() - started < limit_s:
        try:
            chunk = await asyncio.wait_for(reader.read(4096), 0.2)
        except TimeoutError:
            continue
        if not chunk:
            return data, time.monotonic() - started
        data += chunk
    return data, -1.0


async def test_a_trickled_head_is_answered_408_and_closed(tmp_path) -> None:
    settings = model_free_settings(tmp_path, f"ops:operator:{SECRET}", HEADER_READ_TIMEOUT_S="1")
    async with served_port(settings) as port:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        received = [bytearray() for _ in conns]

        async def read(i: int) -> float:  # the time the server closed, -1 if it did not
            r = conns[i][0]
            t0 = time.monotonic()
            while time.monotonic() - t0 < 6:
                try:
                    chunk = await asyncio.wait_for(r.read(4096), 0.2)
                except TimeoutError:
                    continue
                except ConnectionError:
                    return time.monotonic() - t0
                if not chunk:
                    return time.monotonic() - t0
                received[i] += chunk
            return -1.0

        readers = [asyncio.create_task(read(i)) for i in range(len(conns))]
        head = b"GET /api/health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        started = time.monotonic()
        for i in range(len(head)):  # one byte every 50 ms to each connection, for up to 4 s
            for n, (_, w) in enumerate(conns):
                if not received[n] and not readers[n].done():
                    with contextlib.suppress(ConnectionError):
                        w.write(head[i : i + 1])
            await asyncio.sleep(0.05)
            if time.monotonic() - started > 4:
                break
        closed_at = await asyncio.gather(*readers)
        assert all(0 <= at <= 3 for at in closed_at), f"trickling connections stayed: {closed_at}"
        for data in received:
            assert bytes(data).startswith(b"HTTP/1.1 408 "), bytes(data[:80])
            body = json.loads(bytes(data).split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "INVALID_REQUEST"
            assert body["error"]["details"] == {"header_read_timeout_s": 1.0}
        for _, w in conns:
            w.close()


async def test_a_silent_connection_is_closed_and_an_idle_keep_alive_one_is_not(tmp_path) -> None:
    settings = model_free_settings(tmp_path, f"ops:operator:{SECRET}", HEADER_READ_TIMEOUT_S="1")
    async with served_port(settings) as port:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        data, at = await _read_all(r, 3)
        assert data == b"" and 0.5 <= at <= 2.5, (data, at)  # nothing sent: closed, no answer
        w.close()

        r, w = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n"
        w.write(request)
        first = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert first.startswith(b"HTTP/1.1 200")
        length = int(
            next(
                line.split(b":")[1]
                for line in first.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        await r.readexactly(length)
        await asyncio.sleep(1.6)  # idle between requests: the keep-alive timeout's business
        w.write(request)
        second = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert second.startswith(b"HTTP/1.1 200")
        w.close()


async def test_a_slow_but_timely_head_is_served(tmp_path) -> None:
    settings = model_free_settings(tmp_path, f"ops:operator:{SECRET}", HEADER_READ_TIMEOUT_S="3")
    async with served_port(settings) as port:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for piece in (b"GET /api/health HT", b"TP/1.1\r\nHost: x\r\n", b"\r\n"):
            w.write(piece)
            await asyncio.sleep(0.5)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        w.close()
