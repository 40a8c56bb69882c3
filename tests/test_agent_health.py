"""The agent's one HTTP port: /healthz, /readyz and /metrics (prometheus-client exposition)."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import offloadpool
from offloadpool.agent.config import AgentConfig
from offloadpool.agent.health import HealthServer
from offloadpool.agent.metrics import AgentMetrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_probes_follow_the_agent_and_metrics_are_prometheus_text() -> None:
    metrics = AgentMetrics("kv", "node-a")
    state = {"ready": False}
    server = HealthServer(
        0, metrics.registry, lambda: (True, "ok"), lambda: (state["ready"], "phase X"), host="127.0.0.1"
    ).start()
    try:
        assert get(server.port, "/healthz") == (200, "ok\n")
        assert get(server.port, "/readyz")[0] == 503
        state["ready"] = True
        assert get(server.port, "/readyz")[0] == 200
        assert get(server.port, "/nothing")[0] == 404

        metrics.phase("Populating")
        metrics.progress(1, 4)
        metrics.provisioned(256 << 20, 256 << 20, 0.5, 0.5)
        metrics.phase("Ready")
        metrics.engines(2)
        metrics.error("LeaseHeld")
        status, text = get(server.port, "/metrics")
        assert status == 200
        samples = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        base = (("node", "node-a"), ("pool", "kv"))

        def value(name: str, **extra: str) -> float:
            return samples[(name, tuple(sorted((*base, *extra.items()))))]

        assert value("offloadpool_phase", offloadpool_phase="Ready") == 1.0
        assert value("offloadpool_phase", offloadpool_phase="Populating") == 0.0
        assert value("offloadpool_populated_bytes_total") == 256 << 20
        assert value("offloadpool_populate_seconds") == 0.5
        assert value("offloadpool_engines_attached") == 2
        assert value("offloadpool_agent_errors_total", reason="LeaseHeld") == 1
        assert value("offloadpool_populate_progress_ratio") == 1.0
        build = samples[("offloadpool_agent_build_info", (("version", offloadpool.__version__),))]
        assert build == 1.0
    finally:
        server.stop()


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that never send a byte (each a client's descriptor only)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def closed_by_server(conn: socket.socket, within: float = 5.0) -> bool:
    """Whether the server closed ``conn`` (end of file or reset) before ``within`` seconds."""
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_hold_no_thread_and_the_probe_still_answers() -> None:
    """The finding: 400 idle connections held 400 threads. Now they hold at most the server's
    own thread and its fixed workers, the connections beyond the cap are closed, and a probe
    made after them is answered."""
    metrics = AgentMetrics("kv", "node-a")
    server = HealthServer(
        0, metrics.registry, lambda: (True, "ok"), lambda: (True, "Ready"), host="127.0.0.1"
    )
    before = threading.active_count()
    server.start()
    conns = idle_connections(server.port, 400)
    try:
        assert get(server.port, "/healthz") == (200, "ok\n")
        assert threading.active_count() - before <= 1 + AgentConfig.http_workers
        closed = sum(closed_by_server(c, within=0.05) for c in conns[: -AgentConfig.http_max_connections])
        assert closed == 400 - AgentConfig.http_max_connections
        assert get(server.port, "/readyz") == (200, "Ready\n")
    finally:
        for c in conns:
            c.close()
        server.stop()


def test_an_idle_connection_is_closed_after_the_timeout_and_a_stalled_request_too() -> None:
    metrics = AgentMetrics("kv", "node-a")
    server = HealthServer(
        0,
        metrics.registry,
        lambda: (True, "ok"),
        lambda: (True, "Ready"),
        host="127.0.0.1",
        timeout_seconds=0.5,
    ).start()
    try:
        (idle,) = idle_connections(server.port, 1)
        (stalled,) = idle_connections(server.port, 1)
        stalled.sendall(b"GET /healthz HTTP/1.1\r\n")  # the headers never end
        assert closed_by_server(idle) and closed_by_server(stalled)
        assert get(server.port, "/healthz") == (200, "ok\n")
    finally:
        server.stop()


def test_beyond_the_cap_the_longest_idle_connection_makes_room() -> None:
    metrics = AgentMetrics("kv", "node-a")
    server = HealthServer(
        0,
        metrics.registry,
        lambda: (True, "ok"),
        lambda: (True, "Ready"),
        host="127.0.0.1",
        max_connections=3,
        workers=1,
    ).start()
    try:
        first, *rest = idle_connections(server.port, 3)
        assert not closed_by_server(first, within=0.2)
        assert get(server.port, "/healthz") == (200, "ok\n")  # a fourth connection gets in
        assert closed_by_server(first)
        assert not any(closed_by_server(c, within=0.05) for c in rest)
    finally:
        server.stop()
