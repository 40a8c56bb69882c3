"""The operator's HTTP endpoints (the webhook's HTTPS server, the liveness endpoint) are bounded:
idle and stalled connections are closed after the timeout, a connection beyond the cap resets the
oldest idle one (never locking a caller out), a body beyond the cap is refused unread. Real
sockets, real TLS, kopf's own webhook request handling (``offloadpool.operator.endpoints``,
``webhook.ConfiguringWebhookServer``)."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offloadpool.operator import certs
from offloadpool.operator.endpoints import HttpBounds, liveness
from offloadpool.operator.webhook import ConfiguringWebhookServer, WebhookOptions

#: Small bounds, so that the tests see them act.
BOUNDS = HttpBounds(idle_seconds=0.5, max_connections=3, max_body_bytes=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def closed_by_server(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    """Whether the server closed the connection (end of file or reset) within ``within`` s."""
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def request(port: int, raw: bytes, tls: ssl.SSLContext | None = None) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
    writer.write(raw)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


def test_the_liveness_endpoint_answers_and_closes_idle_stalled_and_surplus_connections() -> None:
    async def run() -> None:
        port = free_port()
        runner = await liveness(f"http://127.0.0.1:{port}/healthz", BOUNDS)
        try:
            get = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            answer = await request(port, get)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"{}")
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(BOUNDS.max_connections)]
            (stalled_reader, stalled_writer) = idle[1]
            stalled_writer.write(b"GET /healthz HTTP/1.1\r\n")  # the headers never end
            # a client holding every place with idle connections locks nobody out: the next
            # connection is answered at once and the oldest idle one is reset for it
            answer = await asyncio.wait_for(request(port, get), 2)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            assert await closed_by_server(idle[0][0], within=0.3)  # at once, before the timeout
            # a stalled request is no request: with the places full again, the next connection
            # makes room by resetting it, now the oldest
            idle.append(await asyncio.open_connection("127.0.0.1", port))
            assert (await asyncio.wait_for(request(port, get), 2)).startswith(b"HTTP/1.1 200")
            assert await closed_by_server(stalled_reader, within=0.3)
            assert all([await closed_by_server(r) for r, _ in idle[2:]])  # the rest after the timeout
            assert (await request(port, get)).startswith(b"HTTP/1.1 200")  # room again
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_the_webhook_server_is_kopfs_within_the_bounds(tmp_path: Path) -> None:
    """The webhook's server answers AdmissionReviews through kopf's own handling, over the TLS
    of its certificates; a body beyond the cap is refused (413), idle connections are closed."""
    files = certs.ensure(tmp_path, ["localhost"])
    port = free_port()
    options = WebhookOptions(enabled=True, listen="127.0.0.1", port=port, url=f"https://localhost:{port}")
    server = ConfiguringWebhookServer(options, configurator=None, files=files)  # type: ignore[arg-type]
    server.bounds = BOUNDS
    tls = ssl.create_default_context(cafile=str(files.ca))
    tls.check_hostname = False
    seen: list[Any] = []

    async def fn(review: Any, **_: Any) -> Any:
        seen.append(review["request"]["uid"])
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": "u"}}

    def post(body: bytes) -> bytes:
        return (
            b"POST /mutate HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    async def run(check: Callable[[], Any]) -> None:
        serving = server._serve_bounded(fn)
        config = await anext(serving)
        assert urllib.parse.urlsplit(config["url"]).port == port
        try:
            await check()
        finally:
            await serving.aclose()

    async def checks() -> None:
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "r1"}}
        answer = await request(port, post(json.dumps(review).encode()), tls)
        assert answer.startswith(b"HTTP/1.1 200") and seen == ["r1"], answer
        big = json.dumps({**review, "pad": "x" * BOUNDS.max_body_bytes}).encode()
        assert (await request(port, post(big), tls)).startswith(b"HTTP/1.1 413")
        assert seen == ["r1"]
        reader, _ = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
        assert await closed_by_server(reader)

    asyncio.run(run(checks))
