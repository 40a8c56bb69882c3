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

from fixtures.host import private_mounts_python

pytestmark = pytest.mark.root

TESTS = Path(__file__).resolve().parent
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import csi_scenarios; csi_scenarios.main()"
POD = "0f8e1c2a-1111-4222-8333-444455556666"


def scenario(tmp_path: Path, name: str) -> dict[str, Any]:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = subprocess.run(
        private_mounts_python(RUN, str(scratch), name), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_csi_identity_answers(tmp_path):
    r = scenario(tmp_path, "identity")
    assert r == {
        "name": "offloadpool.io",
        "version": "0.1.0",
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
    assert {"nosuid", "nodev", "rw"} <= set(mount["options"]), mount
    # the recursive bind carries the pool's own mount: the engine sees its manifest and files
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
    # the bind and, beneath it, the pool's own mount it carries
    assert [m["target"].rsplit("/", 2)[-2:] for m in r["published"]["mounts"]] == [
        ["kv-cache", "mount"],
        ["mount", "mnt"],
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
    ] and len(r["after"]["mounts"]) == 2
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
