"""Faults of the CSI node plugin on the real node: kill -9 of the chart's plugin mid-publish and
mid-unpublish, and a kubelet restart while a pod holds a pool through a ``csi`` volume.

Why real: what must converge is the kubelet's retries (its volume manager's back-off), the
DaemonSet's container restart, the kubelet's plugin watcher re-registering the plugin, and the
binds that reach the host through the kubelet's shared directory; tests/test_csi_node.py shows
the plugin's own side with the plugin as a bare process, only the real kubelet and containerd
can show these. The plugin is held at a step by its fault hook and killed ``-9`` from the
host (``fixtures.plugin_faults``, shared with the DRA plugin's faults). After each fault the
node must hold exactly one holder record per live pod and exactly the mounts those pods'
volumes need: none left in the kubelet's pods directory, in the plugin's stage or under the
pool's mount.

One release for the module (tests run in order): the stage is private -> kill mid-publish
(after the stage, after the bind) -> kill mid-unpublish -> kubelet restart.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fixtures.chart_node import (
    CHART,
    ReleaseOnNode,
    import_offloadpool_image,
    node_values,
    remove_release,
)
from fixtures.node import TOLERATION, RealNode
from fixtures.plugin_faults import (
    PluginUnderTest,
    StoppablePlugin,
    kubelet_ready,
    mountinfo,
    plugin_pids,
    restart_kubelet,
)
from offloadpool.csi import faults
from offloadpool.csi.config import DRIVER_NAME, CsiConfig
from offloadpool.csi.publication import engine_files
from offloadpool.region.holding import published

pytestmark = pytest.mark.node

RELEASE = "csifaults"
PLUGIN_PODS = "app.kubernetes.io/name=offloadpool-csi"
REGISTERED = f"registered with the kubelet as {DRIVER_NAME}"
#: the source name of the plugin's staging tmpfs (``csi.bind.prepare_stage``)
STAGE_SOURCE = "offloadpool-csi-stage"
STAGE = CsiConfig(node_id="any").stage


@dataclass
class Faults(ReleaseOnNode, StoppablePlugin):
    node: RealNode
    root: Path
    ns: str
    consumer_ns: str
    pool: str
    config: CsiConfig
    seen: dict[str, Any] = field(default_factory=dict)

    @property
    def plugin_under_test(self) -> PluginUnderTest:
        return PluginUnderTest(
            PLUGIN_PODS,
            REGISTERED,
            "offloadpool.csi",
            f"daemonset/{RELEASE}-csi",
            self.config.kubelet_dir,
            Path(self.config.endpoint).parent,
        )

    def diagnostics(self) -> str:
        cp = self.cp
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.consumer_ns, check=False).stdout,
                cp.kubectl("get", "csinodes", "-o", "yaml", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", PLUGIN_PODS, "--tail=40", check=False).stdout,
                self.node.logs(3000),
            ]
        )

    def holders(self) -> list[published.Published]:
        return published.load_all(self.root / self.pool)

    def consumer(self, name: str) -> None:
        """A busybox pod with an inline csi volume of the pool, waiting to be deleted."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": 1,
                "tolerations": [TOLERATION],
                "containers": [
                    {
                        "name": "main",
                        "image": self.node.images["busybox"],
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "ls /pool/mnt; sleep 3600"],
                        "volumeMounts": [{"name": "pool", "mountPath": "/pool"}],
                    }
                ],
                "volumes": [
                    {"name": "pool", "csi": {"driver": DRIVER_NAME, "volumeAttributes": {"pool": self.pool}}}
                ],
            },
        }
        self.cp.kubectl("apply", "-n", self.consumer_ns, "-f", "-", input=json.dumps(pod))

    def running(self, name: str) -> dict:
        def phase() -> dict | None:
            pod = self.get("pod", name, "-n", self.consumer_ns) or {}
            return pod if (pod.get("status") or {}).get("phase") == "Running" else None

        return self.wait(f"pod {name} Running", phase, 240)

    def delete(self, name: str, *, wait: bool = True) -> None:
        self.cp.kubectl(
            "delete", "pod", name, "-n", self.consumer_ns, "--grace-period=1", f"--wait={str(wait).lower()}"
        )

    def gone(self, name: str) -> None:
        self.wait(f"pod {name} gone", lambda: self.get("pod", name, "-n", self.consumer_ns) is None, 240)

    def expected_mounts(self, uids: list[str]) -> Counter[str]:
        """The host's mounts the live pods' volumes need: each one's tree, once."""
        files = engine_files(self.root / self.pool)
        want: Counter[str] = Counter()
        for pub in self.holders():
            if pub.pod_uid in uids:
                want.update([pub.target_path, f"{pub.target_path}/mnt"])
                want.update(f"{pub.target_path}/mnt/{f}" for f in files)
        return want

    def assert_converged(self, uids: list[str]) -> None:
        """Exactly one holder per live pod (none for another), and on the host exactly their
        volumes' mounts in the kubelet's pods directory, nothing in or from the plugin's stage,
        nothing beneath the pool's mount."""
        holders = self.holders()
        assert sorted(h.pod_uid for h in holders) == sorted(uids), holders
        assert all(h.pod_namespace == self.consumer_ns for h in holders), holders
        mounts = mountinfo()
        pods_dir = f"{self.config.kubelet_dir}/pods/"
        csi = Counter(m.point for m in mounts if m.point.startswith(pods_dir) and "~csi/" in m.point)
        assert csi == self.expected_mounts(uids), csi
        staged = [m for m in mounts if m.source == STAGE_SOURCE or os.path.dirname(STAGE) in m.point]
        assert not staged, staged
        pool_mnt = f"{self.root / self.pool}/mnt"
        assert [m.point for m in mounts if m.point.startswith(f"{pool_mnt}/")] == []
        assert sum(1 for m in mounts if m.point == pool_mnt) == self.seen["pool mounts"]


