"""The CSI node plugin on the real node, installed by the chart (``csi.enabled=true``).

Why real: registration is the kubelet's plugin watcher finding the plugin's socket and writing
the driver into the node's ``CSINode``; publishing is the kubelet calling ``NodePublishVolume``
for a pod's inline ``csi`` volume with the pod's own information, and the bind reaching the
pod's container through the kubelet's directory and the runtime. Only the real kubelet and
containerd can say these hold. One release for the module (tests run in order): the plugin
registers -> a pool's allowed namespace gets it, another does not -> the pod's deletion
drops the holder and the mount -> a pod in a namespace enforcing Pod Security ``restricted``
gets a CSI pool through the webhook, writes, and holds the pool against every release until
it is deleted -> a pod of a pool of 2 shares is admitted the same way and writes its share.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fixtures.chart_node import (
    CHART,
    ReleaseOnNode,
    host_mounts,
    import_offloadpool_image,
    node_values,
    remove_release,
)
from fixtures.host import cli
from fixtures.node import TOLERATION, RealNode
from offloadpool.api.constants import extended_resource_name, pool_label_key
from offloadpool.api.pods import ENV_POOL_DIR
from offloadpool.csi.config import DRIVER_NAME, CsiConfig
from offloadpool.region.files import manifest as manifests
from offloadpool.region.holding import published

pytestmark = pytest.mark.node

RELEASE = "csi"
ENFORCE = "pod-security.kubernetes.io/enforce"
PLUGIN_PODS = "app.kubernetes.io/name=offloadpool-csi"


@dataclass
class CsiE2E(ReleaseOnNode):
    node: RealNode
    root: Path
    ns: str
    allowed_ns: str
    other_ns: str
    pool: str
    config: CsiConfig
    image: str = ""
    restricted_ns: str = ""
    restricted_pool: str = ""
    shares_pool: str = ""
    seen: dict[str, Any] = field(default_factory=dict)

    def diagnostics(self) -> str:
        cp = self.cp
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.allowed_ns, check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.other_ns, check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.restricted_ns, check=False).stdout,
                cp.kubectl("get", "csinodes,offloadpools,offloadpoolnodes", "-o", "yaml", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", PLUGIN_PODS, "--tail=40", check=False).stdout,
                self.node.logs(3000),
            ]
        )

    def pod(self, ns: str, name: str) -> dict | None:
        return self.get("pod", name, "-n", ns)

    def holders(self) -> list[published.Published]:
        return published.load_all(self.root / self.pool)


@pytest.fixture(scope="module")
def csi_e2e(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[CsiE2E]:
    """helm install with the CSI plugin and the webhook on, on the test node's kubelet
    directory; afterwards the pools, the release, the CSIDriver and the namespaces are gone,
    whatever happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    kubelet_dir = str(real_node.workdir / "kubelet")
    e2e = CsiE2E(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-csi-{suffix}",
        allowed_ns=f"csi-allowed-{suffix}",
        other_ns=f"csi-other-{suffix}",
        pool=f"csi-tmpfs-{suffix}",
        config=CsiConfig(node_id=real_node.name, kubelet_dir=kubelet_dir),
        image=image,
        restricted_ns=f"csi-restricted-{suffix}",
        restricted_pool=f"csi-rs-{suffix}",
        shares_pool=f"csi-shares-{suffix}",
    )
    cp = real_node.control_plane
    try:
        for ns in (e2e.allowed_ns, e2e.other_ns, e2e.restricted_ns):
            cp.kubectl("create", "namespace", ns)
        cp.kubectl("label", "namespace", e2e.restricted_ns, f"{ENFORCE}=restricted")
        cp.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            e2e.ns,
            "--create-namespace",
            "--take-ownership",
            *node_values(image),
            "--set",
            "csi.enabled=true",
            "--set",
            f"csi.kubeletDir={kubelet_dir}",
            "--set-json",
            f"csi.tolerations={json.dumps([TOLERATION])}",
            # the plugin's own namespace check, as on a cluster without the webhook: the guard
            # refuses a hand-written csi volume of the driver wherever the webhook looks
            "--set-json",
            f"webhook.excludeNamespaces={json.dumps([e2e.allowed_ns, e2e.other_ns])}",
            timeout=120,
        )
        yield e2e
    finally:
        consumers = [e2e.allowed_ns, e2e.other_ns, e2e.restricted_ns]
        pools = [e2e.pool, e2e.restricted_pool, e2e.shares_pool]
        remove_release(cp, RELEASE, e2e.ns, pools, real_node.name, consumers)
        cp.kubectl("delete", "csidriver", DRIVER_NAME, "--ignore-not-found", check=False)


