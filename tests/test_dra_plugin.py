"""The DRA kubelet plugin (offloadpool.dra) over a real unix socket, with real bind mounts, preparing
real ResourceClaims of the real API server (docs/dra.md).

The claims are made in the API server and their ``status.allocation`` written as the scheduler
writes it (this control plane runs no scheduler: tests/test_real_node.py has one); the plugin
reads each claim by the namespace, name and uid the kubelet sends. Every scenario
(tests/dra_scenarios.py) runs in a mount namespace of its own where every mount but a scratch
tmpfs is read-only."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fixtures.host import private_mounts_python
from offloadpool.api import dra
from offloadpool.region.holding.shares import claim_owner

pytestmark = [pytest.mark.root, pytest.mark.controlplane]

TESTS = Path(__file__).resolve().parent
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import dra_scenarios; dra_scenarios.main()"
NODE = "node-a"
REPO = TESTS.parent


def _namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        core.create_namespace({"metadata": {"name": name}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise


def _claim(custom: client.CustomObjectsApi, namespace: str, name: str, pool: str, device: str) -> list[str]:
    """A ResourceClaim asking the DeviceClass for one device, allocated ``device`` of ``pool``'s
    slice on the node (as the scheduler allocates it): [namespace, name, uid]."""
    body = {
        "apiVersion": dra.RESOURCE_API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": "kv", "exactly": {"deviceClassName": dra.DEVICE_CLASS}}]}},
    }
    made = custom.create_namespaced_custom_object(
        dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, namespace, "resourceclaims", body
    )
    allocation = {
        "devices": {
            "results": [
                {
                    "request": "kv",
                    "driver": dra.DRA_DRIVER,
                    "pool": dra.slice_name(pool, NODE),
                    "device": device,
                }
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
            ]
        },
    }
    custom.patch_namespaced_custom_object_status(
        dra.RESOURCE_GROUP,
        dra.RESOURCE_VERSION,
        namespace,
        "resourceclaims",
        name,
        {"status": {"allocation": allocation}},
    )
    return [namespace, name, made["metadata"]["uid"]]


@pytest.fixture
def claims(control_plane: Any) -> Any:
    api = control_plane.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    _namespace(core, "offloadpool-system")  # deploy/'s namespace, made first as the install says
    out = control_plane.kubectl("apply", "-f", str(REPO / "deploy" / "dra.yaml"))
    assert out.returncode == 0, out.stderr
    suffix = uuid.uuid4().hex[:6]
    a, c = f"team-a-{suffix}", f"team-c-{suffix}"
    made: dict[str, list[str]] = {}
    try:
        for ns in (a, c):
            _namespace(core, ns)
        made = {
            "a": _claim(custom, a, "engine-0", "kv", "share-1"),
            "whole": _claim(custom, a, "whole-0", "whole", dra.POOL_DEVICE),
            "other_ns": _claim(custom, c, "engine-c", "kv", "share-2"),
            "same_share": _claim(custom, a, "engine-1", "kv", "share-1"),
        }
        made["wrong_uid"] = [a, "engine-1", str(uuid.uuid4())]
        made["missing"] = [a, "gone", str(uuid.uuid4())]
        yield made, (a, c)
    finally:
        for ns in (a, c):
            try:
                core.delete_namespace(ns)
            except client.ApiException:
                pass
        # deploy/dra.yaml's DaemonSet would otherwise put plugin pods on every later test's Nodes
        api.close()
        control_plane.kubectl("delete", "--ignore-not-found", "-f", str(REPO / "deploy" / "dra.yaml"))


def scenario(tmp_path: Path, name: str, kubeconfig: str, claims: dict[str, list[str]]) -> dict[str, Any]:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = private_mounts_python(RUN, str(scratch), name, kubeconfig, json.dumps(claims))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_dra_plugin_prepares_a_claims_share_through_cdi_and_undoes_it(
    tmp_path: Path, control_plane: Any, claims: Any
) -> None:
    made, (team_a, _) = claims
    r = scenario_for(tmp_path, control_plane, made, team_a)
    a_uid, whole_uid = made["a"][2], made["whole"][2]

    # prepared: the device the scheduler allocated, with its CDI id
    assert r["first"][a_uid] == {
        "error": "",
        "devices": [
            {
                "requests": ["kv"],
                "pool": f"kv.{NODE}",
                "device": "share-1",
                "cdi": [f"offloadpool.io/pool={a_uid}"],
            }
        ],
    }
    assert r["first"][whole_uid]["error"] == "" and r["first"][whole_uid]["devices"][0]["device"] == "pool"
    snap = r["after_first"]
    assert snap["reservations"] == {"1": claim_owner(a_uid)}  # exactly the allocated share
    (record,) = snap["records"]["kv"]
    assert record["volume_id"] == f"dra-{a_uid}" and record["share"] == 1
    assert record["pod_uid"] == claim_owner(a_uid) and record["pod_namespace"] == team_a
    assert [p["volume_id"] for p in snap["records"]["whole"]] == [f"dra-{whole_uid}"]
    # the CDI spec: the tree bound from the kubelet's root-only plugin directory, the env set
    spec = snap["specs"][f"offloadpool.io-{a_uid}.json"]
    assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "offloadpool.io/pool"
    (device,) = spec["devices"]
    assert device["name"] == a_uid
    (mount,) = device["containerEdits"]["mounts"]
    assert mount["hostPath"].endswith(f"/kubelet/plugins/offloadpool.io/claims/{a_uid}/mount")
    assert mount["containerPath"] == "/offloadpool/kv" and mount["options"] == ["rbind", "nosuid", "nodev"]
    assert sorted(device["containerEdits"]["env"]) == [
        "OFFLOADPOOL_POOL=kv",
        "OFFLOADPOOL_POOL_DIR=/offloadpool/kv",
        "OFFLOADPOOL_SHARE=1",
    ]
    # the share's tree, as the CSI plugin binds it: its manifest, the lease, its segments alone
    assert r["tree"][:3] == ["lease", "manifest.json", "mnt"] and all(
        n.startswith("p1-") for n in r["tree"][3:]
    )
    tops = [m for m in snap["mounts"] if m["target"] == f"plugins/offloadpool.io/claims/{a_uid}/mount"]
    assert tops and {"nosuid", "nodev", "ro"} <= set(tops[0]["options"]), snap["mounts"]

    # the kubelet's retry: the same answer, nothing added
    assert r["again"] == {a_uid: r["first"][a_uid]}
    assert r["after_again"] == snap

    refused = r["refused"]
    other, same, wrong, missing = (made[k][2] for k in ("other_ns", "same_share", "wrong_uid", "missing"))
    assert refused[other]["error"].startswith("PERMISSION_DENIED: pool kv is not for namespace team-c-")
    assert refused[same]["error"].startswith("RESOURCE_EXHAUSTED: no free share"), refused[same]
    assert f"not uid {wrong}" in refused[wrong]["error"]
    assert "does not exist" in refused[missing]["error"]
    assert all(not refused[u]["devices"] for u in refused)
    assert r["after_refused"] == snap, "a refused claim mounted, recorded, reserved or wrote something"

    # one record, one mutex: an engine over hostPath never gets the claim's share
    assert r["engine_share"] != 1
    # the CSI plugin's restart keeps the DRA plugin's records and reservations
    assert r["after_csi_rebuild"] == snap
    # the DRA plugin's restart keeps the claims still bound, their specs written
    assert sorted(r["kept"]) == sorted([f"dra-{a_uid}", f"dra-{whole_uid}"])
    assert r["after_restart"]["records"] == snap["records"]
    assert r["after_restart"]["reservations"] == snap["reservations"]
    assert r["after_restart"]["specs"] == snap["specs"]

    # unprepared: nothing left; again: done
    assert r["unprepare"] == {a_uid: "", whole_uid: ""}
    assert r["after_unprepare"] == {
        "mounts": [],
        "records": {"kv": [], "whole": []},
        "reservations": {},
        "specs": {},
    }
    assert r["unprepare_again"] == {a_uid: ""}
    reg = r["registration"]
    assert (reg["type"], reg["name"], reg["versions"]) == ("DRAPlugin", "offloadpool.io", ["v1.DRAPlugin"])
    assert reg["endpoint"].endswith("/plugin/dra.sock")


def scenario_for(
    tmp_path: Path, control_plane: Any, made: dict[str, list[str]], consumer: str
) -> dict[str, Any]:
    """The lifecycle scenario with the pool's consumers this test's namespace."""
    return scenario(tmp_path, "lifecycle", str(control_plane.kubeconfig), {**made, "consumer": [consumer]})


def test_dra_plugin_killed_at_each_step_converges_on_restart_and_retry(
    tmp_path: Path, control_plane: Any, claims: Any
) -> None:
    """The plugin as its own process, killed -9 where it stopped at each step of a share's
    prepare and of its unprepare (``csi.faults``): the node holds what that step left (so the
    stop was where it is named); the next plugin's rebuild keeps the claim only when its tree is
    whole, leaving nothing of one that is not; the kubelet's retry ends as a prepare that was
    never interrupted (one record, one reservation, one tree, one spec), and the unprepare
    leaves nothing: no mount, spec, temporary spec, claim directory, record or reservation, and
    nothing in the plugin's stage or beneath the pool's mount."""
    made, (team_a, _) = claims
    uid = made["a"][2]
    r = scenario(tmp_path, "faults", str(control_plane.kubeconfig), {"a": made["a"], "consumer": [team_a]})
    spec, tmp = f"offloadpool.io-{uid}.json", f"offloadpool.io-{uid}.json.tmp"
    target = f"plugins/offloadpool.io/claims/{uid}/mount"
    clean = r["clean"]
    answer = clean["prepare"]
    assert answer[uid]["error"] == "" and answer[uid]["devices"][0]["device"] == "share-1", answer
    prepared = clean["prepared"]
    assert prepared["reservations"] == {"1": claim_owner(uid)} and prepared["specs"] == [spec]
    assert [p["volume_id"] for p in prepared["records"]["kv"]] == [f"dra-{uid}"]
    assert prepared["claim_dirs"] == [uid] and target in [m["target"] for m in prepared["mounts"]]
    assert prepared["staged"] == [] and prepared["beneath_pool"] == []
    nothing = {
        "mounts": [],
        "records": {"kv": [], "whole": []},
        "reservations": {},
        "specs": [],
        "claim_dirs": [],
        "staged": [],
        "beneath_pool": [],
    }
    assert clean["unprepare"] == {uid: ""} and clean["end"] == nothing

    def at(left: dict[str, Any]) -> tuple[bool, bool, bool, list[str]]:
        """(reserved, recorded, tree bound at the target, the specs' names) as the kill left them."""
        return (
            left["reservations"] == {"1": claim_owner(uid)},
            bool(left["records"]["kv"]),
            target in [m["target"] for m in left["mounts"]],
            left["specs"],
        )

    # what each step leaves when the plugin dies there
    left_by_step = {
        "reserved": (True, False, False, []),
        "recorded": (True, True, False, []),
        "staged": (True, True, False, []),
        "bound": (True, True, True, []),
        "cdi-staged": (True, True, True, [tmp]),
        "cdi-written": (True, True, True, [spec]),
    }
    for step, left in left_by_step.items():
        got = r[f"prepare/{step}"]
        assert got["call"] == "UNAVAILABLE", (step, got["call"])  # the kubelet's call dropped
        assert at(got["left"]) == left, (step, got["left"])
        if step == "staged":  # the tree half built in the plugin's stage, nothing at the target
            assert got["left"]["staged"] and got["left"]["claim_dirs"] == [uid], got["left"]
        whole = left[2]
        assert got["kept"] == int(whole), (step, got["kept"])
        assert got["after_restart"] == (prepared if whole else nothing), (step, got["after_restart"])
        assert got["retry"] == answer, (step, got["retry"])
        assert got["after_retry"] == prepared, (step, got["after_retry"])
        assert got["unprepare"] == {uid: ""} and got["end"] == nothing, (step, got["end"])

    # unprepare: the spec gone first, then the tree, then the reservation, the record last
    left_by_step = {
        "cdi-removed": (True, True, True, []),
        "unbound": (True, True, False, []),
        "unreserved": (False, True, False, []),
    }
    for step, left in left_by_step.items():
        got = r[f"unprepare/{step}"]
        assert got["prepare"] == answer, (step, got["prepare"])
        assert got["call"] == "UNAVAILABLE", (step, got["call"])
        assert at(got["left"]) == left, (step, got["left"])
        whole = left[2]
        if not whole:
            assert got["left"]["claim_dirs"] == [], (step, got["left"])
        assert got["kept"] == int(whole), (step, got["kept"])
        assert got["after_restart"] == (prepared if whole else nothing), (step, got["after_restart"])
        assert got["retry"] == {uid: ""} and got["end"] == nothing, (step, got["end"])
