"""Pool status aggregation and rollout planning: pure functions, no cluster needed."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from offloadpool.operator import agentpods
from offloadpool.operator.aggregate import MAX_FAILING_NODES, aggregate
from offloadpool.operator.events import transitions
from offloadpool.operator.pool_node_report import PoolNodeReport
from offloadpool.operator.rollout import plan

NOW = datetime(2026, 11, 29, 16, 0, tzinfo=timezone.utc)
GiB = 1 << 30


def ready(node: str, gen: int = 1, **kw) -> PoolNodeReport:
    return PoolNodeReport(
        node=node,
        phase="Ready",
        observed_generation=gen,
        target_generation=gen,
        bytes_total=GiB,
        heartbeat=NOW,
        **kw,
    )


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_all_ready_is_ready():
    views = {n: ready(n) for n in ("a", "b", "c")}
    agg = aggregate(generation=1, selected=views, views=views, now=NOW)
    s = agg.status
    assert (s["phase"], s["desiredNodes"], s["readyNodes"], s["failedNodes"], s["pendingNodes"]) == (
        "Ready",
        3,
        3,
        0,
        0,
    )
    assert s["totalBytes"] == 3 * GiB and s["failingNodes"] == []
    c = conds(s)
    assert (
        c["Ready"]["status"] == "True"
        and c["Progressing"]["reason"] == "Complete"
        and c["Degraded"]["status"] == "False"
    )
    assert agg.ready_nodes == {"a", "b", "c"}


def test_failed_node_degrades_and_names_the_shortfall():
    views = {
        "a": ready("a"),
        "b": PoolNodeReport(
            node="b",
            phase="Failed",
            reason="InsufficientHugePages",
            message="needs 512 pages of 2Mi, 100 free",
            observed_generation=1,
        ),
    }
    views["c"] = PoolNodeReport(node="c", phase="Populating", progress=40, heartbeat=NOW)
    s = aggregate(generation=1, selected=["a", "b", "c", "d"], views=views, now=NOW).status
    assert (s["phase"], s["readyNodes"], s["failedNodes"], s["pendingNodes"]) == ("Degraded", 1, 1, 2)
    failing = {f["node"]: f for f in s["failingNodes"]}
    assert [f["node"] for f in s["failingNodes"]] == ["b", "d", "c"]  # failures first
    assert failing["b"]["reason"] == "InsufficientHugePages" and "512 pages" in failing["b"]["message"]
    assert failing["d"]["reason"] == "AgentNotReporting"
    assert failing["c"]["message"] == "Populating 40%"
    c = conds(s)
    assert c["Degraded"]["status"] == "True" and "b" in c["Degraded"]["message"]
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "Provisioning"


def test_stale_heartbeat_is_not_ready():
    views = {
        "a": ready("a"),
        "b": PoolNodeReport(
            node="b", phase="Ready", observed_generation=1, heartbeat=NOW - timedelta(hours=1)
        ),
    }
    agg = aggregate(generation=1, selected=views, views=views, now=NOW, heartbeat_timeout=60)
    assert agg.ready_nodes == {"a"} and agg.status["phase"] == "Degraded"
    assert conds(agg.status)["Degraded"]["reason"] == "AgentsUnresponsive"
    # timeout 0 disables the check
    assert aggregate(generation=1, selected=views, views=views, now=NOW).ready_nodes == {"a", "b"}


def test_held_node_is_ready_but_pending():
    views = {"a": ready("a", 2), "b": ready("b", 1, pending_generation=2, reason="LeaseHeld")}
    s = aggregate(generation=2, selected=views, views=views, now=NOW).status
    assert (s["phase"], s["readyNodes"], s["pendingNodes"]) == ("Ready", 2, 1)
    c = conds(s)["Progressing"]
    assert (c["status"], c["reason"]) == ("True", "RolloutPending") and "b" in c["message"]


def test_progressing_is_never_complete_while_a_node_has_not_applied_the_generation():
    """A node held by an engine still has the change to apply (Progressing True,
    RolloutPending); a Failed node that the rollout did not halt on is not "Complete" either."""
    held = {"a": ready("a", 1, pending_generation=2, reason="LeaseHeld")}
    c = conds(aggregate(generation=2, selected=held, views=held, now=NOW).status)["Progressing"]
    assert (c["status"], c["reason"]) == ("True", "RolloutPending"), c
    failed = {
        "a": ready("a", 2),
        "b": PoolNodeReport(node="b", phase="Failed", observed_generation=2, reason="InsufficientMemory"),
    }
    s = aggregate(generation=2, selected=failed, views=failed, now=NOW).status
    c = conds(s)["Progressing"]
    assert (c["status"], c["reason"]) == ("False", "NodesFailed") and "b" in c["message"], c
    assert conds(s)["Degraded"]["reason"] == "NodesFailed"


def test_transition_time_kept_when_status_unchanged():
    views = {"a": ready("a")}
    first = aggregate(generation=1, selected=views, views=views, now=NOW).status
    later = aggregate(
        generation=1,
        selected=views,
        views=views,
        now=NOW + timedelta(minutes=5),
        previous_conditions=first["conditions"],
    ).status
    assert later == first


def test_deleting_waits_for_unreleased_existing_nodes():
    views = {
        "a": PoolNodeReport(node="a", phase="Released"),
        "b": PoolNodeReport(node="b", phase="Draining", reason="LeaseHeld", engines_attached=1),
        "gone": PoolNodeReport(node="gone", phase="Ready"),
    }
    agg = aggregate(
        generation=1, selected=["a", "b"], views=views, now=NOW, deleting=True, existing_nodes=["a", "b"]
    )
    assert agg.unreleased_nodes == ("b",) and agg.ready_nodes == frozenset()
    assert agg.status["phase"] == "Deleting"
    assert "b (Draining: LeaseHeld, 1 engine(s) attached)" in conds(agg.status)["Ready"]["message"]
    assert agg.status["failingNodes"][0]["node"] == "b"


def test_deleting_names_what_holds_the_memory_in_the_nodes_words():
    """The node's message (a process, a CSI volume's pod) goes into the pool's wait, so the
    pool's deletion names the pod that holds it."""
    said = "release waits: pool held by 1 attached engine: csi volume csi-1 of pod team-a/engine-0 (uid u)"
    b = PoolNodeReport(node="b", phase="Draining", reason="LeaseHeld", engines_attached=1, message=said)
    views = {"b": b}
    agg = aggregate(generation=1, selected=["b"], views=views, now=NOW, deleting=True, existing_nodes=["b"])
    for ctype in ("Ready", "Progressing"):
        message = conds(agg.status)[ctype]["message"]
        assert "b (Draining: LeaseHeld, 1 engine(s) attached; release waits" in message, message
        assert "of pod team-a/engine-0" in message and len(message) <= 1024, message
    assert "of pod team-a/engine-0" in agg.status["failingNodes"][0]["message"]