def test_csi_the_kubelet_registers_the_plugin_from_the_chart(csi_e2e: CsiE2E) -> None:
    """The chart's DaemonSet runs the plugin on the node; the kubelet's plugin watcher finds its
    registration socket and writes the driver, with the node's name as its id, into the node's
    CSINode; the plugin hears that it is registered."""
    e2e = csi_e2e

    def plugin_running() -> dict | None:
        pods = e2e.get("pods", "-n", e2e.ns, "-l", PLUGIN_PODS) or {}
        running = [p for p in pods.get("items", []) if p["status"].get("phase") == "Running"]
        return running[0] if running else None

    plugin = e2e.wait("the CSI plugin's pod Running", plugin_running, 180)
    assert plugin["spec"]["nodeName"] == e2e.node.name

    def registered() -> dict | None:
        csinode = e2e.get("csinode", e2e.node.name) or {}
        drivers = {d["name"]: d for d in (csinode.get("spec") or {}).get("drivers") or []}
        return drivers.get(DRIVER_NAME)

    driver = e2e.wait(f"{DRIVER_NAME} in CSINode {e2e.node.name}", registered, 120)
    assert driver["nodeID"] == e2e.node.name, driver
    assert stat.S_ISSOCK(os.lstat(e2e.config.registration).st_mode)
    assert stat.S_ISSOCK(os.lstat(e2e.config.endpoint).st_mode)

    def heard() -> str | None:
        out = e2e.cp.kubectl("logs", "-n", e2e.ns, plugin["metadata"]["name"], check=False).stdout
        return out if f"registered with the kubelet as {DRIVER_NAME}" in out else None

    e2e.wait("the plugin told of its registration", heard, 60)
    e2e.seen["registered"] = True


def _consumer(e2e: CsiE2E, name: str, pool: str) -> dict:
    """A busybox pod with nothing but an inline csi volume of the pool: it prints the pool's
    manifest as its mount shows it, then waits to be deleted."""
    script = "cat /pool/manifest.json; echo; ls /pool/mnt; echo CONSUMER-DONE; sleep 3600"
    return {
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
                    "image": e2e.node.images["busybox"],
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "pool", "mountPath": "/pool"}],
                }
            ],
            "volumes": [{"name": "pool", "csi": {"driver": DRIVER_NAME, "volumeAttributes": {"pool": pool}}}],
        },
    }


