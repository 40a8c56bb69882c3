"""The CSI node plugin (offloadpool.csi) over a real unix socket, with real bind mounts.

Every scenario (tests/csi_scenarios.py) runs in a mount namespace of its own in which every
mount but a scratch tmpfs is read-only: the pool, the kubelet's directory and the plugin's
socket live on that tmpfs, and a mount the plugin wrongly made anywhere else is gone with the
namespace (and could not have written the host)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import offloadpool
from fixtures.host import private_mounts_python

pytestmark = pytest.mark.root

TESTS = Path(__file__).resolve().parent
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import csi_scenarios; csi_scenarios.main()"
POD = "0f8e1c2a-1111-4222-8333-444455556666"
OTHER_POD = "0f8e1c2a-9999-4222-8333-444455556666"


def scenario(tmp_path: Path, name: str) -> dict[str, Any]:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = subprocess.run(
        private_mounts_python(RUN, str(scratch), name), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_csi_identity_answers_on_root_only_sockets(tmp_path):
    """The plugin's sockets are root's alone (issue 36): whoever could dial the CSI socket could
    publish any pool to a target of its choosing."""
    r = scenario(tmp_path, "identity")
    assert r.pop("sockets") == {
        "csi": "0o600",
        "csi_dir": "0o700",
        "registration": "0o600",
        "csi_by_nobody": "Permission denied",
        "registration_by_nobody": "Permission denied",
    }
    assert r == {
        "name": "offloadpool.io",
        "version": offloadpool.__version__,
        "caps": 0,
        "ready": True,
        "node_id": "node-a",
        "node_caps": 0,
    }


def test_csi_publish_refuses_each_bad_field_before_touching_anything(tmp_path):
    r = scenario(tmp_path, "refusals")
    results = r["results"]
    assert r["before"]["mounts"] == [] and r["before"]["records"] == []
    assert r["after"] == r["before"], "a refused publish mounted, recorded or made something"
    absent = results.pop("absent pool")
    assert absent.startswith("NOT_FOUND: pool absent is not Ready"), absent
    for name, result in results.items():
        assert result.startswith("INVALID_ARGUMENT: "), (name, result)
    assert "symbolic link" in results["symlinked component"], results["symlinked component"]
    assert "not under" in results["outside pods"]
    assert "not in the directory of pod" in results["other pod's dir"]
    assert "must be a DNS-1123 label" in results["pool .."]
    assert "is not a pod name" in results["bad pod name"], results["bad pod name"]


def test_csi_publish_binds_a_ready_pool_nosuid_nodev_and_holds_it(tmp_path):
    r = scenario(tmp_path, "publish")
    assert r["first"] == "OK"
    (mount,) = [
        m
        for m in r["after_first"]["mounts"]
        if m["target"].endswith(f"{POD}/volumes/kubernetes.io~csi/kv-cache/mount")
    ]
    assert {"nosuid", "nodev", "ro"} <= set(mount["options"]), mount
    # the pool's own mount and its files are bound beneath: the engine sees its manifest and files
    assert r["manifest_via_target"]
    assert r["segments_via_target"] == r["segments_in_pool"] and r["segments_in_pool"]
    assert r["after_first"]["records"] == [
        {
            "volume_id": "csi-0123456789abcdef",
            "pod_uid": POD,
            "pod_namespace": "team-a",
            "target_path": mount["target"],
            "pod_name": "engine-0",
        }
    ]
    assert r["again"] == "OK" and r["after_again"] == r["after_first"], "a repeated publish changed something"
    assert r["other_volume_same_target"].startswith("ALREADY_EXISTS"), r["other_volume_same_target"]
    assert r["count"] >= 1
    assert r["release"].startswith("held: ")
    assert f"csi volume csi-0123456789abcdef of pod team-a/engine-0 (uid {POD})" in r["release"], r["release"]
    assert r["after_release"] == r["after_first"]


def test_csi_namespace_not_allowed_is_permission_denied(tmp_path):
    r = scenario(tmp_path, "namespace")
    assert r["result"].startswith("PERMISSION_DENIED: pool kv is not for namespace team-c"), r["result"]
    assert "team-a, team-b" in r["result"]
    assert r["after"] == r["before"] and r["after"]["mounts"] == [] and r["after"]["records"] == []


def test_csi_unpublish_unmounts_and_drops_the_record_idempotently(tmp_path):
    r = scenario(tmp_path, "unpublish")
    assert r["publish"] == "OK" and len(r["published"]["records"]) == 1
    # the bind, beneath it the pool's own mount, and in that the segment file
    assert [m["target"].rsplit("/", 2)[-2:] for m in r["published"]["mounts"]] == [
        ["kv-cache", "mount"],
        ["mount", "mnt"],
        ["mnt", "r0-s000"],
    ]
    assert r["unpublish"] == "OK"
    assert r["after"]["mounts"] == [] and r["after"]["records"] == []
    assert not any(p.endswith("kv-cache/mount") for p in r["after"]["tree"]), "the target was left"
    assert r["again"] == "OK" and r["unknown"] == "OK"
    assert r["count_after"] == 0
    assert r["release"] is True


def test_csi_restart_rebuilds_holders_from_records_and_the_mount_table(tmp_path):
    r = scenario(tmp_path, "restart")
    assert r["a"] == "OK" and r["b"] == "OK"
    assert r["records_before"] == ["csi-0123456789abcdef", "csi-bbbb", "csi-cccc"]
    assert r["kept"] == ["csi-0123456789abcdef"]
    assert [x["volume_id"] for x in r["after"]["records"]] == ["csi-0123456789abcdef"]
    assert [m["target"] for m in r["after"]["mounts"]] == [
        m["target"] for m in r["after"]["mounts"] if f"/{POD}/" in m["target"]
    ] and len(r["after"]["mounts"]) == 3
    assert r["unpublish_a"] == "OK" and r["end"]["mounts"] == [] and r["end"]["records"] == []


def test_csi_registration_answers_the_kubelets_plugin_watcher(tmp_path):
    """The registration socket in plugins_registry names the driver, the CSI socket (which
    answers there) and version 1.0.0, keeps the kubelet's verdict, and is gone at a stop."""
    r = scenario(tmp_path, "registration")
    scratch = tmp_path / "scratch"
    assert r["listed"] == ["r.sock"] and r["is_socket"]
    assert (r["type"], r["name"], r["versions"]) == ("CSIPlugin", "offloadpool.io", ["1.0.0"])
    assert r["endpoint"] == f"{scratch}/plugin/csi.sock"
    assert r["node_id"] == "node-a"
    assert r["status"] == [None, [True, ""], [False, "no"]]
    assert r["after_stop"] == [], "the registration socket outlived the plugin"


