"""The operator as a real process against the real API server and controller manager.

Agents are played by the test: it writes OffloadPoolNode statuses through the status
subresource with the agent ServiceAccount's token, exactly as an agent does. (The end-to-end
tests with real agent processes are in test_e2e_*.)
"""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from fixtures.operator_process import QUICK_PASSES, OperatorProcess
from fixtures.operator_world import MERGE, NAMESPACE, MiB, World, dump
from fixtures.wait import wait_for
from offloadpool.api.base import format_time, now
from offloadpool.api.constants import FINALIZER, GROUP, POOL_PLURAL, VERSION

pytestmark = [pytest.mark.controlplane, pytest.mark.operator_args(*QUICK_PASSES)]


def conds(pool: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (pool.get("status") or {}).get("conditions", [])}


def status(w: World, pool: str) -> dict:
    return (w.pool(pool) or {}).get("status") or {}


def test_pool_lifecycle(world: World, offloadpool_operator: OperatorProcess) -> None:
    w = world
    group = w.name("g")
    nodes = [w.add_node(f"n{i}", {"offloadpool-test/group": group}) for i in range(3)]
    outsider = w.add_node("n3", {"offloadpool-test/group": "other"})
    pool = w.create_pool(
        "life", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )

    # One OffloadPoolNode per selected Node (3 of 4), owned by the pool, at generation 1.
    objs = wait_for("3 OffloadPoolNodes", lambda: (lambda o: o if len(o) == 3 else None)(w.pool_nodes(pool)))
    assert set(objs) == set(nodes), dump(objs)
    uid = w.pool(pool)["metadata"]["uid"]
    for obj in objs.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert obj["spec"].get("targetGeneration") == 1, (
            "spec.targetGeneration did not survive: the OffloadPoolNode CRD must declare it "
            "(integer, optional) or the API server prunes it and node-by-node rollout cannot work",
            obj["spec"],
        )
    assert FINALIZER in w.pool(pool)["metadata"]["finalizers"]
    ds = w.apps.read_namespaced_daemon_set(f"offloadpool-agent-{pool}", NAMESPACE)
    assert ds.metadata.owner_references[0].uid == uid

    # Nothing reported yet: Progressing, 0/3, every node listed as not reporting.
    st = wait_for(
        "status 0/3", lambda: (lambda s: s if s.get("desiredNodes") == 3 else None)(status(w, pool))
    )
    assert (st["phase"], st["readyNodes"]) == ("Progressing", 0)
    assert {f["reason"] for f in st["failingNodes"]} == {"AgentNotReporting"}

    # Agents report Ready -> Ready 3/3, nodes labelled and advertising the resource.
    for n in nodes:
        w.report_ready(pool, n)
    st = wait_for(
        "pool Ready 3/3", lambda: (lambda s: s if s.get("phase") == "Ready" else None)(status(w, pool))
    )
    assert (st["desiredNodes"], st["readyNodes"], st["failedNodes"], st["pendingNodes"]) == (3, 3, 0, 0)
    assert st["totalBytes"] == 3 * 64 * MiB and st["observedGeneration"] == 1
    c = conds(w.pool(pool))
    assert (c["Ready"]["status"], c["Progressing"]["reason"], c["Degraded"]["status"]) == (
        "True",
        "Complete",
        "False",
    )
    for n in nodes:
        wait_for(f"{n} labelled and advertising", lambda n=n: w.marked(pool, n) == (True, True))
        assert w.node(n).status.allocatable[f"offloadpool.io/{pool}"] == "1"
    assert w.marked(pool, outsider) == (False, False)
    wait_for("AllNodesReady event", lambda: "AllNodesReady" in w.event_reasons(pool))
    out = w.cp.kubectl("get", "offloadpools", pool).stdout
    assert "Ready" in out.splitlines()[1] and " 3 " in out.splitlines()[1], out
    out = w.cp.kubectl("get", "offloadpoolnodes").stdout
    assert all(f"{pool}.{n}" in out for n in nodes), out

    # One node fails: Degraded, the reason names the shortfall, label and resource withdrawn.
    w.report(
        pool,
        nodes[1],
        phase="Failed",
        reason="InsufficientHugePages",
        message="needs 32 pages of 2Mi, node has 0 free",
    )
    st = wait_for(
        "Degraded", lambda: (lambda s: s if s.get("phase") == "Degraded" else None)(status(w, pool))
    )
    assert (st["readyNodes"], st["failedNodes"]) == (2, 1)
    assert st["failingNodes"] == [
        {
            "node": nodes[1],
            "reason": "InsufficientHugePages",
            "message": "needs 32 pages of 2Mi, node has 0 free",
        }
    ]
    wait_for("failed node unmarked", lambda: w.marked(pool, nodes[1]) == (False, False))
    wait_for("NodeFailed event", lambda: "NodeFailed" in w.event_reasons(pool))

    # A Node is deleted: its OffloadPoolNode goes, counts adjust.
    w.core.delete_node(nodes[2])
    wait_for(
        "OffloadPoolNode of the deleted node gone", lambda: set(w.pool_nodes(pool)) == {nodes[0], nodes[1]}
    )
    wait_for("desired 2", lambda: status(w, pool).get("desiredNodes") == 2)

    # Deletion waits while a node has not released, and says why.
    w.report(pool, nodes[1], phase="Released", reason="Released", message="memory freed")
    w.report(
        pool,
        nodes[0],
        phase="Draining",
        reason="LeaseHeld",
        message="1 engine holds the lease",
        enginesAttached=1,
    )
    w.custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)
    st = wait_for(
        "Deleting status", lambda: (lambda s: s if s.get("phase") == "Deleting" else None)(status(w, pool))
    )
    ready_c = conds(w.pool(pool))["Ready"]
    assert (
        ready_c["reason"] == "Deleting"
        and nodes[0] in ready_c["message"]
        and "LeaseHeld" in ready_c["message"]
    ), ready_c
    assert [f["node"] for f in st["failingNodes"]] == [nodes[0]]
    wait_for("node unmarked while deleting", lambda: w.marked(pool, nodes[0]) == (False, False))
    wait_for(
        "an Event saying why",
        lambda: any(nodes[0] in (e.message or "") and e.type == "Warning" for e in w.events(pool)),
    )
    assert w.pool(pool) is not None  # still held by the finalizer

    # The engine lets go: Released -> finalizer removed, pool gone, GC removes the rest.
    w.report(pool, nodes[0], phase="Released", reason="Released", message="memory freed")
    wait_for("pool gone", lambda: w.pool(pool) is None, timeout=60)
    wait_for("OffloadPoolNodes garbage-collected", lambda: not w.pool_nodes(pool), timeout=90)

    def ds_gone() -> bool:
        try:
            w.apps.read_namespaced_daemon_set(f"offloadpool-agent-{pool}", NAMESPACE)
            return False
        except ApiException as exc:
            return exc.status == 404

    wait_for("DaemonSet garbage-collected", ds_gone, timeout=90)
    assert w.marked(pool, nodes[0]) == (False, False) and w.marked(pool, nodes[1]) == (False, False)