def test_csi_a_pod_of_an_allowed_namespace_gets_the_pool_another_is_refused(csi_e2e: CsiE2E) -> None:
    """A Ready tmpfs pool for one namespace: a pod there with an inline csi volume starts and
    reads the pool's manifest at its mount, and the plugin holds the pool for it (a record
    naming the pod); the same pod in another namespace never starts, the kubelet's event
    carrying the plugin's refusal. Both namespaces are left out of the webhooks
    (``webhook.excludeNamespaces``): where the webhook looks, its guard refuses such a
    hand-written volume first (tests/test_webhook_csi.py); here the node's check is tested."""
    e2e, cp = csi_e2e, csi_e2e.cp
    assert e2e.seen.get("registered"), "the plugin did not register (see the test before)"
    e2e.ready_memory_pool(e2e.pool, {"namespaces": [e2e.allowed_ns]})
    for ns in (e2e.allowed_ns, e2e.other_ns):
        cp.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_consumer(e2e, "consumer", e2e.pool)))

    def consumer_log() -> str | None:
        out = cp.kubectl("logs", "consumer", "-n", e2e.allowed_ns, check=False)
        return out.stdout if out.returncode == 0 and "CONSUMER-DONE" in out.stdout else None

    log = e2e.wait("the allowed consumer's log", consumer_log, 180)
    manifest, _ = json.JSONDecoder().raw_decode(log)
    host_manifest = json.loads((e2e.root / e2e.pool / "manifest.json").read_text())
    assert manifest == host_manifest and manifest["medium"] == "Memory", manifest
    pod = e2e.pod(e2e.allowed_ns, "consumer")
    assert pod is not None
    uid = pod["metadata"]["uid"]
    (holder,) = e2e.holders()
    assert (holder.pod_uid, holder.pod_namespace) == (uid, e2e.allowed_ns), holder
    assert holder.target_path.startswith(f"{e2e.config.kubelet_dir}/pods/{uid}/volumes/kubernetes.io~csi/")
    assert holder.target_path in host_mounts(), "the plugin's bind did not reach the host"
    e2e.seen["consumer"] = {"uid": uid, "target": holder.target_path}

    def refused() -> str | None:
        events = cp.kubectl("get", "events", "-n", e2e.other_ns, "-o", "json", check=False)
        for ev in json.loads(events.stdout or "{}").get("items", []):
            if ev.get("reason") == "FailedMount" and "PermissionDenied" in ev.get("message", ""):
                return str(ev["message"])
        return None

    message = e2e.wait("the other namespace's pod refused its mount", refused, 120)
    assert f"pool {e2e.pool} is not for namespace {e2e.other_ns}" in message, message
    other = e2e.pod(e2e.other_ns, "consumer")
    assert other is not None and other["status"].get("phase") == "Pending", other["status"]
    assert len(e2e.holders()) == 1


def test_csi_deleting_the_pod_drops_its_holder_and_mount(csi_e2e: CsiE2E) -> None:
    """The kubelet's unpublish after the pod's deletion: the holder record and the bind are
    gone, and the pool stays Ready on the host."""
    e2e, cp = csi_e2e, csi_e2e.cp
    seen = e2e.seen.get("consumer")
    assert seen, "no consumer attached (see the test before)"
    cp.kubectl("delete", "pod", "consumer", "-n", e2e.allowed_ns, "--grace-period=1", "--timeout=90s")
    e2e.wait("the holder record gone", lambda: not e2e.holders(), 120)
    e2e.wait("the bind gone", lambda: seen["target"] not in host_mounts(), 60)
    assert (e2e.root / e2e.pool / "manifest.json").exists()


# -- a restricted namespace, through the webhook ----------------------------------------------
RESTRICTED_POOL_BYTES = 16 << 20
#: what the engine in a restricted pod does: attach through the webhook's environment, write
#: a token at both ends, detach (the published volume alone holds the pool from here), wait
RESTRICTED_ENGINE = """
import os, sys, time
from offloadpool.pinning import attach
token = sys.argv[1].encode()
with attach(os.environ["ENV_POOL_DIR"], rank=0) as region:
    view = region.memoryview()
    view[: len(token)] = token
    view[region.size - len(token) :] = token
    view.release()
    print(f"wrote {token.decode()} at both ends of {region.size} bytes as uid {os.getuid()}", flush=True)
print("DETACHED", flush=True)
time.sleep(3600)
""".replace("ENV_POOL_DIR", ENV_POOL_DIR)
#: what a container needs of itself to pass ``restricted``; the webhook adds nothing to it
RESTRICTED_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _restricted_engine(e2e: CsiE2E, token: str, pool: str = "", name: str = "engine-0") -> dict:
    """The pod as a user writes it: the pool label and nothing else of offloadpool's."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"offloadpool.io/pool": pool or e2e.restricted_pool}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "engine",
                    "image": e2e.image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", RESTRICTED_ENGINE, token],
                    "resources": {"limits": {"memory": "64Mi", "cpu": "100m"}},
                    "securityContext": RESTRICTED_SECURITY,
                }
            ],
        },
    }


def _admit(e2e: CsiE2E, ns: str, manifest: str) -> None:
    """Apply the pod, once the operator serves the webhook (until it has written its caBundle,
    the call itself fails); any refusal fails the test."""

    def admitted() -> str | None:
        out = e2e.cp.kubectl("apply", "-n", ns, "-f", "-", input=manifest, check=False)
        if "failed calling webhook" in out.stderr:
            return None
        assert out.returncode == 0, out.stderr
        return out.stdout

    e2e.wait("the pod admitted through the webhook", admitted, 180)


def _host_bytes(pool_dir: Path, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of region 0, read on the host from its segment files."""
    for seg in manifests.load(pool_dir).regions[0].segments:
        if seg.offset <= offset and offset + length <= seg.offset + seg.bytes:
            with open(pool_dir / seg.file, "rb") as fh:
                fh.seek(offset - seg.offset)
                return fh.read(length)
    raise AssertionError(f"no segment of {pool_dir} holds bytes {offset}..{offset + length}")


