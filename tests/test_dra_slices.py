"""Each agent publishes its pool's ResourceSlice on its node (``offloadpool.agent.slices``,
docs/dra.md): the devices a Ready pool offers, kept current as shares are taken at the node and
the pool goes away. The device model is checked as a function, then the real agent process
publishes to the real API server (which validates every field: attribute names, quantities,
the one-slice pool), and the scheduler-facing words are read back with kubectl."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes import client

from fixtures.wait import wait_for
from offloadpool.agent.slices import devices
from offloadpool.api import dra
from offloadpool.region.holding import shares
from offloadpool.region.holding.shares import ShareState
from offloadpool.region.request import PoolRequest
from test_agent_process import GROUP, VERSION, create, env, start_agent, status  # noqa: F401
from test_agent_shares import start_engine

MiB = 1 << 20


def _attrs(device: dict[str, Any]) -> dict[str, Any]:
    return {k: next(iter(v.values())) for k, v in device["attributes"].items()}


def test_a_partitioned_pool_is_one_device_per_free_share_with_its_numa_node() -> None:
    """Share i's regions on one NUMA node: the standard attribute says it; a share an engine or
    a csi volume took is left out; a share a DRA claim holds stays (its allocation names it)."""
    req = PoolRequest(
        name="kv", capacity=64 * MiB, medium="Memory", ranks=2, partitions=4, layout_type="PerRank"
    )
    numa = [[0], [0], [0], [1], [1], [1], [1], [0, 1]]  # per region: 4 shares x 2 ranks' files
    states = [
        ShareState(0, ()),
        ShareState(1, (1234,), "pod-a"),  # an engine's flock
        ShareState(2, (), "", "5f0c-pod"),  # a csi volume's reservation
        ShareState(3, (99,), shares.claim_owner("c-uid"), shares.claim_owner("c-uid")),  # a claim's
    ]
    found = devices("kv", req, numa, states)
    assert [d["name"] for d in found] == ["share-0", "share-3"]
    assert all(d["capacity"] == {"memory": {"value": "16Mi"}} for d in found)
    assert _attrs(found[0]) == {
        "pool": "kv",
        "medium": "Memory",
        "pageSize": 4096,
        "layout": "PerRank",
        "ranks": 2,
        "share": 0,
        dra.ATTR_NUMA_NODE: 0,
    }
    assert dra.ATTR_NUMA_NODE not in _attrs(found[1])  # share 3 spans nodes 0 and 1
    assert dra.share_of_device("share-3") == 3 and dra.share_of_device("pool") is None


def test_a_pool_without_shares_is_one_device_with_its_whole_capacity() -> None:
    req = PoolRequest(name="kv", capacity=64 * MiB, medium="Memory", ranks=2, layout_type="PerRank")
    (device,) = devices("kv", req, [[1], [1]], None)
    assert device["name"] == dra.POOL_DEVICE
    assert device["capacity"] == {"memory": {"value": "64Mi"}}
    assert _attrs(device)[dra.ATTR_NUMA_NODE] == 1 and "share" not in _attrs(device)
    (unplaced,) = devices("kv", req, [], None)  # no NUMA placement recorded: no attribute
    assert dra.ATTR_NUMA_NODE not in _attrs(unplaced)


def test_memory_the_kernel_placed_is_on_the_hosts_numa_node_only_when_it_has_one() -> None:
    """A region without a binding (the kernel's default placement, recorded as ``[]``) is on the
    host's one NUMA node; on a host of several its node is not known, and a device with such a
    region says no NUMA node, even where its other region is bound."""
    req = PoolRequest(name="kv", capacity=64 * MiB, medium="Memory", ranks=2, layout_type="PerRank")
    (one_node,) = devices("kv", req, [[], []], None, sole_node=0)
    assert _attrs(one_node)[dra.ATTR_NUMA_NODE] == 0
    (old_record,) = devices("kv", req, [], None, sole_node=0)  # a record without placements
    assert _attrs(old_record)[dra.ATTR_NUMA_NODE] == 0
    (half_bound,) = devices("kv", req, [[1], []], None)
    assert dra.ATTR_NUMA_NODE not in _attrs(half_bound)
    shares_req = PoolRequest(
        name="kv", capacity=64 * MiB, medium="Memory", ranks=2, partitions=2, layout_type="PerRank"
    )
    found = devices("kv", shares_req, [[1], [1], [], []], [ShareState(0, ()), ShareState(1, ())])
    assert [_attrs(d).get(dra.ATTR_NUMA_NODE) for d in found] == [1, None]


def _slice(env: dict[str, Any], name: str) -> dict[str, Any] | None:  # noqa: F811
    try:
        return env["custom"].get_cluster_custom_object(
            dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _names(obj: dict[str, Any] | None) -> list[str] | None:
    return None if obj is None else [d["name"] for d in obj["spec"].get("devices") or []]


@pytest.mark.controlplane
def test_the_agent_publishes_its_pools_slice_and_keeps_it_current(env: dict[str, Any]) -> None:  # noqa: F811
    """Ready: a slice of one device per share, as the API server stores it; an engine takes a
    share at the node: its device goes; a DRA claim's share stays; the engine exits: the device
    is back; the pool deleted: the slice goes."""
    pool, node = "dra-pub", "node-d"
    name = dra.slice_name(pool, node)
    create(env, pool, node, {"capacity": "8Mi", "medium": "Memory", "partitions": 4})
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, f"{pool}.{node}").get("phase") == "Ready", timeout=90)
    every = [f"share-{i}" for i in range(4)]
    got = wait_for("the slice", lambda: (s := _slice(env, name)) is not None and _names(s) == every and s)
    spec = got["spec"]
    assert spec["driver"] == dra.DRA_DRIVER and spec["nodeName"] == node
    assert spec["pool"]["name"] == name and spec["pool"]["resourceSliceCount"] == 1
    owner = got["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("OffloadPoolNode", f"{pool}.{node}")
    first = spec["devices"][0]
    assert first["capacity"]["memory"]["value"] == "2Mi"
    assert first["attributes"]["pool"] == {"string": pool}
    assert first["attributes"]["share"] == {"int": 0}
    generation = spec["pool"]["generation"]

    pool_dir = env["root"] / pool
    engine, index = start_engine(env, pool_dir, "pod-e")  # an engine of a HostPath pod
    claimed = shares.reserve(pool_dir, 4, shares.claim_owner("claim-uid-1"))  # what prepare does
    left = [d for d in every if d != f"share-{index}"]
    got = wait_for("the engine's share withdrawn", lambda: _names(s := _slice(env, name)) == left and s)
    assert f"share-{claimed}" in left and got["spec"]["pool"]["generation"] > generation

    engine.kill()
    engine.wait(10)
    back = wait_for("its device back", lambda: _names(s := _slice(env, name)) == every and s)
    time.sleep(4)  # four steps of the agent: nothing changed, nothing written
    assert (_slice(env, name) or {})["metadata"]["resourceVersion"] == back["metadata"]["resourceVersion"]

    out = env["cp"].kubectl("get", "resourceslices", name, "-o", "json")
    assert out.returncode == 0 and json.loads(out.stdout)["spec"]["driver"] == "offloadpool.io", out.stderr

    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    wait_for("the slice deleted", lambda: _slice(env, name) is None, timeout=60)


@pytest.mark.controlplane
def test_a_slice_someone_removed_is_made_again(env: dict[str, Any]) -> None:  # noqa: F811
    """The kubelet wipes a driver's slices when its plugin goes away; the agent's next read
    finds its slice missing and writes it again."""
    pool, node = "dra-again", "node-g"
    name = dra.slice_name(pool, node)
    create(env, pool, node, {"capacity": "4Mi", "medium": "Memory"})
    start_agent(env, pool, node)
    wait_for("the slice", lambda: _names(_slice(env, name)) == [dra.POOL_DEVICE], timeout=90)
    env["custom"].delete_cluster_custom_object(
        dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, name
    )
    wait_for("made again", lambda: _names(_slice(env, name)) == [dra.POOL_DEVICE], timeout=60)
    env["custom"].delete_cluster_custom_object(GROUP, VERSION, "offloadpools", pool)
    wait_for("the slice deleted", lambda: _slice(env, name) is None, timeout=60)