def test_unresponsive_agent_and_reselection(world: World, offloadpool_operator: OperatorProcess) -> None:
    """A stale heartbeat stops a node counting as Ready, a renewed Lease brings it back; a node
    that starts matching joins."""
    w = world
    group = w.name("g")
    a = w.add_node("a", {"offloadpool-test/group": group})
    b = w.add_node("b", {"offloadpool-test/group": "not-yet"})
    tainted = w.add_node(
        "t",
        {"offloadpool-test/group": group},
        taints=[{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}],
    )
    pool = w.create_pool(
        "stale", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    wait_for("a selected (tainted node is not: no toleration)", lambda: set(w.pool_nodes(pool)) == {a})
    w.report_ready(pool, a, heartbeat="2020-01-01T00:00:00Z")
    st = wait_for(
        "unresponsive", lambda: (lambda s: s if s.get("phase") == "Degraded" else None)(status(w, pool))
    )
    assert st["readyNodes"] == 0 and st["failingNodes"][0]["reason"] == "AgentUnresponsive"
    assert conds(w.pool(pool))["Degraded"]["reason"] == "AgentsUnresponsive"
    # the agent's heartbeat Lease alone (no status write, nothing that wakes a pass) makes the
    # node live again by the next resync
    w.renew_heartbeat(pool, a)
    wait_for("Ready again from the Lease", lambda: status(w, pool).get("phase") == "Ready", timeout=30)
    assert w.pool_nodes(pool)[a]["status"]["heartbeat"] == "2020-01-01T00:00:00Z"
    w.report_ready(pool, a)
    wait_for("Ready again", lambda: status(w, pool).get("phase") == "Ready")
    w.core.patch_node(b, {"metadata": {"labels": {"offloadpool-test/group": group}}}, _content_type=MERGE)
    wait_for("b joins", lambda: set(w.pool_nodes(pool)) == {a, b})
    w.custom.patch_cluster_custom_object(
        GROUP,
        VERSION,
        POOL_PLURAL,
        pool,
        {
            "spec": {
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}
                ]
            }
        },
        _content_type=MERGE,
    )
    wait_for("tolerated node joins", lambda: set(w.pool_nodes(pool)) == {a, b, tainted})
    st = wait_for(
        "2 of 3 not ready", lambda: (lambda s: s if s.get("desiredNodes") == 3 else None)(status(w, pool))
    )
    assert st["readyNodes"] == 1
    # A Ready node that stops matching: its object goes, its marks go, and an Event says so.
    wait_for("a marked", lambda: w.marked(pool, a) == (True, True))
    w.core.patch_node(
        a, {"metadata": {"labels": {"offloadpool-test/group": "elsewhere"}}}, _content_type=MERGE
    )
    wait_for("a leaves", lambda: set(w.pool_nodes(pool)) == {b, tainted})
    wait_for("a unmarked", lambda: w.marked(pool, a) == (False, False))
    wait_for("NodeDeselected event", lambda: "NodeDeselected" in w.event_reasons(pool))
    assert status(w, pool)["desiredNodes"] == 2