def test_csi_restricted_namespace_pod_gets_its_pool_through_the_webhook_and_writes(csi_e2e: CsiE2E) -> None:
    """A CSI pool for a namespace enforcing ``restricted``: a pod carrying only the pool label
    is admitted (the API server's Pod Security judged the webhook's mutation), stored with the
    inline csi volume and no sidecar, runs as uid 1000 with no capability, attaches through
    ``OFFLOADPOOL_POOL_DIR`` and writes; the host reads its bytes from the pool's files, and the
    plugin's record names the pod."""
    e2e, cp = csi_e2e, csi_e2e.cp
    assert e2e.seen.get("registered"), "the plugin did not register (see the first test)"
    pool, ns = e2e.restricted_pool, e2e.restricted_ns
    e2e.ready_memory_pool(pool, {"namespaces": [ns], "uid": 1000, "gid": 1000, "delivery": "CSI"})
    token = f"restricted-{uuid.uuid4().hex[:8]}"
    manifest = json.dumps(_restricted_engine(e2e, token))

    def admitted() -> str | None:
        out = cp.kubectl("apply", "-n", ns, "-f", "-", input=manifest, check=False)
        # until the operator serves and has written its caBundle, the call itself fails
        if "failed calling webhook" in out.stderr:
            return None
        assert out.returncode == 0, out.stderr
        return out.stdout

    e2e.wait("the restricted pod admitted through the webhook", admitted, 180)
    stored = e2e.pod(ns, "engine-0")
    assert stored is not None
    spec = stored["spec"]
    assert spec["volumes"] == [
        {"name": f"offloadpool-{pool}", "csi": {"driver": DRIVER_NAME, "volumeAttributes": {"pool": pool}}}
    ], spec["volumes"]
    assert not spec.get("initContainers"), "a CSI pod has no lease sidecar"
    (engine,) = spec["containers"]
    assert engine["securityContext"] == RESTRICTED_SECURITY, "the webhook changed the container's privileges"
    assert {"name": f"offloadpool-{pool}", "mountPath": f"/offloadpool/{pool}"} in engine["volumeMounts"]

    def wrote() -> str | None:
        out = cp.kubectl("logs", "engine-0", "-n", ns, check=False)
        return out.stdout if out.returncode == 0 and "DETACHED" in out.stdout else None

    log = e2e.wait("the restricted engine wrote and detached", wrote, 180)
    assert f"wrote {token} at both ends of {RESTRICTED_POOL_BYTES} bytes as uid 1000" in log, log
    pool_dir = e2e.root / pool
    raw = token.encode()
    assert _host_bytes(pool_dir, 0, len(raw)) == raw
    assert _host_bytes(pool_dir, RESTRICTED_POOL_BYTES - len(raw), len(raw)) == raw
    pod = e2e.pod(ns, "engine-0")
    assert pod is not None and pod["status"]["phase"] == "Running", pod and pod["status"]
    uid = pod["metadata"]["uid"]
    (holder,) = published.load_all(pool_dir)
    assert (holder.pod_uid, holder.pod_namespace, holder.pod_name) == (uid, ns, "engine-0"), holder
    assert holder.target_path in host_mounts()
    named = f"pod {ns}/engine-0 (uid {uid})"
    e2e.seen["restricted"] = {"uid": uid, "target": holder.target_path, "pod": named}