def test_csi_target_holds_only_the_engines_files_read_only_but_the_segments(tmp_path):
    """The pod's view: manifest, lease and the segments, nothing of the node's state; no name
    can be made, replaced or removed, the manifest and lease not written (even by root in the
    pod); the segments are written, and an engine attaches through the target."""
    r = scenario(tmp_path, "engine_view")
    assert r["publish"] == "OK"
    assert r["entries"] == ["lease", "manifest.json", "mnt"]
    assert r["mnt_entries"] == r["pool_mnt"] and r["pool_mnt"]
    assert r["mounts"] == {
        ".": ["nodev", "nosuid", "ro"],
        "mnt": ["nodev", "nosuid", "ro"],
        **{f"mnt/{name}": ["nodev", "nosuid", "rw"] for name in r["pool_mnt"]},
    }
    attempts = r["attempts"]
    assert attempts.pop("write segment") == "OK" and r["pool_reads"] == "pod"
    for what, result in attempts.items():
        assert result in ("EROFS", "EACCES", "EPERM", "EBUSY"), (what, result)
    assert attempts["create in mnt"] == "EROFS" and attempts["write lease"] == "EROFS"
    assert attempts["unlink segment"] in ("EROFS", "EBUSY")
    assert r["attached"] == 4 << 20


def test_csi_publish_zeroes_the_memory_for_a_new_pod_under_scrub_always(tmp_path):
    r = scenario(tmp_path, "scrub_on_new_holder")
    zeros = "00" * 11
    always = r["Always"]
    assert [always[k] for k in ("a", "unpublish_a", "b")] == ["OK"] * 3
    assert always["b_reads"] == zeros, "pod B read what pod A left in the pool"
    assert "handed to pod " + POD.replace("1111", "9999") in always["scrub_reason"]
    # the same pod again is the same holder; a pod joining a held pool joins its tenancy
    assert always["b_again"] == "OK" and always["b_reads_again"] == "bytes-of-b!"
    assert always["a_joins"] == "OK" and always["a_reads"] == "bytes-of-b!"
    assert always["holder"] == POD and always["end"] == ["OK", "OK"]
    # the pool's consumers are one consumer under OnConsumerChange; Never keeps the bytes
    for policy in ("OnConsumerChange", "Never"):
        p = r[policy]
        assert p["b"] == "OK" and p["b_reads"] == "secret-of-a", policy
        assert p["scrub_reason"] == "" and p["end"] == ["OK", "OK"], policy


def _tree(r):
    return [m for m in r["mounts"] if m.startswith("kubelet/")]