def test_deleting_skips_nodes_where_no_agent_ever_ran_and_says_what_it_waits_for_elsewhere():
    """A node whose agent never ran (``never_ran``: no status, no Lease, its pod never placed)
    holds nothing: the deletion does not wait for it, and says so. A node without a status whose
    agent may have run is still waited for, saying that memory may be there."""
    views = {"vm": PoolNodeReport(node="vm"), "b": PoolNodeReport(node="b")}
    agg = aggregate(
        generation=1,
        selected=["vm", "b"],
        views=views,
        now=NOW,
        deleting=True,
        existing_nodes=["vm", "b"],
        never_ran=["vm"],
    )
    assert agg.unreleased_nodes == ("b",)
    message = conds(agg.status)["Ready"]["message"]
    assert (
        "deletion waits for 1 node(s) to release the memory: b (no status from its agent yet; it may"
        in message
    )
    assert "nothing to release on 1 node(s) where no agent ever ran: vm" in message, message
    done = aggregate(
        generation=1,
        selected=["vm"],
        views={"vm": views["vm"]},
        now=NOW,
        deleting=True,
        existing_nodes=["vm"],
        never_ran=["vm"],
    )
    assert done.unreleased_nodes == () and conds(done.status)["Progressing"]["reason"] == "Released"
    assert "where no agent ever ran: vm" in conds(done.status)["Progressing"]["message"]


def _agent_pod(node: str, bound: bool = False, **status) -> dict:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    spec = {
        "affinity": {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
        }
    }
    if bound:
        spec["nodeName"] = node
    return {"metadata": {"name": f"agent-{node}"}, "spec": spec, "status": status}