def test_csi_growing_a_held_pool_waits_with_the_old_region_ready_and_advertised(csi_e2e: CsiE2E) -> None:
    """capacity 16Mi -> 512Mi while the restricted pod holds the pool (its published volume):
    past the old agent pod's memory limit (16Mi + the 256Mi overhead), which used to fail the
    node (Failed InsufficientMemory, label and extended resource gone). Now the node stays
    Ready on the old region with LeaseHeld naming the pod, keeps its label and extended
    resource, and the pool says Progressing=True RolloutPending; the agent pod is not replaced
    under the holder. The spec then goes back (the next test reshapes under the same pod)."""
    e2e, cp = csi_e2e, csi_e2e.cp
    seen = e2e.seen.get("restricted")
    assert seen, "no restricted pod attached (see the test before)"
    pool, node = e2e.restricted_pool, e2e.node.name
    node_object = f"{pool}.{node}"
    agents = cp.kubectl("get", "pods", "-n", e2e.ns, "-l", f"offloadpool.io/pool={pool}", "-o", "name").stdout

    cp.kubectl("patch", "offloadpool", pool, "--type=merge", "-p", '{"spec":{"capacity":"512Mi"}}')

    def growth_waits() -> dict | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        return status if status.get("reason") == "LeaseHeld" and status.get("pendingGeneration") else None

    status = e2e.wait("the growth waiting for the pod", growth_waits, 120)
    assert status["phase"] == "Ready" and seen["pod"] in status["message"], status
    assert status["bytesTotal"] == RESTRICTED_POOL_BYTES, status

    def pool_says_pending() -> dict | None:
        conds = {
            c["type"]: c
            for c in ((e2e.get("offloadpool", pool) or {}).get("status") or {}).get("conditions") or []
        }
        prog = conds.get("Progressing") or {}
        return conds if prog.get("reason") == "RolloutPending" else None

    conds = e2e.wait("the pool saying RolloutPending", pool_says_pending, 60)
    assert conds["Progressing"]["status"] == "True" and conds["Ready"]["status"] == "True", conds
    assert conds["Degraded"]["status"] == "False", conds
    time.sleep(8)  # several agent retries and operator passes: nothing fails meanwhile
    status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
    assert (status["phase"], status["reason"]) == ("Ready", "LeaseHeld"), status
    body = e2e.get("node", node) or {}
    assert body["metadata"]["labels"].get(pool_label_key(pool)) == "ready", body["metadata"]["labels"]
    assert body["status"]["allocatable"].get(extended_resource_name(pool)) == "1", body["status"]
    assert manifests.load(e2e.root / pool).total_bytes == RESTRICTED_POOL_BYTES, "grown under the pod"
    after = cp.kubectl("get", "pods", "-n", e2e.ns, "-l", f"offloadpool.io/pool={pool}", "-o", "name").stdout
    assert after == agents, "the agent pod was replaced under the holder"

    cp.kubectl("patch", "offloadpool", pool, "--type=merge", "-p", '{"spec":{"capacity":"16Mi"}}')

    def back() -> dict | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        return status if status.get("phase") == "Ready" and not status.get("pendingGeneration") else None

    e2e.wait("the node Ready at the spec put back", back, 120)