@pytest.fixture(scope="module")
def csi_faults(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[Faults]:
    """helm install with the CSI plugin on (the webhook off) and a Ready tmpfs pool for one
    namespace; afterwards the pool, the release, the CSIDriver and the namespace are gone."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    kubelet_dir = str(real_node.workdir / "kubelet")
    f = Faults(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-csifaults-{suffix}",
        consumer_ns=f"csi-faults-{suffix}",
        pool=f"csi-faults-{suffix}",
        config=CsiConfig(node_id=real_node.name, kubelet_dir=kubelet_dir),
    )
    cp = real_node.control_plane
    try:
        cp.kubectl("create", "namespace", f.consumer_ns)
        cp.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            f.ns,
            "--create-namespace",
            "--take-ownership",
            *node_values(image),
            "--set",
            "webhook.enabled=false",
            "--set",
            "csi.enabled=true",
            "--set",
            f"csi.kubeletDir={kubelet_dir}",
            "--set-json",
            f"csi.tolerations={json.dumps([TOLERATION])}",
            timeout=120,
        )
        f.ready_memory_pool(f.pool, {"namespaces": [f.consumer_ns]})
        f.wait("the plugin registered", lambda: f.registrations() >= 1, 180)
        pool_mnt = f"{shared_agent_root / f.pool}/mnt"
        f.seen["pool mounts"] = sum(1 for m in mountinfo() if m.point == pool_mnt)
        assert f.seen["pool mounts"] >= 1, f"{pool_mnt} is not mounted on the host"
        yield f
    finally:
        f.remove_once_files()
        remove_release(cp, RELEASE, f.ns, [f.pool], real_node.name, [f.consumer_ns])
        cp.kubectl("delete", "csidriver", DRIVER_NAME, "--ignore-not-found", check=False)


def test_csi_the_plugins_stage_is_private_to_its_container(csi_faults: Faults) -> None:
    """The plugin builds each volume's tree in its stage (a tmpfs it mounts at start) before
    binding it at the target: what is mounted there must never reach the host. The stage and
    its parent in the plugin's container are in no peer group, the parent being the chart's
    emptyDir (private whatever the runtime makes of the container's root, which a runtime may
    make shared for a Bidirectional volume), and the host has no staging tmpfs."""
    f = csi_faults
    (pid,) = plugin_pids("offloadpool.csi", f.config.kubelet_dir)
    inside = mountinfo(str(pid))
    by_id = {m.id: m for m in inside}
    stage = [m for m in inside if m.point == STAGE]
    assert stage and stage[-1].source == STAGE_SOURCE, stage
    parent = by_id[stage[-1].parent]
    assert not [t for t in parent.tags + stage[-1].tags if t.startswith("shared:")], (parent, stage[-1])
    assert parent.point == os.path.dirname(STAGE), parent
    assert not [m for m in mountinfo() if m.source == STAGE_SOURCE], "the staging tmpfs reached the host"


@pytest.mark.parametrize("step", [faults.STAGED, faults.BOUND])
def test_csi_plugin_killed_mid_publish_converges(csi_faults: Faults, step: str) -> None:
    """kill -9 of the plugin stopped mid-publish (its tree half built in the stage, or bound at
    the target): the kubelet restarts it in its pod, the kubelet's retry publishes the volume,
    the pod runs with its pool, and the node holds one holder and one tree per live pod."""
    f = csi_faults
    once = f.stop_at(step)
    name = f"pub-{step}"
    f.consumer(name)
    f.kill_the_stopped_plugin(once)
    pod = f.running(name)
    f.seen.setdefault("live", {})[name] = pod["metadata"]["uid"]

    def listed() -> str | None:
        out = f.cp.kubectl("logs", name, "-n", f.consumer_ns, check=False).stdout
        return out if out.strip() else None

    log = f.wait(f"pod {name} listed its pool's mount", listed, 60)
    assert set(engine_files(f.root / f.pool)) <= set(log.split()), log
    f.assert_converged(list(f.seen["live"].values()))


def test_csi_plugin_killed_mid_unpublish_converges(csi_faults: Faults) -> None:
    """A new plugin (rebuilt over two live volumes: it keeps both) stopped mid-unpublish, the
    tree detached but the record kept, and killed: after its restart the kubelet's retry
    finishes, the pod goes, its holder and mounts with it, the other pod's stay whole."""
    f = csi_faults
    live: dict[str, str] = f.seen.get("live", {})
    assert len(live) == 2, f"the mid-publish tests left {live}"
    once = f.stop_at(faults.UNBOUND)
    f.assert_converged(list(live.values()))  # the new plugin kept both volumes
    victim = sorted(live)[0]
    f.delete(victim, wait=False)
    f.kill_the_stopped_plugin(once)
    f.gone(victim)
    del live[victim]
    f.assert_converged(list(live.values()))
    (rest,) = live
    f.delete(rest)
    f.gone(rest)
    del live[rest]
    f.assert_converged([])


def test_csi_kubelet_restart_keeps_the_pods_volume_and_reregisters(csi_faults: Faults) -> None:
    """A kubelet restart with a csi pod running: the kubelet registers the plugin again
    (CSINode still lists the driver, the plugin hears it), the pod keeps running with its
    mount, holder and tree unchanged, and its deletion afterwards unpublishes everything."""
    f = csi_faults
    f.set_env(f"{faults.STOP_AT_ENV}-", f"{faults.STOP_ONCE_ENV}-")
    f.consumer("across-restart")
    pod = f.running("across-restart")
    uid = pod["metadata"]["uid"]
    f.assert_converged([uid])
    holders_before, heard_before, restarts = f.holders(), f.registrations(), f.restarts()

    restart_kubelet(f.node)
    f.wait("the restarted kubelet Ready", lambda: kubelet_ready(f.node), 180)
    f.wait("the plugin told of its new registration", lambda: f.registrations() > heard_before, 120)
    csinode = f.get("csinode", f.node.name) or {}
    drivers = {d["name"]: d for d in (csinode.get("spec") or {}).get("drivers") or []}
    assert drivers.get(DRIVER_NAME, {}).get("nodeID") == f.node.name, csinode
    assert f.restarts() == restarts, "the kubelet restart restarted the plugin"
    after = f.get("pod", "across-restart", "-n", f.consumer_ns) or {}
    assert after["metadata"]["uid"] == uid and after["status"]["phase"] == "Running", after.get("status")
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    listed = f.cp.kubectl("exec", "-n", f.consumer_ns, "across-restart", "--", "ls", "/pool/mnt").stdout
    assert set(engine_files(f.root / f.pool)) <= set(listed.split()), listed
    assert f.holders() == holders_before
    f.assert_converged([uid])

    f.delete("across-restart")
    f.gone("across-restart")
    f.assert_converged([])
