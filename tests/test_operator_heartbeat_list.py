"""When a pass lists the agents' heartbeat Leases again: only when a node is stale by the last
list (and that list is old enough), since a renewTime only moves forward and an older list can
only take a live agent for a silent one.

The reconciler runs in this process against the real API server, with the operator's own
watched indexes; the Lease is renewed by the agent's own code. The one thing added is a count
of the Lease lists the reconciler makes (the real calls still go out).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from fixtures.reconciler_world import create_pool_over, remove_pool_over, report_ready, start_indexes
from fixtures.wait import wait_for
from offloadpool.agent.kube import KubeAccess
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.events import Event
from offloadpool.operator.kube import Kube
from offloadpool.operator.pool_node_report import PoolNodeReport
from offloadpool.operator.reconcile import Reconciler, heartbeat_list_max_age

pytestmark = pytest.mark.controlplane

TIMEOUT = 6.0
CONFIG = OperatorConfig(namespace="default", heartbeat_timeout_seconds=TIMEOUT, resync_seconds=2)


class CountingKube(Kube):
    lists = 0

    def list_agent_heartbeats(self, namespace: str, pool: str) -> Any:
        self.lists += 1
        return super().list_agent_heartbeats(namespace, pool)


def test_leases_are_listed_again_only_when_a_node_is_stale_by_the_last_list(crds_installed: Any) -> None:
    assert heartbeat_list_max_age(CONFIG) == 1.0
    api = crds_installed.api_client()
    kube = CountingKube(api)
    tag = uuid.uuid4().hex[:6]
    node, pool = f"lease-list-{tag}", f"lease-{tag}"
    nodes, objects = start_indexes(kube)
    events: list[Event] = []
    reconciler = Reconciler(kube, CONFIG, lambda _pool, event: events.append(event), nodes, objects)
    try:
        body = create_pool_over(kube, pool, [node], "lease-list", tag)
        # Ready, with a status heartbeat long past: the Lease alone says the agent is alive
        report_ready(kube.custom, body, [node], heartbeat="2020-01-01T00:00:00Z")
        agent = KubeAccess(api, pool, f"{pool}.{node}", "default")
        wait_for("indexed", lambda: (objects.group(pool).get(node) or PoolNodeReport(node)).phase == "Ready")

        def ready() -> int:
            result = reconciler.run(pool)
            assert result is not None
            return int(result.status["readyNodes"])

        renewed0 = time.monotonic()
        agent.renew_heartbeat(40, body)
        assert (ready(), kube.lists) == (1, 1), "the first pass lists"

        time.sleep(1.5)  # the list is older than heartbeat_list_max_age, but nobody is stale by it
        assert (ready(), kube.lists) == (1, 1), "listed again though no node was stale by the last list"

        agent.renew_heartbeat(40, body)
        renewed1 = time.monotonic()
        time.sleep(max(0.0, renewed0 + TIMEOUT + 0.3 - time.monotonic()))
        assert (ready(), kube.lists) == (1, 2), (
            "stale by the last list: listed again, and live by the new one"
        )

        time.sleep(max(0.0, renewed1 + TIMEOUT + 0.3 - time.monotonic()))
        assert (ready(), kube.lists) == (0, 3), "no renewal for longer than the timeout: unresponsive"
        assert ready() == 0 and kube.lists == 3, "a stale node made a list sooner than heartbeat_list_max_age"
    finally:
        nodes.stop()
        objects.stop()
        remove_pool_over(kube, pool, [node])
        api.close()
