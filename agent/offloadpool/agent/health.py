"""One HTTP port for /healthz, /readyz and /metrics.

The server is wsgiref's, made threading so a slow scrape never blocks a probe; /metrics is
prometheus-client's own WSGI app, so the exposition format is never hand-written. Liveness means
the agent's loop is alive; readiness means the region is Ready on this node (the DaemonSet's
readiness probe, and so the DaemonSet's numberReady, then tell the same story as the status).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

Check = Callable[[], tuple[bool, str]]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


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


class HealthServer:
    """Serves the app on ``host:port`` in a daemon thread; ``port`` 0 picks a free port."""

    def __init__(
        self, port: int, registry: CollectorRegistry, live: Check, ready: Check, host: str = "0.0.0.0"
    ) -> None:
        self.server = make_server(
            host,
            port,
            make_app(registry, live, ready),
            server_class=_ThreadingWSGIServer,
            handler_class=_QuietHandler,
        )
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, name="health-http", daemon=True)

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
