"""The DRA driver on the real node, installed by the chart (``dra.enabled=true``): the kubelet,
the kube-scheduler and containerd with CDI (docs/dra.md).

Why real: that the scheduler reads the agent's ResourceSlice and allocates a share, that the
kubelet's plugin manager registers the plugin and calls ``NodePrepareResources``, and that
containerd applies the CDI spec's mount to the container, only the real binaries can say. One
release for the module (tests run in order): the plugin registers and the slice shows each
share -> in a namespace enforcing Pod Security ``restricted``, a pod asking with a
ResourceClaimTemplate gets a share and writes it, a second pod the other share, a third stays
Pending with the scheduler's own reason and runs once the first is deleted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.chart_node import CHART, ReleaseOnNode, import_offloadpool_image, node_values, remove_release
from fixtures.node import TOLERATION, RealNode
from offloadpool.api import dra
from offloadpool.region.holding import published

pytestmark = pytest.mark.node

RELEASE = "dra"
ENFORCE = "pod-security.kubernetes.io/enforce"
PLUGIN_PODS = "app.kubernetes.io/name=offloadpool-dra"
TEMPLATE = "kv-share"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "dra"
EXAMPLE_TEMPLATE = EXAMPLES / "claim-template.yaml"
EXAMPLE_POD = EXAMPLES / "pod.yaml"
POOL_BYTES = 16 << 20
SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
#: the engine: attach the pool at OFFLOADPOOL_POOL_DIR (the CDI spec's env), write a token, hold
ENGINE = """
import os, sys, time
from offloadpool.pinning import attach
token = sys.argv[1].encode()
with attach(os.environ["OFFLOADPOOL_POOL_DIR"], rank=0) as region:
    view = region.memoryview()
    view[: len(token)] = token
    view.release()
    share = os.environ.get("OFFLOADPOOL_SHARE")
    print(f"wrote {token.decode()} to share {share} ({region.size} bytes)", flush=True)
print("DETACHED", flush=True)
time.sleep(3600)
"""


@dataclass
class DraE2E(ReleaseOnNode):
    node: RealNode
    root: Path
    ns: str
    consumer_ns: str
    pool: str
    image: str
    seen: dict[str, Any] = field(default_factory=dict)

    def diagnostics(self) -> str:
        cp = self.cp
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl(
                    "get", "pods,events,resourceclaims", "-n", self.consumer_ns, "-o", "wide", check=False
                ).stdout,
                cp.kubectl("get", "resourceslices,offloadpoolnodes", "-o", "yaml", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", PLUGIN_PODS, "--tail=60", check=False).stdout,
                self.node.logs(3000),
            ]
        )

    def pod(self, name: str) -> dict | None:
        return self.get("pod", name, "-n", self.consumer_ns)

    def engine(self, name: str, token: str) -> None:
        """examples/dra/pod.yaml with the test's name, image, engine and node toleration: its
        claim from the template, its claim in the container's resources, its security."""
        body = yaml.safe_load(EXAMPLE_POD.read_text())
        assert body["spec"]["resourceClaims"] == [{"name": "kv", "resourceClaimTemplateName": TEMPLATE}]
        (container,) = body["spec"]["containers"]
        assert (
            container["resources"] == {"claims": [{"name": "kv"}]}
            and container["securityContext"] == SECURITY
        )
        body["metadata"] = {"name": name}
        body["spec"].update(
            automountServiceAccountToken=False, terminationGracePeriodSeconds=1, tolerations=[TOLERATION]
        )
        container.update(
            image=self.image,
            imagePullPolicy="Never",
            command=["python", "-c", ENGINE, token],
            resources={"limits": {"memory": "64Mi", "cpu": "100m"}, "claims": [{"name": "kv"}]},
        )
        self.cp.kubectl("apply", "-n", self.consumer_ns, "-f", "-", input=json.dumps(body))

    def wrote(self, name: str, token: str) -> str:
        def done() -> str | None:
            out = self.cp.kubectl("logs", name, "-n", self.consumer_ns, check=False)
            return out.stdout if out.returncode == 0 and "DETACHED" in out.stdout else None

        log = self.wait(f"pod {name} wrote its share", done, 240)
        assert f"wrote {token} to share " in log, log
        return log


