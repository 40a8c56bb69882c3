"""The operator's HTTP endpoints, bounded: the webhook's HTTPS server and the liveness endpoint.

kopf serves both with aiohttp but passes none of aiohttp's bounds through: an idle or
kept-alive connection stayed open for aiohttp's default keep-alive (3,630 s), any number of them,
each holding a descriptor and a request handler. Both servers are therefore started here, on the
same aiohttp pieces kopf uses, with:

- **a timeout** (``HttpBounds.idle_seconds``): a connection that sends no (complete) request for
  this long is closed, whether it never sent one or was kept alive after one;
- **a cap on open connections** (``max_connections``): a connection beyond it makes room by
  aborting the oldest one that is not in the middle of a request (idle, kept alive, or still
  sending its headers): so a client holding the cap with idle connections never locks the API
  server out of the webhook (for HTTPS the new connection counts once its handshake is done;
  asyncio gives a handshake 60 s). The aborted connection is reset, not shut down: a TLS close
  would wait up to 30 s for the client's answer while still taking its place. Only when every
  open connection is mid-request is the new one closed as soon as it is made;
- **a cap on a request's body** (``max_body_bytes``, aiohttp's ``client_max_size``): an
  AdmissionReview carries the object and, on an update, the old one: two of the API server's
  1.5 MiB request limit, and more is refused with 413 before it is read;
- **a listen backlog** (``backlog``).

``serve`` starts one such server; ``liveness`` is kopf's own liveness answer (``{}``: the
operator has no probe handlers) on it, started by the operator's startup handler in kopf's loop.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from dataclasses import dataclass
from typing import Any

import aiohttp.web
from aiohttp.web_server import Server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpBounds:
    """What one client can hold of an operator endpoint (no flags: the defaults are the bounds)."""

    idle_seconds: float = 10.0
    """A connection that sends no complete request for this long is closed (aiohttp's
    ``keepalive_timeout``: from the connection's start, and again after each answer). The API
    server's webhook calls time out after at most 30 s, the kubelet's probes after 1 s."""
    max_connections: int = 64
    """Open connections at most; one beyond it aborts the oldest that is not mid-request (closed
    at once itself only when all are)."""
    max_body_bytes: int = 3 << 20
    """The largest request body read (aiohttp's ``client_max_size``); larger: 413."""
    backlog: int = 64
    """Connections the kernel queues before they are accepted."""


class _Refused(asyncio.Protocol):
    """What a connection beyond the cap gets: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _CappedServer:
    """aiohttp's protocol factory (``web_server.Server``), keeping at most ``cap`` connections."""

    def __init__(self, server: Server, cap: int) -> None:
        self._server = server
        self._cap = cap
        self.refused = 0
        self.evicted = 0

    def __call__(self) -> asyncio.Protocol:
        # a handler whose transport is gone is closing (aiohttp drops it at connection_lost)
        live = [c for c in self._server.connections if c.transport is not None]
        if len(live) >= self._cap:
            # aiohttp's own flag: a complete request is being handled (``RequestHandler``);
            # connections are listed in the order they were made, so the first idle is the oldest
            idle = next((c for c in live if not c._request_in_progress), None)
            if idle is None:
                self.refused += 1
                return _Refused()
            transport = idle.transport
            assert transport is not None
            transport.abort()  # reset now: a TLS shutdown would keep the place up to 30 s
            idle.force_close()
            self.evicted += 1
        return self._server()

    def __getattr__(self, name: str) -> Any:  # shutdown, connections, ...: the server's
        return getattr(self._server, name)


class BoundedRunner(aiohttp.web.AppRunner):
    """An ``AppRunner`` whose server closes idle connections and keeps at most the cap open."""

    def __init__(self, app: aiohttp.web.Application, bounds: HttpBounds, **kwargs: Any) -> None:
        super().__init__(app, handle_signals=False, keepalive_timeout=bounds.idle_seconds, **kwargs)
        self.bounds = bounds

    async def _make_server(self) -> Any:
        return _CappedServer(await super()._make_server(), self.bounds.max_connections)


async def serve(
    app: aiohttp.web.Application,
    host: str | None,
    port: int,
    bounds: HttpBounds,
    *,
    ssl_context: Any = None,
    reuse_port: bool = False,
) -> BoundedRunner:
    """Serve ``app`` on ``host:port`` (None: every address) within ``bounds``; the caller
    ``await runner.cleanup()`` to stop. ``app`` must have been made by ``application``."""
    runner = BoundedRunner(app, bounds, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = aiohttp.web.TCPSite(
            runner,
            host,
            port,
            ssl_context=ssl_context,
            backlog=bounds.backlog,
            reuse_address=True,
            reuse_port=reuse_port,
        )
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def application(bounds: HttpBounds) -> aiohttp.web.Application:
    """An aiohttp application that reads no request body larger than ``bounds`` allow."""
    return aiohttp.web.Application(client_max_size=bounds.max_body_bytes)


async def liveness(endpoint: str, bounds: HttpBounds) -> BoundedRunner:
    """Answer ``GET <path>`` of ``http://host:port/path`` with ``{}`` (kopf's liveness answer for
    an operator without probe handlers): the operator's event loop is alive."""
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme != "http" or parts.port is None:
        raise ValueError(f"--liveness {endpoint!r}: want http://HOST:PORT/PATH")

    async def healthy(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({})

    app = application(bounds)
    app.add_routes([aiohttp.web.get(parts.path or "/", healthy)])
    runner = await serve(app, parts.hostname or None, parts.port, bounds)
    log.debug("serving liveness at %s", endpoint)
    return runner