def test_rollout_node_by_node_survives_kill9(world: World, offloadpool_operator: OperatorProcess) -> None:
    """Spec change: one serving node at a time, held nodes skipped; kill -9 mid-rollout, a new
    operator continues where the old one stopped, without redoing anything."""
    w = world
    group = w.name("g")
    nodes = sorted(w.add_node(f"r{i}", {"offloadpool-test/group": group}) for i in range(3))
    a, b, c = nodes
    pool = w.create_pool(
        "roll", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    wait_for("3 objects", lambda: len(w.pool_nodes(pool)) == 3)
    for n in nodes:
        w.report_ready(pool, n)
    wait_for("Ready", lambda: status(w, pool).get("phase") == "Ready")

    w.custom.patch_cluster_custom_object(
        GROUP, VERSION, POOL_PLURAL, pool, {"spec": {"capacity": "128Mi"}}, _content_type=MERGE
    )

    def targets() -> dict[str, int]:
        return {n: o["spec"].get("targetGeneration") for n, o in w.pool_nodes(pool).items()}

    wait_for("first node advanced", lambda: targets() == {a: 2, b: 1, c: 1})
    obj = w.pool_nodes(pool)[a]
    assert obj["metadata"]["annotations"]["offloadpool.io/rollout-generation"] == "2"
    ds_name = f"offloadpool-agent-{pool}"
    wait_for(
        "DaemonSet requests the new capacity",
        lambda: (
            w.apps.read_namespaced_daemon_set(ds_name, NAMESPACE)
            .spec.template.spec.containers[0]
            .resources.limits["memory"]
            == "384Mi"
        ),
    )
    uids = {n: o["metadata"]["uid"] for n, o in w.pool_nodes(pool).items()}
    ds_generation = w.apps.read_namespaced_daemon_set(ds_name, NAMESPACE).metadata.generation

    # kill -9 while a is in flight; nothing advances without an operator.
    offloadpool_operator.kill9()
    # a's engine holds the lease: it stays at generation 1 and says so.
    w.report_ready(
        pool,
        a,
        1,
        pendingGeneration=2,
        reason="LeaseHeld",
        message="an engine holds the lease",
        enginesAttached=1,
    )
    offloadpool_operator.start()
    wait_for("b advanced by the new operator (a is held: skipped)", lambda: targets() == {a: 2, b: 2, c: 1})
    w.report(pool, b, phase="Provisioning", observedGeneration=1)
    w.report_ready(pool, b, 2)
    wait_for("c advanced after b is Ready at 2", lambda: targets() == {a: 2, b: 2, c: 2})
    w.report_ready(pool, c, 2)
    st = wait_for(
        "rollout pending only on the held node",
        lambda: (
            lambda p: (
                p["status"] if conds(p).get("Progressing", {}).get("reason") == "RolloutPending" else None
            )
        )(w.pool(pool)),
    )  # one read: status and conditions agree
    assert (st["phase"], st["readyNodes"], st["pendingNodes"], st["observedGeneration"]) == ("Ready", 3, 1, 2)
    assert a in conds(w.pool(pool))["Progressing"]["message"]
    # No duplicate work: same objects, the DaemonSet untouched by the second operator.
    assert {n: o["metadata"]["uid"] for n, o in w.pool_nodes(pool).items()} == uids
    assert w.apps.read_namespaced_daemon_set(ds_name, NAMESPACE).metadata.generation == ds_generation
    log = offloadpool_operator.log(200000).split("--- operator run 2")[1]
    assert "created" not in log and f"advanced {a}" not in log, log[-3000:]


def test_a_daemonset_deleted_by_hand_is_made_again(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """Passes do not read the DaemonSet back while its rendering is unchanged, for at most a
    resync (5 s here): one deleted by hand is made again within two resyncs, with no event."""
    w = world
    node = w.add_node("n", {"offloadpool-test/group": w.name("g")})
    pool = w.create_pool("ds", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"none": node}})
    name = f"offloadpool-agent-{pool}"

    def uid() -> str | None:
        try:
            return str(w.apps.read_namespaced_daemon_set(name, NAMESPACE).metadata.uid)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    first = wait_for("DaemonSet", uid)
    w.apps.delete_namespaced_daemon_set(name, NAMESPACE)
    wait_for("DaemonSet made again", lambda: uid() not in (None, first), timeout=30)


