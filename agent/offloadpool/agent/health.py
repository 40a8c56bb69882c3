"""One HTTP port for /healthz, /readyz and /metrics, bounded.

The server is wsgiref's request handling under a loop of its own: /metrics is prometheus-client's
own WSGI app, so the exposition format is never hand-written. Liveness means the agent's loop is
alive; readiness means the region is Ready on this node (the DaemonSet's readiness probe, and so
the DaemonSet's numberReady, then tell the same story as the status).

The port is reachable by anything in the cluster that can reach the pod, so what a client can
hold is bounded:

- **No thread per connection.** One thread accepts and waits (``selectors``) on every open
  connection until its request arrives; only then does a worker of a fixed pool (``workers``)
  answer it. Idle connections cost a descriptor, never a thread.
- **A cap on open connections** (``max_connections``): beyond it the connection that has waited
  longest without sending anything is closed, so a new probe always gets in; when every open
  connection is being answered, the new one is closed at once.
- **A timeout** (``timeout_seconds``): a connection that sends no request for that long is closed,
  and each read and write of a request being answered gives up after it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from offloadpool.agent.config import AgentConfig

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log spam
        pass


def make_app(registry: CollectorRegistry, live: Check, ready: Check) -> Callable:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path in ("/healthz", "/livez", "/readyz"):
            ok, why = (ready if path == "/readyz" else live)()
            start_response(
                "200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain; charset=utf-8")]
            )
            return [(why + "\n").encode()]
        if path == "/metrics":
            return metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /healthz, /readyz or /metrics\n"]

    return app


class _BoundedWSGIServer(WSGIServer):
    """wsgiref's server without ``serve_forever``: ``serve`` waits on the connections itself."""

    allow_reuse_address = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[WSGIRequestHandler],
        *,
        timeout_seconds: float,
        max_connections: int,
        workers: int,
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.timeout_seconds = timeout_seconds
        self.max_connections = max_connections
        self.workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="health-http")
        self._waiting: dict[socket.socket, float] = {}  # connection -> deadline, oldest first
        self._answering = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()

    def serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.socket, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stop.is_set():
                now = time.monotonic()
                for conn, deadline in list(self._waiting.items()):
                    if deadline > now:
                        break  # deadlines grow with insertion order
                    self._drop(sel, conn)
                wait = next(iter(self._waiting.values()), now + 1.0) - now
                for key, _ in sel.select(max(0.0, min(wait, 1.0))):
                    if key.fileobj is self.socket:
                        self._accept(sel)
                    elif key.fileobj is not self._wake_r:
                        ready = key.fileobj
                        assert isinstance(ready, socket.socket)
                        sel.unregister(ready)
                        del self._waiting[ready]
                        self._dispatch(ready)
            for conn in list(self._waiting):
                self._drop(sel, conn)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, _ = self.socket.accept()
        except OSError:
            return
        with self._lock:
            answering = self._answering
        if len(self._waiting) + answering >= self.max_connections:
            if not self._waiting:
                conn.close()  # every open connection is being answered: no room
                return
            self._drop(sel, next(iter(self._waiting)))  # the one that waited longest
        self._waiting[conn] = time.monotonic() + self.timeout_seconds
        sel.register(conn, selectors.EVENT_READ)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        sel.unregister(conn)
        del self._waiting[conn]
        self.shutdown_request(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        with self._lock:
            self._answering += 1
        conn.settimeout(self.timeout_seconds)
        try:
            self.workers.submit(self._answer, conn)
        except RuntimeError:  # shutting down
            self._answered(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            address = conn.getpeername()
            self.finish_request(conn, address)
        except OSError as exc:  # a client that went away or stalled (timeout) mid-request
            log.debug("health connection ended: %s", exc)
        except Exception:
            log.exception("health request failed")
        finally:
            self._answered(conn)

    def _answered(self, conn: socket.socket) -> None:
        self.shutdown_request(conn)
        with self._lock:
            self._answering -= 1

    def stop(self) -> None:
        self._stop.set()
        self._wake_w.send(b"x")

    def server_close(self) -> None:
        super().server_close()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self._wake_r.close()
        self._wake_w.close()


class HealthServer:
    """Serves the app on ``host:port`` in a daemon thread; ``port`` 0 picks a free port.

    The bounds are the agent's settings' (``AgentConfig.http_timeout_seconds``,
    ``http_max_connections``, ``http_workers``); see the module's docstring."""

    def __init__(
        self,
        port: int,
        registry: CollectorRegistry,
        live: Check,
        ready: Check,
        host: str = AgentConfig.http_address,
        *,
        timeout_seconds: float = AgentConfig.http_timeout_seconds,
        max_connections: int = AgentConfig.http_max_connections,
        workers: int = AgentConfig.http_workers,
    ) -> None:
        self.server = _BoundedWSGIServer(
            (host, port),
            _QuietHandler,
            timeout_seconds=timeout_seconds,
            max_connections=max_connections,
            workers=workers,
        )
        self.server.set_app(make_app(registry, live, ready))
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve, name="health-http", daemon=True)

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=5)
        self.server.server_close()