def test_agent_pods_that_never_ran_a_container_are_told_apart():
    waiting = {"name": "agent", "state": {"waiting": {"reason": "ImagePullBackOff"}}, "restartCount": 0}
    running = {"name": "agent", "state": {"running": {}}, "restartCount": 0}
    restarted = {**waiting, "restartCount": 1, "lastState": {"terminated": {"exitCode": 1}}}
    pods = [
        _agent_pod(
            "unplaced", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
        ),
        _agent_pod("pulling", bound=True, containerStatuses=[waiting]),
        _agent_pod("running", bound=True, containerStatuses=[running]),
        _agent_pod("restarted", bound=True, containerStatuses=[restarted]),
        _agent_pod("silent-kubelet", bound=True),
        # an old pod that ran and a new one that cannot be placed: it ran there
        _agent_pod("replaced", bound=True, containerStatuses=[running]),
        _agent_pod("replaced"),
    ]
    assert agentpods.never_ran(pods) == {"unplaced", "pulling"}

    views = {"a": ready("a"), "b": PoolNodeReport(node="b", phase="Populating")}
    s1 = aggregate(generation=1, selected=views, views=views, now=NOW).status
    first = transitions(None, s1)
    assert {e.reason for e in first} == {"NodesNotReady", "Provisioning"}
    views["b"] = ready("b")
    s2 = aggregate(
        generation=1, selected=views, views=views, now=NOW, previous_conditions=s1["conditions"]
    ).status
    reasons = {(e.type, e.reason) for e in transitions(s1, s2)}
    assert ("Normal", "AllNodesReady") in reasons and ("Normal", "Complete") in reasons
    assert transitions(s2, s2) == []
    views["b"] = PoolNodeReport(node="b", phase="Failed", reason="InsufficientMemory", message="short by 1Gi")
    s3 = aggregate(generation=1, selected=views, views=views, now=NOW, previous_conditions=s2["conditions"])
    reasons = {(e.type, e.reason) for e in transitions(s2, s3.status, s3.failed_nodes)}
    assert ("Warning", "NodeFailed") in reasons and ("Warning", "NodesFailed") in reasons


def test_rollout_one_serving_node_at_a_time():
    views = {n: ready(n, 1) for n in ("a", "b", "c")}
    views["d"] = PoolNodeReport(node="d", phase="Failed", target_generation=1)
    step = plan(2, views, views, now=NOW)
    assert [(a.node, a.serving) for a in step.advance] == [("d", False), ("a", True)]
    # a in flight (annotated, not yet Ready at 2): nothing more
    views["a"] = PoolNodeReport(
        node="a", phase="Provisioning", target_generation=2, rollout_generation=2, observed_generation=1
    )
    views["d"] = PoolNodeReport(node="d", phase="Provisioning", target_generation=2)
    assert plan(2, views, views, now=NOW).advance == () and plan(2, views, views, now=NOW).in_flight == ("a",)
    # a held by an engine: skipped, b goes
    views["a"] = ready("a", 1, pending_generation=2, reason="LeaseHeld", rollout_generation=2)
    views["a"] = PoolNodeReport(**{**views["a"].__dict__, "target_generation": 2})
    assert [x.node for x in plan(2, views, views, now=NOW).advance] == ["b"]
    # waiting for its turn (agent says RolloutPending) is NOT held
    views["a"] = PoolNodeReport(**{**views["a"].__dict__, "reason": "RolloutPending"})
    assert plan(2, views, views, now=NOW).advance == ()


def test_rollout_halts_on_failure_of_a_node_that_was_serving():
    views = {
        "a": PoolNodeReport(
            node="a", phase="Failed", target_generation=2, rollout_generation=2, observed_generation=2
        ),
        "b": ready("b", 1),
    }
    step = plan(2, views, views, now=NOW)
    assert step.advance == () and step.halted == ("a",)
    s = aggregate(generation=2, selected=views, views=views, now=NOW).status
    assert conds(s)["Progressing"]["reason"] == "RolloutHalted"


phases = st.sampled_from(
    [None, "Pending", "Provisioning", "Populating", "Ready", "Draining", "Released", "Failed"]
)


@st.composite
def pools(draw):
    names = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=0, max_size=40, unique=True))
    gen = draw(st.integers(1, 4))
    views = {}
    for n in names:
        if draw(st.booleans()):
            views[n] = PoolNodeReport(
                node=n,
                phase=draw(phases),
                observed_generation=draw(st.integers(1, gen)),
                target_generation=draw(st.integers(1, gen)),
                bytes_total=draw(st.integers(0, 4 * GiB)),
                heartbeat=NOW - timedelta(seconds=draw(st.integers(0, 600))),
                pending_generation=draw(st.one_of(st.none(), st.just(gen))),
                reason=draw(st.sampled_from([None, "LeaseHeld", "RolloutPending"])),
                rollout_generation=draw(st.one_of(st.none(), st.just(gen))),
            )
    selected = [n for n in names if draw(st.booleans()) or n in views]
    return gen, selected, views


