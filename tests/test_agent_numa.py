"""NUMA-local ranks through the agent: the placement in the OffloadPoolNode's status, and a node
this machine does not have reported there (Failed, naming it) with nothing built.

The agent is a real process against the real API server (``test_agent_process``'s world)."""

from __future__ import annotations

from typing import Any

import pytest

from fixtures.cluster import mounts_under
from fixtures.wait import wait_for
from offloadpool.region.memory.numa import online_nodes
from test_agent_process import create, env, start_agent, status  # noqa: F401  (env: the fixture)

pytestmark = pytest.mark.controlplane


def per_rank(nodes: list[int]) -> dict[str, Any]:
    return {
        "capacity": f"{16 * len(nodes)}Mi",
        "medium": "Memory",
        "layout": {"type": "PerRank", "ranks": len(nodes)},
        "prefault": {"numaNodes": nodes},
    }


def test_status_shows_each_rank_s_node(env: dict[str, Any]) -> None:  # noqa: F811
    pool, node = "numa-ranks", "node-n"
    create(env, pool, node, per_rank([0, 0, 0, 0]))
    start_agent(env, pool, node)
    st = wait_for(
        "Ready", lambda: (s := status(env, f"{pool}.{node}")).get("phase") == "Ready" and s, timeout=90
    )
    assert st["numaPlacement"] == [[0], [0], [0], [0]], st
    assert st["numaNodes"] == [0], st


def test_a_node_this_machine_lacks_fails_the_pool_before_anything_is_built(env: dict[str, Any]) -> None:  # noqa: F811
    pool, node = "numa-missing", "node-m"
    bad = max(online_nodes()) + 1
    create(env, pool, node, per_rank([0, bad]))
    start_agent(env, pool, node)
    st = wait_for(
        "Failed", lambda: (s := status(env, f"{pool}.{node}")).get("phase") == "Failed" and s, timeout=60
    )
    assert st["reason"] == "ProvisionFailed", st
    assert f"puts region 1 on node {bad}, which is not online on this node" in st["message"], st
    assert "numaPlacement" not in st, st
    assert not (env["root"] / pool).exists() and not mounts_under(env["root"])