def test_csi_plugin_killed_mid_publish_or_unpublish_converges(tmp_path):
    """kill -9 of the plugin process at each step (it stops itself there, the test kills it):
    the next plugin's rebuild and the kubelet's retry leave exactly one whole tree and one
    holder, or after an unpublish nothing; no mount leaked (not at the target, not in the
    plugin's stage, not under the pool's own mount), no holder lost or invented."""
    r = scenario(tmp_path, "faults")
    target = f"kubelet/pods/{POD}/volumes/kubernetes.io~csi/kv-cache/mount"
    whole = [target, f"{target}/mnt", f"{target}/mnt/r0-s000"]
    nothing = {"mounts": [], "records": [], "target_dir": False, "pool_mnt_mounts": 1}
    for step in ("recorded", "staged", "bound"):
        s = r[f"publish/{step}"]
        assert s["call"].startswith("UNAVAILABLE"), (step, s["call"])
        assert s["left"]["records"] == ["csi-0123456789abcdef"], step  # recorded before mounting
        if step == "bound":  # the whole tree was at the target: kept, as it holds the pool
            assert s["kept"] == "1 published volumes" and _tree(s["after_restart"]) == whole
        else:  # nothing at the target: the record dropped, the stage cleared at start
            assert s["kept"] == "0 published volumes", step
            assert s["after_restart"] == nothing, (step, s["after_restart"])
        assert s["retry"] == "OK" and s["after_retry"]["mounts"] == whole, (step, s["after_retry"])
        assert s["after_retry"]["records"] == ["csi-0123456789abcdef"] and s["holders"] == 1, step
        assert s["unpublish"] == "OK" and s["end"] == nothing, (step, s["end"])
    u = r["unpublish/unbound"]
    assert u["publish"] == "OK" and u["call"].startswith("UNAVAILABLE")
    assert u["left"]["mounts"] == [] and u["left"]["records"] == ["csi-0123456789abcdef"]
    assert u["kept"] == "0 published volumes" and u["after_restart"]["records"] == []
    assert u["retry"] == "OK" and u["end"] == nothing and u["holders"] == 0


def test_csi_plugin_killed_while_zeroing_for_a_new_pod_leaves_the_pool_withheld(tmp_path):
    r = scenario(tmp_path, "scrub_fault")
    assert r["a"] == r["unpublish_a"] == "OK" and r["call"].startswith("UNAVAILABLE")
    assert r["phase"] == "Scrubbing"
    assert r["b_refused"].startswith("NOT_FOUND: pool kv-always is not Ready on this node (Scrubbing")
    assert r["phase_after"] == "Ready" and r["b"] == "OK"
    assert r["b_reads"] == "00" * 11, "pod B read what pod A left after an interrupted scrub"
    assert r["end"] == "OK"


def test_csi_liveness_probe_fails_once_the_plugin_is_gone(tmp_path):
    r = scenario(tmp_path, "liveness")
    assert r["serving"][0] == 0 and r["serving"][1].endswith("csi.sock: ready"), r["serving"]
    assert r["spawned"][0] == 0, r["spawned"]
    assert r["killed"][0] == 1 and "Probe on " in r["killed"][1] and "UNAVAILABLE" in r["killed"][1], r


def test_csi_shares_give_each_pod_its_own_share_across_both_deliveries(tmp_path):
    r = scenario(tmp_path, "shares")
    assert r["a"] == "OK" and r["a_again"] == "OK" and r["a_mounts"] == 1, r
    a_share = r["records"]["csi-aaaa"]
    b_share = r["records"]["csi-bbbb"]
    assert {a_share, b_share} == {0, 1}, r["records"]
    # the pod's view is a plain pool of its share alone: attach works unchanged
    assert r["a_view"]["entries"] == ["lease", "manifest.json", "mnt"]
    assert r["a_view"]["mnt"] and all(n.startswith(f"p{a_share}-") for n in r["a_view"]["mnt"]), r["a_view"]
    assert all(n.startswith(f"p{b_share}-") for n in r["b_view"]["mnt"]), r["b_view"]
    assert r["a_attached"] == {"size": 2 << 20, "share": None, "shares": 1}
    # the hostPath engine got the other share, never pod A's; then pod B could not have one
    assert r["engine_claim"] == 1 - a_share
    assert r["seen_full"] == {str(a_share): POD, str(1 - a_share): "engine-x"}
    assert r["b_full"].startswith("RESOURCE_EXHAUSTED: no free share"), r["b_full"]
    assert f"csi volume of pod '{POD}'" in r["b_full"] and "'engine-x'" in r["b_full"], r["b_full"]
    assert r["b_full_records"] == ["csi-aaaa"], "a refused publish left a record"
    assert f"share {a_share} by csi volume of pod '{POD}'" in r["engine_y"], r["engine_y"]
    # pod B, given the share the engine left, never sees pod A's bytes
    assert r["b_reads"] == "00000000", r["b_reads"]
    assert r["reserved"] == {str(a_share): POD, str(b_share): OTHER_POD}
    # a restart makes the lost reservation again from the record
    assert r["kept"] == ["csi-aaaa", "csi-bbbb"]
    assert r["reserved_after_restart"] == r["reserved"]
    # unpublish frees the share: the node sees it free, an engine can claim it
    assert r["unpublish_a"] == "OK"
    assert r["seen_after_a"] == {str(a_share): "", str(b_share): OTHER_POD}
    assert r["engine_after_a"] == a_share
    assert r["unpublish_b"] == "OK"
    assert r["end"] == {"mounts": [], "records": True} and r["end_reserved"], r["end"]