@settings(max_examples=300, deadline=None)
@given(pools(), st.sampled_from([0, 120]))
def test_counts_are_consistent(pool, timeout):
    gen, selected, views = pool
    agg = aggregate(generation=gen, selected=selected, views=views, now=NOW, heartbeat_timeout=timeout)
    s = agg.status
    assert s["desiredNodes"] == len(set(selected))
    assert s["readyNodes"] + s["failedNodes"] <= s["desiredNodes"]
    assert s["readyNodes"] <= s["desiredNodes"] - s["failedNodes"]
    assert s["pendingNodes"] <= s["desiredNodes"] - s["failedNodes"]
    assert len(s["failingNodes"]) == min(MAX_FAILING_NODES, s["desiredNodes"] - s["readyNodes"])
    assert (s["phase"] == "Ready") == (
        s["desiredNodes"] > 0 and s["readyNodes"] == s["desiredNodes"] and s["failedNodes"] == 0
    )
    assert {c["type"] for c in s["conditions"]} == {"Ready", "Progressing", "Degraded"}
    assert agg.ready_nodes <= set(selected)
    step = plan(gen, views, selected, now=NOW, heartbeat_timeout=timeout)
    assert sum(a.serving for a in step.advance) <= 1
    assert not (step.in_flight and any(a.serving for a in step.advance))
    assert {a.node for a in step.advance} <= set(selected)


def test_node_marks_follow_readiness() -> None:
    from offloadpool.operator.nodes import label_patch, marks_patch, resource_patch
    from offloadpool.operator.selection import SelectableNode

    def node(labels=None, capacity=None, allocatable=None) -> SelectableNode:
        return SelectableNode.from_body(
            {
                "metadata": {"name": "n", "labels": labels or {}},
                "status": {"capacity": capacity or {}, "allocatable": allocatable or {}},
            },
            "offloadpool.io/",
        )

    bare = node()
    assert label_patch("p", bare, True) == {
        "metadata": {"labels": {"pool.offloadpool.io/p": "ready", "node.offloadpool.io/pools": "true"}}
    }
    assert resource_patch("p", bare, True) == {
        "status": {"capacity": {"offloadpool.io/p": "1"}, "allocatable": {"offloadpool.io/p": "1"}}
    }
    assert label_patch("p", bare, False) is None and resource_patch("p", bare, False) is None
    both = {"pool.offloadpool.io/p": "ready", "node.offloadpool.io/pools": "true"}
    marked = node(both, {"offloadpool.io/p": "1"}, {"offloadpool.io/p": "1"})
    assert label_patch("p", marked, True) is None and resource_patch("p", marked, True) is None
    assert resource_patch("p", marked, False) == {
        "status": {"capacity": {"offloadpool.io/p": None}, "allocatable": {"offloadpool.io/p": None}}
    }
    # a kubelet that re-registered the node zeroed the resource: advertise it again
    zeroed = node(both, {"offloadpool.io/p": "0"}, {"offloadpool.io/p": "0"})
    assert resource_patch("p", zeroed, True) is not None
    # both marks in one status patch, or none
    assert marks_patch("p", bare, True) == {
        "metadata": {"labels": {"pool.offloadpool.io/p": "ready", "node.offloadpool.io/pools": "true"}},
        "status": {"capacity": {"offloadpool.io/p": "1"}, "allocatable": {"offloadpool.io/p": "1"}},
    }
    assert marks_patch("p", marked, True) is None and marks_patch("p", bare, False) is None
    assert marks_patch("p", zeroed, True) == resource_patch("p", zeroed, True)


