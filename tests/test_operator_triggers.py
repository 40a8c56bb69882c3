"""What wakes a pass: changes a pass must act on, never the operator's own writes.

A pass over a pool of N nodes costs O(N); if the operator's own writes (pool status, the marks
it puts on Nodes) woke more passes, a converging pool would pay O(N) per node.
"""

from __future__ import annotations

from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.reconcile import PassResult
from offloadpool.operator.runtime import Runtime, node_change_matters
from offloadpool.operator.selection import SelectableNode

PREFIX = "offloadpool.io/"


def info(labels=None, taints=(), capacity=None) -> SelectableNode:
    cap = capacity or {}
    return SelectableNode.from_body(
        {
            "metadata": {"name": "n", "labels": labels or {}},
            "spec": {"taints": list(taints)},
            "status": {"capacity": cap, "allocatable": cap},
        },
        PREFIX,
    )


class NodeEvents:
    """One Node's successive states as the watch index reports them (before, after)."""

    def __init__(self) -> None:
        self.last: SelectableNode | None = None

    def node_changed(self, after: SelectableNode | None, _name: str) -> bool:
        before, self.last = self.last, after
        return node_change_matters(before, after)


def test_node_changes_that_wake_passes() -> None:
    rt = NodeEvents()
    assert rt.node_changed(info({"gpu": "a"}), "n")  # a new Node
    assert not rt.node_changed(info({"gpu": "a"}), "n")  # the same again
    # the operator marks it Ready (label and resource): its own write, no news
    marked = info({"gpu": "a", "pool.offloadpool.io/p": "ready"}, capacity={"offloadpool.io/p": "1"})
    assert not rt.node_changed(marked, "n")
    # a label that pools select on, a taint: news
    assert rt.node_changed(
        info({"gpu": "b", "pool.offloadpool.io/p": "ready"}, capacity={"offloadpool.io/p": "1"}), "n"
    )
    assert rt.node_changed(
        info(
            {"gpu": "b", "pool.offloadpool.io/p": "ready"},
            capacity={"offloadpool.io/p": "1"},
            taints=[{"key": "k", "effect": "NoSchedule"}],
        ),
        "n",
    )
    # a kubelet re-registering zeroes the resource: a mark lost, news
    assert rt.node_changed(
        info(
            {"gpu": "b", "pool.offloadpool.io/p": "ready"},
            capacity={"offloadpool.io/p": "0"},
            taints=[{"key": "k", "effect": "NoSchedule"}],
        ),
        "n",
    )
    # the node lifecycle controller's own taints (a node going NotReady and back): no news
    assert not rt.node_changed(
        info(
            {"gpu": "b", "pool.offloadpool.io/p": "ready"},
            capacity={"offloadpool.io/p": "0"},
            taints=[
                {"key": "k", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
            ],
        ),
        "n",
    )
    assert rt.node_changed(None, "n") and not rt.node_changed(None, "n")  # gone, once


def test_pool_changes_that_wake_passes() -> None:
    rt = Runtime(OperatorConfig())
    body = {
        "metadata": {"name": "p", "generation": 1, "finalizers": ["offloadpool.io/release"]},
        "status": {"readyNodes": 0},
    }
    assert rt.pool_changed("p", body)
    assert not rt.pool_changed("p", {**body, "status": {"readyNodes": 5}})  # its own status write
    assert rt.pool_changed("p", {**body, "metadata": {**body["metadata"], "generation": 2}})  # a new spec
    assert rt.pool_changed(
        "p",
        {
            **body,
            "metadata": {**body["metadata"], "generation": 2, "deletionTimestamp": "2026-11-30T00:00:00Z"},
        },
    )
    rt.forget("p")
    assert rt.pool_changed("p", body)  # after forget, as new


def test_passes_are_paced_by_their_own_cost() -> None:
    """A cheap pass waits only the debounce; an expensive one (a pool of thousands) waits so
    that passes use at most ``pass_cpu_share`` of a core; never longer than the cap."""
    config = OperatorConfig()
    assert config.pass_pause(0.0) == config.debounce_seconds
    assert config.pass_pause(0.001) == config.debounce_seconds  # 1 ms: 20 ms < debounce
    assert config.pass_pause(0.05) == 0.05 / config.pass_cpu_share == 1.0  # 50 ms: 1 s
    assert config.pass_pause(10.0) == config.max_pass_pause_seconds
    assert OperatorConfig(pass_cpu_share=0).pass_pause(10.0) == config.debounce_seconds


def test_a_pass_is_paced_by_what_it_computed_not_by_what_it_wrote() -> None:
    """A pass that marked a thousand Nodes spent most of its CPU writing: the next pass waits
    for the O(nodes) part only (here 50 ms: 1 s), not the cap (5 s) its whole CPU would give."""
    config = OperatorConfig()
    result = PassResult(pool="p", cpu_seconds=1.05, write_cpu_seconds=1.0)
    assert abs(result.paced_cpu_seconds - 0.05) < 1e-9
    assert abs(config.pass_pause(result.paced_cpu_seconds) - 1.0) < 1e-9
    assert config.pass_pause(result.cpu_seconds) == config.max_pass_pause_seconds
    assert PassResult(pool="p", cpu_seconds=0.1, write_cpu_seconds=0.2).paced_cpu_seconds == 0.0
