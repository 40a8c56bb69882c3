"""The agent's ResourceSlice costs a new pool's node one request: its create, no read first.

A new pool has no slice on any node, so a read before the first write finds nothing, at every
node (at 1,000 nodes, a thousand quorum reads of etcd while the pool converges). The slice is
created straight away, as the heartbeat Lease is; one that is there already (a restarted agent)
answers 409 and is then read and compared, and written only when it says something else. A
change (a share taken) is one write over what the agent last wrote, no read first. The
requests are counted on a stand-in for ``KubeAccess``; the slice's content is ``Slices.want``'s
(tests/test_dra_slices.py checks it against the real API server).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from offloadpool.agent.slices import Slices
from offloadpool.region.vocabulary import PENDING, READY

POOL_NODE = {"metadata": {"name": "kv.n1", "uid": "u1"}}
SPEC = {
    "driver": "offloadpool.io",
    "nodeName": "n1",
    "pool": {"name": "kv.n1", "resourceSliceCount": 1},
    "devices": [{"name": "pool", "attributes": {}, "capacity": {"memory": {"value": "64Ki"}}}],
}


class Access:
    """The slice calls of ``KubeAccess``, against one stored object (None: none)."""

    def __init__(self, stored: dict[str, Any] | None = None) -> None:
        self.stored = stored
        self.calls: list[str] = []

    def get_slice(self, name: str) -> dict[str, Any] | None:
        self.calls.append("get")
        return self.stored

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        if self.stored is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        self.stored = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
        return self.stored

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("replace")
        assert self.stored is not None and body["metadata"]["resourceVersion"]
        if body["metadata"]["resourceVersion"] != self.stored["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        version = str(int(body["metadata"]["resourceVersion"]) + 1)
        self.stored = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
        return self.stored

    def delete_slice(self, name: str) -> None:
        self.calls.append("delete")
        self.stored = None


class Region:
    pool_name = "kv"


def slices(access: Access, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any] = SPEC) -> Slices:
    monkeypatch.setattr(Slices, "want", lambda self, phase: spec if phase == READY else None)
    clock = iter(float(t) for t in range(0, 10_000, 10))
    return Slices(access, Region(), "n1", reread_seconds=60, clock=lambda: next(clock))  # type: ignore[arg-type]


def stored_slice(spec: dict[str, Any], generation: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "kv.n1", "resourceVersion": "7"},
        "spec": {**spec, "pool": {**spec["pool"], "generation": generation}},
    }


def test_a_new_pools_slice_is_one_create_and_nothing_while_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    access = Access()
    s = slices(access, monkeypatch)
    s.sync(READY, POOL_NODE)
    assert access.calls == ["create"], "a read before the first write finds nothing on a new pool"
    assert access.stored is not None and access.stored["spec"]["pool"]["generation"] == 1
    for _ in range(4):  # steps within reread_seconds: what it says has not changed
        s.sync(READY, POOL_NODE)
    assert access.calls == ["create"]


def test_a_slice_that_is_there_is_read_and_written_only_when_it_differs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    same = Access(stored_slice(SPEC, 3))
    slices(same, monkeypatch).sync(READY, POOL_NODE)
    assert same.calls == ["create", "get"], "a restarted agent's slice says what it should"

    other = {**SPEC, "devices": []}
    stale = Access(stored_slice(other, 3))
    slices(stale, monkeypatch).sync(READY, POOL_NODE)
    assert stale.calls == ["create", "get", "replace"]
    assert stale.stored is not None and stale.stored["spec"]["pool"]["generation"] == 4
    assert stale.stored["spec"]["devices"] == SPEC["devices"]


def test_a_slice_is_read_again_after_reread_seconds_and_made_again_if_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    access = Access()
    s = slices(access, monkeypatch)  # the clock moves 10 s a sync
    s.sync(READY, POOL_NODE)
    access.stored = None  # the kubelet wiped the driver's slices
    for _ in range(6):
        s.sync(READY, POOL_NODE)
    assert access.calls == ["create", "get", "create"], "read again once, after reread_seconds"


def test_a_pool_not_ready_reads_first_and_deletes_what_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    access = Access(stored_slice(SPEC, 2))
    s = slices(access, monkeypatch)
    s.sync(PENDING, POOL_NODE)
    assert access.calls == ["get", "delete"] and access.stored is None
    s.sync(PENDING, POOL_NODE)
    assert access.calls == ["get", "delete"], "nothing there, nothing to say"


def test_a_change_is_one_write_over_what_the_agent_last_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = dict(SPEC)
    access = Access()
    s = slices(access, monkeypatch, spec)
    s.sync(READY, POOL_NODE)
    spec["devices"] = []  # a share taken: its device left out
    s.sync(READY, POOL_NODE)
    assert access.calls == ["create", "replace"], "no read before a change: the agent is its one writer"
    assert access.stored is not None and access.stored["spec"]["pool"]["generation"] == 2
    assert access.stored["spec"]["devices"] == []


def test_a_change_over_a_slice_someone_else_wrote_is_read_and_written_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = dict(SPEC)
    access = Access()
    s = slices(access, monkeypatch, spec)
    s.sync(READY, POOL_NODE)
    assert access.stored is not None
    access.stored = {**access.stored, "metadata": {**access.stored["metadata"], "resourceVersion": "5"}}
    spec["devices"] = []
    s.sync(READY, POOL_NODE)  # 409: what it last wrote is not what is there
    s.sync(READY, POOL_NODE)
    # after a refusal what is there is not known: the next step starts as a restarted agent's
    # (a create, 409, the read), then writes over what it read
    assert access.calls == ["create", "replace", "create", "get", "replace"]
    assert access.stored["spec"]["devices"] == [] and access.stored["spec"]["pool"]["generation"] == 2
