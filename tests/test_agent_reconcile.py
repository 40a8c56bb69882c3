"""The agent's decisions (reconcile.decide) for every lifecycle rule, and spec -> PoolRequest."""

from __future__ import annotations

import copy

import pytest

from offloadpool.agent.reconcile import Action, decide
from offloadpool.api import agent_env
from offloadpool.api.conversion import SpecError, pool_request

POOL = {
    "apiVersion": "offloadpool.io/v1alpha1",
    "kind": "OffloadPool",
    "metadata": {"name": "kv", "generation": 3, "uid": "u1"},
    "spec": {
        "capacity": "256Mi",
        "medium": "HugePages-2Mi",
        "layout": {"type": "Interleaved", "ranks": 4},
        "segments": {"maxFiles": 8, "minSize": "64Mi"},
        "prefault": {"workers": 2, "numa": "None"},
        "consumers": {"namespaces": ["inference"], "uid": 1000, "gid": 1001, "mode": "0640"},
        "reclaimPolicy": "Delete",
        "compat": {"vllm": {"engineId": "eng-1"}},
    },
}
NODE = {"metadata": {"name": "kv.n1"}, "spec": {"pool": "kv", "nodeName": "n1"}}


def pool(**meta: object) -> dict:
    p = copy.deepcopy(POOL)
    p["metadata"].update(meta)
    return p


def test_spec_becomes_the_engine_request() -> None:
    req = pool_request(POOL)
    assert (req.name, req.capacity, req.medium) == ("kv", 256 << 20, "HugePages-2Mi")
    assert (req.layout_type, req.ranks, req.max_files, req.min_segment) == ("Interleaved", 4, 8, 64 << 20)
    assert (req.workers, req.numa, req.uid, req.gid, req.mode) == (2, "None", 1000, 1001, 0o640)
    assert (req.compat_engine_id, req.generation) == ("eng-1", 3)
    assert pool_request(POOL, workers_override=5).workers == 5


def test_bad_capacity_is_a_spec_error() -> None:
    p = pool()
    p["spec"]["capacity"] = "lots"
    with pytest.raises(SpecError, match="capacity"):
        pool_request(p)


def test_no_pool_is_idle_and_no_pool_node_waits() -> None:
    assert decide(None, NODE, None).action is Action.IDLE
    assert decide(POOL, None, None).action is Action.WAIT


def test_nothing_on_the_node_provisions_the_current_generation() -> None:
    d = decide(POOL, NODE, None)
    assert d.action is Action.PROVISION and d.request.generation == 3


def test_region_at_the_current_generation_is_provisioned_again_which_reuses_it() -> None:
    assert decide(POOL, NODE, 3).action is Action.PROVISION


def test_older_region_is_replaced_when_the_rollout_allows() -> None:
    d = decide(POOL, NODE, 2)
    assert d.action is Action.PROVISION and d.pending_generation == 3
    node = copy.deepcopy(NODE)
    node["spec"]["targetGeneration"] = 3
    assert decide(POOL, node, 2).action is Action.PROVISION


def test_older_region_waits_for_the_operators_rollout() -> None:
    node = copy.deepcopy(NODE)
    node["spec"]["targetGeneration"] = 2
    d = decide(POOL, node, 2)
    assert d.action is Action.KEEP and d.pending_generation is None and d.reason == "RolloutPending"


def test_deletion_releases_or_retains_by_policy() -> None:
    deleting = pool(deletionTimestamp="2026-01-01T00:00:00Z")
    assert decide(deleting, NODE, 3).action is Action.RELEASE
    assert decide(deleting, None, None).action is Action.RELEASE  # even if the node object went first
    deleting["spec"]["reclaimPolicy"] = "Retain"
    d = decide(deleting, NODE, 3)
    assert d.action is Action.RETAIN and "Retain" in d.message


def _node(target: int) -> dict:
    node = copy.deepcopy(NODE)
    node["spec"]["targetGeneration"] = target
    return node


def test_a_pod_made_for_another_capacity_awaits_its_replacement() -> None:
    """The agent's pod limits were made for 128Mi: the pool at 256Mi (generation 3) is not
    applied by it (its limits are not the request's), over an older region or none."""
    old = agent_env.sized_for("HugePages-2Mi", 128 << 20)
    for local in (2, None):
        d = decide(POOL, _node(3), local, sized_for=old)
        assert d.action is Action.AWAIT_AGENT and d.pending_generation == 3, d
        assert d.reason == "AgentReplacementPending" and "HugePages-2Mi/134217728" in d.message, d
    # made for this request, unknown (no DaemonSet env), or the region already at it: provision
    now = agent_env.sized_for("HugePages-2Mi", 256 << 20)
    assert decide(POOL, _node(3), 2, sized_for=now).action is Action.PROVISION
    assert decide(POOL, _node(3), 2).action is Action.PROVISION
    assert decide(POOL, _node(3), 3, sized_for=old).action is Action.PROVISION
    # not this node's turn yet: keep, as before
    assert decide(POOL, _node(2), 2, sized_for=old).action is Action.KEEP