def agent_pod(w: World, pool: str, node: str) -> dict:
    """The agent pod the real DaemonSet controller made for ``node`` (pinned to it by affinity)."""
    from offloadpool.operator.daemonset import pod_node, selector_labels

    selector = ",".join(f"{k}={v}" for k, v in selector_labels(pool).items())

    def find() -> dict | None:
        items = w.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        pods = [w.api.sanitize_for_serialization(p) for p in items]  # as JSON: camelCase
        return next((p for p in pods if pod_node(p) == node), None)

    try:
        return wait_for(f"agent pod for {node}", find)
    except AssertionError:
        ds = w.apps.list_namespaced_daemon_set(NAMESPACE, label_selector=selector).items
        raise AssertionError(f"no agent pod: node {w.node(node).to_dict()}\nDaemonSets {ds}") from None


def test_an_unschedulable_agent_pod_is_named_with_the_schedulers_reason(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """No agent reports because the scheduler cannot place its pod: the pool says so, in the
    scheduler's words (read from the pod's PodScheduled condition), not "provisioning". The
    test plays the scheduler (the test control plane runs none): it writes the condition the
    scheduler writes on a pod that fits nowhere."""
    w = world
    group = w.name("g")
    node = w.add_node("full", {"offloadpool-test/group": group})
    # a Ready node with room, as its kubelet reports it: else the node stays tainted not-ready
    # and the DaemonSet controller makes it no agent pod at all
    stamp = format_time(now())
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
    room = {"cpu": "8", "memory": "16Gi", "pods": "110"}
    w.core.patch_node_status(node, {"status": {"capacity": room, "allocatable": room, "conditions": [ready]}})
    pool = w.create_pool(
        "unsched", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    pod = agent_pod(w, pool, node)
    why = "0/1 nodes are available: 1 Insufficient memory. preemption: 0/1 nodes are available."
    w.core.patch_namespaced_pod_status(
        pod["metadata"]["name"],
        NAMESPACE,
        {
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
                ],
            }
        },
    )

    def named() -> dict | None:
        st = status(w, pool)
        failing = {f["node"]: f for f in st.get("failingNodes") or ()}
        return st if (failing.get(node) or {}).get("reason") == "AgentUnschedulable" else None

    st = wait_for("the scheduler's reason in the pool's status", named, timeout=60)
    failing = {f["node"]: f for f in st["failingNodes"]}
    assert failing[node]["message"] == f"the agent pod cannot be scheduled: Unschedulable: {why}", dump(st)
    c = conds(w.pool(pool))
    assert st["phase"] == "Degraded", dump(st)
    reasons = (c["Degraded"]["reason"], c["Progressing"]["reason"])
    assert reasons == ("AgentsUnschedulable", "Stalled"), dump(c)
    assert "Insufficient memory" in c["Degraded"]["message"] and node in c["Progressing"]["message"]
    assert "provisioning" not in c["Progressing"]["message"], dump(c)


def kubelet_ready(w: World, node: str, memory: str = "16Gi") -> None:
    """The Node Ready with room (``memory`` of it), as its kubelet reports it: else it stays
    tainted not-ready and the DaemonSet controller makes it no agent pod at all."""
    stamp = format_time(now())
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }
    room = {"cpu": "8", "memory": memory, "pods": "110"}
    w.core.patch_node_status(node, {"status": {"capacity": room, "allocatable": room, "conditions": [ready]}})