def test_csi_restricted_pod_holds_its_pool_against_release_reshape_and_deletion(csi_e2e: CsiE2E) -> None:
    """While the pod runs (its engine detached: the published volume alone holds the pool),
    ``offloadpool release`` on the host, a reshaping spec change and the pool's deletion (the
    agent's release and the pool's own wait) are refused or wait, each naming the pod; its
    deletion unpublishes, the deletion completes, and nothing of the pool is left."""
    e2e, cp = csi_e2e, csi_e2e.cp
    seen = e2e.seen.get("restricted")
    assert seen, "no restricted pod attached (see the test before)"
    pool, ns, named = e2e.restricted_pool, e2e.restricted_ns, seen["pod"]
    pool_dir = e2e.root / pool
    node_object = f"{pool}.{e2e.node.name}"

    out = cli("release", pool, "--root", str(e2e.root), check=False)
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 3 and named in said, said
    assert (pool_dir / "manifest.json").exists() and "freed" not in out.stdout

    cp.kubectl("patch", "offloadpool", pool, "--type=merge", "-p", '{"spec":{"capacity":"32Mi"}}')

    def reshape_waits() -> dict | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        return status if status.get("reason") == "LeaseHeld" and status.get("pendingGeneration") else None

    status = e2e.wait("the reshape waiting for the pod", reshape_waits, 120)
    assert named in status["message"] and status["phase"] == "Ready", status
    assert manifests.load(pool_dir).total_bytes == RESTRICTED_POOL_BYTES, "reshaped under the pod"

    cp.kubectl("delete", "offloadpool", pool, "--wait=false")

    def release_waits() -> dict | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        return status if status.get("phase") == "Draining" and status.get("reason") == "LeaseHeld" else None

    status = e2e.wait("the agent's release waiting for the pod", release_waits, 120)
    assert named in status["message"], status

    def deletion_waits() -> dict | None:
        conditions = ((e2e.get("offloadpool", pool) or {}).get("status") or {}).get("conditions") or []
        waiting = [c for c in conditions if c.get("reason") == "WaitingForRelease"]
        return waiting[0] if waiting and named in waiting[0]["message"] else None

    e2e.wait("the pool's deletion waiting, naming the pod", deletion_waits, 120)
    assert (pool_dir / "manifest.json").exists() and published.load_all(pool_dir)

    cp.kubectl("delete", "pod", "engine-0", "-n", ns, "--grace-period=1", "--timeout=90s")
    e2e.wait("the pool deleted", lambda: e2e.get("offloadpool", pool) is None, 180)
    e2e.wait("the bind gone", lambda: seen["target"] not in host_mounts(), 60)
    assert not pool_dir.exists(), list(pool_dir.iterdir())
    assert not (e2e.root / ".state" / pool).exists()
    assert not [m for m in host_mounts() if m.startswith(f"{pool_dir}/") or m == str(pool_dir)]
    assert not [m for m in host_mounts() if seen["uid"] in m], "a mount of the pod is left"


SHARES_POOL_BYTES = 16 << 20


def test_csi_a_pod_of_a_partitioned_pool_is_admitted_and_writes_one_share(csi_e2e: CsiE2E) -> None:
    """A CSI pool of 2 shares for the restricted namespace: a pod carrying only the pool label
    is admitted (the validating webhook finds it as the mutation wrote it, after the API
    server's defaults), attaches what its volume gives (one share, as a plain pool of half the
    capacity) and writes; the node shows that share claimed by the pod, through CSI."""
    e2e, cp = csi_e2e, csi_e2e.cp
    assert e2e.seen.get("registered"), "the plugin did not register (see the first test)"
    pool, ns = e2e.shares_pool, e2e.restricted_ns
    consumers = {"namespaces": [ns], "uid": 1000, "gid": 1000, "delivery": "CSI"}
    e2e.ready_memory_pool(pool, consumers, partitions=2)
    token = f"share-{uuid.uuid4().hex[:8]}"
    _admit(e2e, ns, json.dumps(_restricted_engine(e2e, token, pool=pool, name="share-0")))
    stored = e2e.pod(ns, "share-0")
    assert stored is not None
    env = {e["name"]: e for e in stored["spec"]["containers"][0]["env"]}
    assert env["OFFLOADPOOL_POD_UID"]["valueFrom"]["fieldRef"] == {
        "apiVersion": "v1",
        "fieldPath": "metadata.uid",
    }
    assert env["OFFLOADPOOL_CAPACITY_BYTES"]["value"] == str(SHARES_POOL_BYTES // 2)

    def wrote() -> str | None:
        out = cp.kubectl("logs", "share-0", "-n", ns, check=False)
        return out.stdout if out.returncode == 0 and "DETACHED" in out.stdout else None

    log = e2e.wait("the engine of the share wrote and detached", wrote, 180)
    assert f"wrote {token} at both ends of {SHARES_POOL_BYTES // 2} bytes as uid 1000" in log, log
    uid = (e2e.pod(ns, "share-0") or {})["metadata"]["uid"]
    node_object = f"{pool}.{e2e.node.name}"

    def claimed() -> list | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        taken = [s for s in status.get("shares") or () if s.get("claimed")]
        return taken or None

    (share,) = e2e.wait("the share claimed on the node", claimed, 60)
    assert (share["via"], share["holder"]) == ("CSI", uid), share
    cp.kubectl("delete", "pod", "share-0", "-n", ns, "--grace-period=1", "--timeout=90s")
    cp.kubectl("delete", "offloadpool", pool, "--timeout=120s")
    assert not (e2e.root / pool).exists()
