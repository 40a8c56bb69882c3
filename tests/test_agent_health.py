"""The agent's one HTTP port: /healthz, /readyz and /metrics (prometheus-client exposition)."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

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
    finally:
        server.stop()