def test_deleting_a_pool_whose_agent_never_ran_finishes_and_one_that_may_hold_memory_waits(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """A pool larger than a node offers (its agent pod cannot be placed: ``AgentsUnschedulable``)
    never held anything there: its deletion does not wait for that node. A node without a status
    whose agent pod runs may hold memory: the deletion waits for it, saying so, until it reports
    Released. The test plays the scheduler and the kubelet (the test control plane runs
    neither): the PodScheduled condition of a pod that fits nowhere; the binding and the running
    container of the other."""
    w = world
    group = w.name("g")
    never, quiet = (
        w.add_node("never", {"offloadpool-test/group": group}),
        w.add_node("quiet", {"offloadpool-test/group": group}),
    )
    # "never" has no room for the agent pod, so that a real scheduler of the session (the real
    # node's, when its tests ran first) cannot place it either: the test's PodScheduled is true
    kubelet_ready(w, never, memory="1Mi")
    kubelet_ready(w, quiet)
    pool = w.create_pool(
        "noagent", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    why = "0/2 nodes are available: 1 Insufficient memory."
    unplaced = agent_pod(w, pool, never)
    w.core.patch_namespaced_pod_status(
        unplaced["metadata"]["name"],
        NAMESPACE,
        {
            "status": {
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}
                ]
            }
        },
    )
    running = agent_pod(w, pool, quiet)
    try:
        w.core.create_namespaced_pod_binding(
            running["metadata"]["name"],
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": running["metadata"]["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": quiet},
            },
            _preload_content=False,  # the API server answers a Status the client cannot read as a Binding
        )
    except ApiException as exc:
        # 409: bound already (a retried request whose first answer was lost); bound where we want
        bound = w.core.read_namespaced_pod(running["metadata"]["name"], NAMESPACE)
        if exc.status != 409 or bound.spec.node_name != quiet:
            raise
    container = running["spec"]["containers"][0]
    w.core.patch_namespaced_pod_status(
        running["metadata"]["name"],
        NAMESPACE,
        {
            "status": {
                "phase": "Running",
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container["image"],
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "started": True,
                        "state": {"running": {"startedAt": format_time(now())}},
                    }
                ],
            }
        },
    )
    wait_for("both OffloadPoolNodes", lambda: set(w.pool_nodes(pool)) == {never, quiet} or None)
    w.custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)

    def waits_for_quiet_only() -> str | None:
        message = conds(w.pool(pool) or {}).get("Ready", {}).get("message", "")
        return message if "where no agent ever ran" in message else None

    message = wait_for("the deletion to wait for the quiet node only", waits_for_quiet_only, timeout=60)
    assert message.startswith(
        f"deletion waits for 1 node(s) to release the memory: {quiet} (no status from its agent yet; "
        "it may hold memory there until the agent reports Released)"
    ), message
    assert f"nothing to release on 1 node(s) where no agent ever ran: {never}" in message, message
    assert w.pool(pool) is not None, "the finalizer went while a node may hold memory"

    w.report(pool, quiet, phase="Released")
    wait_for("the pool gone", lambda: w.pool(pool) is None, timeout=60)


def test_a_frozen_agent_is_not_called_provisioning(
    world: World, offloadpool_operator: OperatorProcess
) -> None:
    """An agent that said Provisioning and then went silent (no status write, no Lease renewal
    past the timeout) is frozen or gone: the pool names it unresponsive, and its Progressing
    condition says nothing is at work there, not "provisioning on 1 node(s)"."""
    w = world
    group = w.name("g")
    node = w.add_node("frozen", {"offloadpool-test/group": group})
    pool = w.create_pool(
        "frozen", {"capacity": "64Mi", "medium": "Memory", "nodeSelector": {"offloadpool-test/group": group}}
    )
    wait_for("the node selected", lambda: node in w.pool_nodes(pool))
    w.report(pool, node, phase="Provisioning", observedGeneration=1, heartbeat="2020-01-01T00:00:00Z")

    def stalled() -> dict | None:
        c = conds(w.pool(pool) or {})
        return c if (c.get("Progressing") or {}).get("reason") == "Stalled" else None

    try:
        c = wait_for("Progressing: Stalled", stalled, timeout=60)
    except AssertionError:
        raise AssertionError(dump(w.pool(pool))) from None
    assert f"{node} (AgentUnresponsive)" in c["Progressing"]["message"], dump(c)
    assert c["Degraded"]["reason"] == "AgentsUnresponsive", dump(c)
    failing = {f["node"]: f for f in status(w, pool)["failingNodes"]}
    assert failing[node]["reason"] == "AgentUnresponsive"
    assert "it last said Provisioning" in failing[node]["message"], failing