@pytest.fixture(scope="module")
def dra_e2e(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[DraE2E]:
    """helm install with the DRA driver on the test node's kubelet directory and CDI directory,
    a namespace enforcing restricted with a ResourceClaimTemplate, a 2-share pool for it;
    afterwards all of it gone, whatever happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    e2e = DraE2E(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-dra-{suffix}",
        consumer_ns=f"dra-restricted-{suffix}",
        pool=f"dra-kv-{suffix}",
        image=image,
    )
    cp = real_node.control_plane
    try:
        cp.kubectl("create", "namespace", e2e.consumer_ns)
        cp.kubectl("label", "namespace", e2e.consumer_ns, f"{ENFORCE}=restricted")
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
            "dra.enabled=true",
            "--set",
            f"csi.kubeletDir={real_node.workdir / 'kubelet'}",
            "--set",
            f"dra.cdiDir={real_node.workdir / 'cdi'}",
            "--set-json",
            f"csi.tolerations={json.dumps([TOLERATION])}",
            timeout=120,
        )
        # examples/dra/claim-template.yaml as a user applies it, its pool and namespace renamed
        template = yaml.safe_load(EXAMPLE_TEMPLATE.read_text())
        assert template["metadata"]["name"] == TEMPLATE
        (request,) = template["spec"]["spec"]["devices"]["requests"]
        (selector,) = request["exactly"]["selectors"]
        assert request["exactly"]["deviceClassName"] == dra.DEVICE_CLASS
        selector["cel"]["expression"] = selector["cel"]["expression"].replace(
            '"tmpfs-shares"', f'"{e2e.pool}"'
        )
        assert e2e.pool in selector["cel"]["expression"]
        template["metadata"]["namespace"] = e2e.consumer_ns
        cp.kubectl("apply", "-n", e2e.consumer_ns, "-f", "-", input=json.dumps(template))
        pool = {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": e2e.pool},
            "spec": {
                "capacity": "16Mi",
                "medium": "Memory",
                "partitions": 2,
                "tolerations": [TOLERATION],
                "consumers": {"namespaces": [e2e.consumer_ns], "uid": 1000, "gid": 1000},
            },
        }
        cp.kubectl("apply", "-f", "-", input=json.dumps(pool))
        yield e2e
    finally:
        remove_release(cp, RELEASE, e2e.ns, [e2e.pool], real_node.name, [e2e.consumer_ns])
        cp.kubectl("delete", "deviceclass", dra.DEVICE_CLASS, "--ignore-not-found", check=False)


def test_dra_the_plugin_registers_and_the_slice_shows_each_share(dra_e2e: DraE2E) -> None:
    """The chart's plugin registers with the kubelet (it logs the kubelet's word); the agent's
    ResourceSlice of the Ready pool shows both shares with their bytes."""
    e2e, cp = dra_e2e, dra_e2e.cp

    def registered() -> str | None:
        out = cp.kubectl("logs", "-n", e2e.ns, "-l", PLUGIN_PODS, "--tail=50", check=False).stdout
        return out if "registered with the kubelet as offloadpool.io (DRAPlugin)" in out else None

    e2e.wait("the DRA plugin registered", registered, 240)
    name = dra.slice_name(e2e.pool, e2e.node.name)

    def published_slice() -> dict | None:
        s = e2e.get("resourceslice", name)
        return (
            s if s and [d["name"] for d in s["spec"].get("devices") or []] == ["share-0", "share-1"] else None
        )

    got = e2e.wait("the pool's slice with both shares", published_slice, 240)
    assert got["spec"]["nodeName"] == e2e.node.name and got["spec"]["driver"] == dra.DRA_DRIVER
    assert {d["capacity"]["memory"]["value"] for d in got["spec"]["devices"]} == {"8Mi"}
    e2e.seen["slice"] = True


def test_dra_pods_get_a_share_each_and_a_third_waits_for_the_scheduler(dra_e2e: DraE2E) -> None:
    """Two pods, each a claim from the template: each prepared on its own share, each writes it
    (read back on the host from that share's file). A third: Pending, the scheduler's reason
    naming the claim; the first deleted (its claim unprepared), the third runs."""
    e2e = dra_e2e
    assert e2e.seen.get("slice"), "the slice was not published (see the first test)"
    pool_dir = e2e.root / e2e.pool
    tokens = {n: f"{n}-{uuid.uuid4().hex[:8]}" for n in ("engine-a", "engine-b", "engine-c")}
    for n in ("engine-a", "engine-b"):
        e2e.engine(n, tokens[n])
    shares_of = {}
    for n in ("engine-a", "engine-b"):
        log = e2e.wrote(n, tokens[n])
        shares_of[n] = int(log.split(" to share ", 1)[1].split()[0])
    assert sorted(shares_of.values()) == [0, 1], shares_of
    for n, share in shares_of.items():
        with open(pool_dir / "mnt" / f"p{share}-r0-s000", "rb") as fh:
            assert fh.read(len(tokens[n])) == tokens[n].encode(), n
    records = [p for p in published.load_all(pool_dir) if p.is_dra]
    assert sorted(p.share for p in records) == [0, 1] and {p.pod_namespace for p in records} == {
        e2e.consumer_ns
    }

    e2e.engine("engine-c", tokens["engine-c"])

    def refused() -> str | None:
        pod = e2e.pod("engine-c") or {}
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("message"):
                return str(cond["message"])
        return None

    reason = e2e.wait("the scheduler's refusal of the third pod", refused, 120)
    assert "claim" in reason, reason
    assert (e2e.pod("engine-c") or {}).get("status", {}).get("phase") == "Pending"

    e2e.cp.kubectl("delete", "pod", "engine-a", "-n", e2e.consumer_ns, "--timeout=90s")
    log = e2e.wrote("engine-c", tokens["engine-c"])
    assert f" to share {shares_of['engine-a']} " in log, log
