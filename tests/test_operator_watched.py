"""The operator's watched index of OffloadPoolNodes (``offloadpool.operator.watched``) against
the real API server: what a pass reads instead of listing the pool.

It must hold what the API server holds (created, status changed, deleted), grouped by pool;
report each change once, with the value before and after; take in the answers to the
operator's own writes without ever letting an older version (a late event or answer) replace
a newer one; and say when the first list is complete.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from kubernetes import client

from fixtures.wait import wait_for
from offloadpool.api.constants import GROUP, NODE_PLURAL, VERSION
from offloadpool.operator.kube import MERGE, Kube
from offloadpool.operator.pool_node_report import PoolNodeReport
from offloadpool.operator.runtime import node_object_key
from offloadpool.operator.watched import WatchedKind

pytestmark = pytest.mark.controlplane


def opn(pool: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadPoolNode",
        "metadata": {"name": f"{pool}.{node}"},
        "spec": {"pool": pool, "nodeName": node, "targetGeneration": 1},
    }


def test_index_follows_the_api_server_and_keeps_the_newest(crds_installed: Any) -> None:
    api = crds_installed.api_client()
    custom = client.CustomObjectsApi(api)
    pool, other = f"w-{uuid.uuid4().hex[:6]}", f"x-{uuid.uuid4().hex[:6]}"
    changes: list[tuple[str, str, PoolNodeReport | None, PoolNodeReport | None]] = []
    lock = threading.Lock()

    def record(group: str, key: str, before: PoolNodeReport | None, after: PoolNodeReport | None) -> None:
        with lock:
            changes.append((group, key, before, after))

    def seen(key: str) -> list[tuple[PoolNodeReport | None, PoolNodeReport | None]]:
        with lock:
            return [(b, a) for g, k, b, a in changes if g == pool and k == key]

    first = custom.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, opn(pool, "a"))
    index = WatchedKind(
        "offloadpoolnodes", Kube(api).list_all_node_objects, PoolNodeReport.from_body, node_object_key, record
    ).start()
    try:
        # the first list: synced only once what existed before the watch is in
        assert index.synced.wait(30)
        assert set(index.group(pool)) == {"a"}
        # a new object of another pool goes to that pool's group only
        custom.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, opn(other, "a"))
        wait_for("other pool's object", lambda: "a" in index.group(other), 30)
        assert set(index.group(pool)) == {"a"}

        # an agent's status write arrives, reported once with before and after
        patched = custom.patch_cluster_custom_object_status(
            GROUP,
            VERSION,
            NODE_PLURAL,
            f"{pool}.a",
            {"status": {"phase": "Ready", "observedGeneration": 1}},
            _content_type=MERGE,
        )
        wait_for("Ready in the index", lambda: index.group(pool)["a"].phase == "Ready", 30)
        ready = [(b, a) for b, a in seen("a") if a is not None and a.phase == "Ready"]
        assert len(ready) == 1 and ready[0][0] is not None and ready[0][0].phase is None, ready

        # the answer to an older write arriving late never puts the old version back
        index.apply(first)
        assert index.group(pool)["a"].phase == "Ready"
        index.apply(patched)  # the same version again: no change, nothing reported
        assert index.group(pool)["a"].phase == "Ready"
        before = len(changes)

        # the operator's own write, taken in from its answer: in the index at once, and never
        # reported twice — its watch event is no news when the answer came first, and the
        # answer changes nothing when the event won the race (same resourceVersion)
        answer = custom.patch_cluster_custom_object(
            GROUP, VERSION, NODE_PLURAL, f"{pool}.a", {"spec": {"targetGeneration": 2}}, _content_type=MERGE
        )
        index.apply(answer)
        assert index.group(pool)["a"].target_generation == 2
        custom.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, opn(pool, "b"))
        wait_for("b in the index", lambda: "b" in index.group(pool), 30)
        since = changes[before:]
        own = [after for _, k, _, after in since if k == "a"]
        assert len(own) <= 1 and all(a is not None and a.target_generation == 2 for a in own), since
        assert [k for _, k, _, _ in since if k != "a"] == ["b"], since

        # deleted: gone from the index, reported with the last value
        custom.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, f"{pool}.a")
        wait_for("a gone from the index", lambda: "a" not in index.group(pool), 30)
        gone = [(b, a) for b, a in seen("a") if a is None]
        assert len(gone) == 1 and gone[0][0] is not None and gone[0][0].target_generation == 2
    finally:
        index.stop()
        for name in (f"{pool}.a", f"{pool}.b", f"{other}.a"):
            try:
                custom.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, name)
            except client.ApiException:
                pass
        api.close()


def test_kube_counts_the_cpu_of_its_writes_and_only_of_them(crds_installed: Any) -> None:
    """What the daemon leaves out of a pass's pacing: this thread's CPU in writes (``send``)."""
    kube = Kube(crds_installed.api_client())
    name = f"cpu-{uuid.uuid4().hex[:6]}"
    assert kube.write_cpu_seconds() == 0.0
    kube.get_pool(name)  # a read: not counted
    assert kube.write_cpu_seconds() == 0.0
    made = kube.create_node_object(opn(name, "a"))
    assert made is not None and made["metadata"]["name"] == f"{name}.a"
    after_one = kube.write_cpu_seconds()
    assert after_one > 0.0
    kube.patch_node_object(f"{name}.a", {"metadata": {"labels": {"x": "y"}}})
    assert kube.write_cpu_seconds() > after_one
    seen: list[float] = []
    other = threading.Thread(target=lambda: seen.append(kube.write_cpu_seconds()))
    other.start()
    other.join()
    assert seen == [0.0], "another thread's writes were counted as this one's"
    kube.delete_node_object(f"{name}.a")


def test_the_event_of_an_applied_write_is_not_converted_again() -> None:
    """The watch event of the operator's own write (already in the index through ``apply``)
    costs its JSON parse only: no conversion, no change reported. A newer one is converted."""
    converted: list[str] = []
    changes: list[tuple[str, str]] = []

    def convert(body: Any) -> PoolNodeReport:
        converted.append(body["metadata"]["resourceVersion"])
        return PoolNodeReport.from_body(body)

    index: WatchedKind[PoolNodeReport] = WatchedKind(
        "offloadpoolnodes",
        lambda **_: None,
        convert,
        node_object_key,
        lambda g, k, b, a: changes.append((g, k)),
    )
    written = {**opn("p", "a"), "metadata": {"name": "p.a", "resourceVersion": "10"}}
    index.apply(written)
    index._upsert(written)  # its watch event
    assert converted == ["10"] and changes == []
    newer = {**written, "metadata": {"name": "p.a", "resourceVersion": "11"}, "status": {"phase": "Ready"}}
    index._upsert(newer)
    assert converted == ["10", "11"] and changes == [("p", "a")]
    assert index.group("p")["a"].phase == "Ready"