def test_every_node_with_a_ready_pool_carries_the_one_fixed_label() -> None:
    """node.offloadpool.io/pools: set with any pool's label (also on a node marked before the
    label existed), removed with the last pool label, kept while another pool is Ready there."""
    from offloadpool.api.constants import POOL_NODE_LABEL, POOL_NODE_VALUE, pool_label_key
    from offloadpool.operator.nodes import label_patch
    from offloadpool.operator.selection import SelectableNode

    def node(*pools: str, fixed: bool = True) -> SelectableNode:
        labels = {pool_label_key(p): "ready" for p in pools} | (
            {POOL_NODE_LABEL: POOL_NODE_VALUE} if fixed else {}
        )
        return SelectableNode.from_body(
            {"metadata": {"name": "n", "labels": labels}, "status": {}}, "offloadpool.io/"
        )

    assert label_patch("p", node("p", fixed=False), True) == {
        "metadata": {"labels": {POOL_NODE_LABEL: "true"}}
    }
    assert label_patch("q", node("p"), True) == {"metadata": {"labels": {pool_label_key("q"): "ready"}}}
    assert label_patch("p", node("p", "q"), False) == {"metadata": {"labels": {pool_label_key("p"): None}}}
    assert label_patch("p", node("p"), False) == {
        "metadata": {"labels": {pool_label_key("p"): None, POOL_NODE_LABEL: None}}
    }


def test_selection_follows_the_daemonset_controller() -> None:
    from offloadpool.operator.selection import SelectableNode, selects

    gpu = SelectableNode(
        "g",
        {"gpu": "h100"},
        (
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
            {"key": "soft", "effect": "PreferNoSchedule"},
        ),
    )
    assert not selects({"nodeSelector": {"gpu": "h100"}}, gpu)  # taint not tolerated
    assert selects(
        {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
        gpu,
    )
    assert selects({"tolerations": [{"key": "nvidia.com/gpu", "value": "present"}]}, gpu)
    assert not selects({"tolerations": [{"key": "nvidia.com/gpu", "value": "other"}]}, gpu)
    assert not selects(
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}]}, gpu
    )
    assert selects({"tolerations": [{"operator": "Exists"}]}, gpu)
    assert not selects({"nodeSelector": {"gpu": "a100"}, "tolerations": [{"operator": "Exists"}]}, gpu)


def test_a_node_with_no_agent_at_work_is_named_by_its_cause_not_provisioning():
    """A node whose agent pod the scheduler cannot place reads AgentUnschedulable with the
    scheduler's words; one whose agent said Provisioning and went silent reads
    AgentUnresponsive; neither counts as provisioning, so with no other node at work the pool
    is Stalled and Degraded."""
    why = "Unschedulable: 0/3 nodes are available: 1 Insufficient hugepages-2Mi."
    views = {
        "a": ready("a"),
        "c": PoolNodeReport(node="c", phase="Provisioning", heartbeat=NOW - timedelta(minutes=5)),
    }
    s = aggregate(
        generation=1,
        selected=["a", "b", "c"],
        views=views,
        now=NOW,
        heartbeat_timeout=60,
        unschedulable={"b": why},
    ).status
    failing = {f["node"]: f for f in s["failingNodes"]}
    assert [f["node"] for f in s["failingNodes"]] == ["b", "c"]  # the scheduler's refusal first
    assert failing["b"] == {
        "node": "b",
        "reason": "AgentUnschedulable",
        "message": f"the agent pod cannot be scheduled: {why}",
    }
    assert (
        failing["c"]["reason"] == "AgentUnresponsive"
        and "it last said Provisioning" in failing["c"]["message"]
    )
    c = conds(s)
    assert s["phase"] == "Degraded"
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "Stalled")
    assert "b (AgentUnschedulable), c (AgentUnresponsive)" in c["Progressing"]["message"]
    assert (
        c["Degraded"]["reason"] == "AgentsUnschedulable"
        and "Insufficient hugepages-2Mi" in c["Degraded"]["message"]
    )

    # another node still at work: Provisioning, naming the stalled ones beside it
    views["d"] = PoolNodeReport(node="d", phase="Populating", progress=10, heartbeat=NOW)
    s = aggregate(
        generation=1,
        selected=["a", "b", "c", "d"],
        views=views,
        now=NOW,
        heartbeat_timeout=60,
        unschedulable={"b": why},
    ).status
    prog = conds(s)["Progressing"]
    assert prog["reason"] == "Provisioning" and prog["message"].startswith("provisioning on 1 node(s): d;"), (
        prog
    )

    # a pod the scheduler refused, but an agent reporting live (a replaced pod's predecessor
    # still running): the agent's own word stands
    views["b"] = PoolNodeReport(node="b", phase="Populating", progress=50, heartbeat=NOW)
    s = aggregate(
        generation=1, selected=["b"], views=views, now=NOW, heartbeat_timeout=60, unschedulable={"b": why}
    ).status
    assert s["failingNodes"][0]["reason"] == "Populating" and s["phase"] == "Progressing"