def test_csi_publish_never_waits_on_a_pods_lock_or_another_pools(tmp_path):
    r = scenario(tmp_path, "locks")
    assert r["kv2"] == "OK", r
    assert r["kv2_seconds"] < 3, f"pool kv2's publish waited {r['kv2_seconds']:.1f} s"
    assert r["kv_while_held"] == "waiting" and r["kv"] == "OK", r
    assert r["unpublish_kv2"] == r["unpublish_kv"] == "OK", r


def test_csi_share_is_zeroed_for_a_new_pod_while_another_share_is_held(tmp_path):
    """Issue 36 finding 7: ``scrub: Always`` per share. Pod C holds one share throughout, so
    the pool is never free; pod B, given the share pod A left, reads zeros and C's bytes are
    untouched; B's retry keeps B's bytes; a hostPath engine's claim makes the next pod's share
    zeroed too."""
    r = scenario(tmp_path, "share_scrub")
    assert [r[k] for k in ("a", "c", "unpublish_a", "b")] == ["OK"] * 4, r
    assert {r["a_share"], r["c_share"]} == {0, 1} and r["b_share"] == r["a_share"], r
    assert r["b_reads"] == "00" * 12, "pod B read what pod A left in its share"
    assert r["c_reads"] == "secret-of-c!", "the zeroing reached the share pod C holds"
    assert r["scrub"]["share"] == r["a_share"] and f"handed to {OTHER_POD}" in r["scrub"]["reason"], r[
        "scrub"
    ]
    assert f"{POD} had it before" in r["scrub"]["reason"], r["scrub"]
    assert r["b_again"] == "OK" and r["b_reads_again"] == "bytes-of-b!!", "a retry zeroed the pod's own bytes"
    assert r["unpublish_b"] == "OK" and r["engine_share"] == r["a_share"]
    assert r["a_again"] == "OK" and r["a_again_share"] == r["engine_share"]
    assert r["a_reads"] == "00" * 12, "pod A read what a hostPath engine left in the share"
    assert r["c_reads_end"] == "secret-of-c!" and r["end"] == ["OK", "OK"]


def test_csi_plugin_killed_while_zeroing_a_share_withholds_that_share_alone(tmp_path):
    r = scenario(tmp_path, "share_scrub_fault")
    assert r["a"] == r["c"] == r["unpublish_a"] == "OK" and r["call"].startswith("UNAVAILABLE"), r
    assert r["pending"] and r["phase"] == "Ready", r
    assert r["share_manifest"] is False and r["modes"] == ["0o600"], r
    assert r["c_reads"] == "secret-of-c!"
    assert r["pending_after_provision"] is False, "the agent's provision left the share pending"
    assert r["b"] == "OK" and r["b_reads"] == "00" * 12, (
        "pod B read what pod A left after an interrupted zeroing"
    )
    assert r["c_reads_end"] == "secret-of-c!" and r["end"] == ["OK", "OK"]


def test_csi_publish_for_a_pool_being_deleted_is_refused(tmp_path):
    """Issue 36 finding 7: once the agent notes the pool's deletion, no new volume is given it
    (a new holder would hold the deletion for ever); the volume given before keeps working,
    its retry is answered, and it is unpublished as ever."""
    r = scenario(tmp_path, "deleting")
    assert r["a"] == "OK" and r["marked"] is True
    assert r["b"].startswith("FAILED_PRECONDITION: pool kv is being deleted"), r["b"]
    assert "OffloadPool was deleted" in r["b"], r["b"]
    assert r["a_again"] == "OK" and r["a_reads"] == "still-here"
    assert [x["volume_id"] for x in r["after"]] == ["csi-0123456789abcdef"], "a refused publish left a record"
    assert r["unpublish_a"] == "OK" and r["end"]["mounts"] == [] and r["end"]["records"] == []
