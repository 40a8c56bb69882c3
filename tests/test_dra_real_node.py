"""The DRA driver on the real node, installed by the chart (``dra.enabled=true``): the kubelet,
the kube-scheduler and containerd with CDI (docs/dra.md).

Why real: that the scheduler reads the agent's ResourceSlice and allocates a share, that the
kubelet's plugin manager registers the plugin and calls ``NodePrepareResources``, and that
containerd applies the CDI spec's mount to the container, only the real binaries can say. One
release for the module (tests run in order): the plugin registers and the slice shows each
share with its NUMA node -> in a namespace enforcing Pod Security ``restricted``, a pod asking
with a ResourceClaimTemplate gets a share and writes it, a second pod the other share, a third
stays Pending with the scheduler's own reason and runs once the first is deleted -> with a
GPU-like test driver (``fixtures.gpu_driver``), a claim of a share and a GPU on one NUMA node
gets the GPU on the share's node, one whose GPU is on another node stays Pending -> the pool's
deletion waits for the prepared claim, naming it, and completes once its pod is gone, leaving
no CDI spec and no mount -> the user guide's walk of a claim (the block marked
``dra-guide-test``) runs as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.chart_node import (
    CHART,
    ReleaseOnNode,
    host_mounts,
    import_offloadpool_image,
    node_values,
    remove_release,
)
from fixtures.gpu_driver import DRIVER as GPU_DRIVER
from fixtures.gpu_driver import GpuDriver, cdi_specs
from fixtures.node import TOLERATION, RealNode
from fixtures.wait import wait_for
from offloadpool.agent.slices import sole_numa_node
from offloadpool.api import dra
from offloadpool.region.holding import published
from test_user_guide import GUIDE, guide_blocks

pytestmark = pytest.mark.node

RELEASE = "dra"
ENFORCE = "pod-security.kubernetes.io/enforce"
PLUGIN_PODS = "app.kubernetes.io/name=offloadpool-dra"
TEMPLATE = "kv-share"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "dra"
EXAMPLE_TEMPLATE = EXAMPLES / "claim-template.yaml"
EXAMPLE_POD = EXAMPLES / "pod.yaml"
POOL_BYTES = 16 << 20
#: the GPU-like driver's GPUs in slice order (name -> NUMA node, set once the host's is known):
#: the one on a node the pool's memory is not on comes first, so an allocator that did not
#: match the NUMA nodes would take it
FAR_GPU, NEAR_GPU = "gpu-0", "gpu-1"
#: the user guide's walk of a claim: its pool and namespace (examples/tmpfs-shares.yaml,
#: examples/dra/), and the marker of its block
GUIDE_POOL, GUIDE_NS, GUIDE_POD = "tmpfs-shares", "inference", "dra-check"
GUIDE_MARKED = re.compile(
    r"<!-- dra-guide-test: (?P<name>[\w-]+) -->\n\s*```console\n(?P<body>.*?)\n\s*```", re.DOTALL
)
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

    def engine(self, name: str, token: str, template: str = TEMPLATE) -> None:
        """examples/dra/pod.yaml with the test's name, image, engine and node toleration: its
        claim from the template (``template`` in its place), its claim in the container's
        resources, its security."""
        body = yaml.safe_load(EXAMPLE_POD.read_text())
        assert body["spec"]["resourceClaims"] == [{"name": "kv", "resourceClaimTemplateName": TEMPLATE}]
        (container,) = body["spec"]["containers"]
        assert (
            container["resources"] == {"claims": [{"name": "kv"}]}
            and container["securityContext"] == SECURITY
        )
        body["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = template
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

    def claim_of(self, pod: str) -> dict:
        """The ResourceClaim made from the pod's template (its status names it)."""
        statuses = ((self.pod(pod) or {}).get("status") or {}).get("resourceClaimStatuses") or []
        (status,) = statuses
        claim = self.get("resourceclaim", status["resourceClaimName"], "-n", self.consumer_ns)
        assert claim is not None, status
        return claim

    def unschedulable(self, pod: str) -> str | None:
        """The scheduler's reason for not placing the pod, once it gave one."""
        for cond in ((self.pod(pod) or {}).get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("message"):
                return str(cond["message"])
        return None


def install_dra(real_node: RealNode, release: str, ns: str, consumer_ns: str, image: str) -> None:
    """A namespace enforcing ``restricted`` for the consumers, and the chart installed with
    its DRA plugin on the test node's kubelet and CDI directories."""
    cp = real_node.control_plane
    cp.kubectl("create", "namespace", consumer_ns)
    cp.kubectl("label", "namespace", consumer_ns, f"{ENFORCE}=restricted")
    cp.helm(
        "install",
        release,
        str(CHART),
        "--namespace",
        ns,
        "--create-namespace",
        "--take-ownership",
        *node_values(image),
        "--set",
        "dra.enabled=true",
        "--set",
        f"csi.kubeletDir={real_node.workdir / 'kubelet'}",
        "--set",
        f"dra.cdiDir={real_node.cdi_dir}",
        "--set-json",
        f"csi.tolerations={json.dumps([TOLERATION])}",
        timeout=120,
    )


@contextmanager
def dra_release(
    real_node: RealNode,
    shared_agent_root: Path,
    *,
    release: str = RELEASE,
    shares: int = 2,
    kind: type[DraE2E] = DraE2E,
) -> Iterator[DraE2E]:
    """helm install ``release`` with the DRA driver on the test node's kubelet directory and
    CDI directory, a namespace enforcing restricted with a ResourceClaimTemplate, a pool of
    ``shares`` shares of 8 MiB for it; afterwards all of it gone, whatever happened. Also
    tests/test_dra_faults_real_node.py's (``kind``: its subclass)."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    e2e = kind(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-dra-{suffix}",
        consumer_ns=f"dra-restricted-{suffix}",
        pool=f"dra-kv-{suffix}",
        image=image,
    )
    cp = real_node.control_plane
    try:
        install_dra(real_node, release, e2e.ns, e2e.consumer_ns, image)
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
                "capacity": f"{8 * shares}Mi",
                "medium": "Memory",
                "partitions": shares,
                "tolerations": [TOLERATION],
                "consumers": {"namespaces": [e2e.consumer_ns], "uid": 1000, "gid": 1000},
            },
        }
        cp.kubectl("apply", "-f", "-", input=json.dumps(pool))
        yield e2e
    finally:
        remove_release(
            cp, release, e2e.ns, [e2e.pool, GUIDE_POOL], real_node.name, [e2e.consumer_ns, GUIDE_NS]
        )
        cp.kubectl("delete", "deviceclass", dra.DEVICE_CLASS, "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def dra_e2e(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[DraE2E]:
    """The module's release (``dra_release``): a 2-share pool."""
    with dra_release(real_node, shared_agent_root) as e2e:
        yield e2e


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
    # the pool has no NUMA binding: its memory is on the host's NUMA node, as the host has one
    # (the machines the suite runs on; a host of several would publish none here)
    sole = sole_numa_node()
    assert sole is not None, "this module's NUMA checks need a host with one NUMA node"
    numa = [(d["attributes"].get(dra.ATTR_NUMA_NODE) or {}).get("int") for d in got["spec"]["devices"]]
    assert numa == [sole, sole], got["spec"]["devices"]
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

    reason = e2e.wait("the scheduler's refusal of the third pod", lambda: e2e.unschedulable("engine-c"), 120)
    assert "claim" in reason, reason
    assert (e2e.pod("engine-c") or {}).get("status", {}).get("phase") == "Pending"

    e2e.cp.kubectl("delete", "pod", "engine-a", "-n", e2e.consumer_ns, "--timeout=90s")
    log = e2e.wrote("engine-c", tokens["engine-c"])
    assert f" to share {shares_of['engine-a']} " in log, log


@pytest.fixture(scope="module")
def gpu_driver(dra_e2e: DraE2E) -> Iterator[GpuDriver]:
    """The GPU-like driver on the node: its plugin registered with the kubelet, its slice with
    FAR_GPU on a NUMA node the host has not and NEAR_GPU on the host's one."""
    sole = sole_numa_node()
    assert sole is not None, "the NUMA tests need a host with one NUMA node"
    node = dra_e2e.node
    driver = GpuDriver(dra_e2e.cp.kubectl, node.name, node.kubelet_dir, {FAR_GPU: sole + 1, NEAR_GPU: sole})
    try:
        driver.start()
        dra_e2e.wait("the GPU driver registered with the kubelet", driver.registered, 60)
        yield driver
    finally:
        driver.stop()


def _gpu_template(e2e: DraE2E, name: str, gpu_numa: int | None) -> None:
    """A ResourceClaimTemplate of a share of the module's pool and a test GPU, both on one NUMA
    node (``matchAttribute``); ``gpu_numa``: the GPU also asked to be on that node."""
    gpu: dict[str, Any] = {"deviceClassName": GPU_DRIVER}
    if gpu_numa is not None:
        gpu["selectors"] = [
            {"cel": {"expression": f'device.attributes["resource.kubernetes.io"].numaNode == {gpu_numa}'}}
        ]
    pool = f'device.attributes["{dra.DRA_DRIVER}"].pool == "{e2e.pool}"'
    body = {
        "apiVersion": dra.RESOURCE_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": e2e.consumer_ns},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "kv",
                            "exactly": {
                                "deviceClassName": dra.DEVICE_CLASS,
                                "selectors": [{"cel": {"expression": pool}}],
                            },
                        },
                        {"name": "gpu", "exactly": gpu},
                    ],
                    "constraints": [{"requests": ["kv", "gpu"], "matchAttribute": dra.ATTR_NUMA_NODE}],
                }
            }
        },
    }
    e2e.cp.kubectl("apply", "-f", "-", input=json.dumps(body))


def test_dra_a_claim_gets_the_share_on_its_gpus_numa_node_or_waits(
    dra_e2e: DraE2E, gpu_driver: GpuDriver
) -> None:
    """A claim of a share and a GPU with ``matchAttribute: resource.kubernetes.io/numaNode``:
    the scheduler passes over the GPU listed first (on another NUMA node) for the one on the
    share's node; the kubelet prepares both drivers' parts and the pod writes its share. A claim
    whose GPU must be on the other node stays Pending with the scheduler's reason, while a share
    and that GPU are both free."""
    e2e, cp = dra_e2e, dra_e2e.cp
    assert e2e.seen.get("slice"), "the slice was not published (see the first test)"
    sole = sole_numa_node()
    assert sole is not None
    # the previous test's pods hold both shares
    cp.kubectl(
        "delete",
        "pod",
        "engine-b",
        "engine-c",
        "-n",
        e2e.consumer_ns,
        "--ignore-not-found",
        "--grace-period=1",
        "--timeout=90s",
    )
    _gpu_template(e2e, "kv-near-gpu", None)
    _gpu_template(e2e, "kv-far-gpu", sole + 1)
    token = f"near-{uuid.uuid4().hex[:8]}"
    e2e.engine("engine-near", token, "kv-near-gpu")
    log = e2e.wrote("engine-near", token)
    share = int(log.split(" to share ", 1)[1].split()[0])
    claim = e2e.claim_of("engine-near")
    results = claim["status"]["allocation"]["devices"]["results"]
    got = sorted((r["request"], r["driver"], r["pool"], r["device"]) for r in results)
    assert got == [
        ("gpu", GPU_DRIVER, e2e.node.name, NEAR_GPU),
        ("kv", dra.DRA_DRIVER, dra.slice_name(e2e.pool, e2e.node.name), dra.share_device(share)),
    ], got
    uid = claim["metadata"]["uid"]
    assert uid in gpu_driver.plugin.prepared, "the kubelet did not ask the GPU driver to prepare"
    e2e.seen["near"] = {"claim": claim["metadata"]["name"], "uid": uid, "share": share}

    e2e.engine("engine-far", "unused", "kv-far-gpu")
    reason = e2e.wait(
        "the scheduler's refusal of the far claim", lambda: e2e.unschedulable("engine-far"), 120
    )
    assert "cannot allocate all claims" in reason, reason
    assert (e2e.pod("engine-far") or {}).get("status", {}).get("phase") == "Pending"
    free = e2e.get("resourceslice", dra.slice_name(e2e.pool, e2e.node.name)) or {}
    assert dra.share_device(1 - share) in [d["name"] for d in free["spec"]["devices"]], free
    cp.kubectl("delete", "pod", "engine-far", "-n", e2e.consumer_ns, "--grace-period=1", "--timeout=60s")


def test_dra_deleting_the_pool_waits_for_the_prepared_claim_and_names_it(dra_e2e: DraE2E) -> None:
    """The pool deleted while the near claim is prepared: the agent's release and the pool's
    deletion wait, each naming the claim by namespace, name and uid; the pod deleted (the claim
    unprepared), the deletion completes and leaves no CDI spec, no mount and no claim
    directory."""
    e2e, cp = dra_e2e, dra_e2e.cp
    near = e2e.seen.get("near")
    assert near, "no claim was prepared next to its GPU (see the test before)"
    named = f"DRA claim {e2e.consumer_ns}/{near['claim']} (uid {near['uid']}) (share {near['share']})"
    pool_dir = e2e.root / e2e.pool
    claim_dir = e2e.node.kubelet_dir / "plugins" / dra.DRA_DRIVER / "claims" / near["uid"]
    spec = f"{dra.DRA_DRIVER}-{near['uid']}.json"
    assert spec in cdi_specs(e2e.node.cdi_dir) and claim_dir.is_dir()

    cp.kubectl("delete", "offloadpool", e2e.pool, "--wait=false")
    node_object = dra.slice_name(e2e.pool, e2e.node.name)

    def release_waits() -> dict | None:
        status = (e2e.get("offloadpoolnodes", node_object) or {}).get("status") or {}
        return status if status.get("phase") == "Draining" and status.get("reason") == "LeaseHeld" else None

    status = e2e.wait("the agent's release waiting for the claim", release_waits, 120)
    assert named in status["message"], status

    def deletion_waits() -> dict | None:
        conditions = ((e2e.get("offloadpool", e2e.pool) or {}).get("status") or {}).get("conditions") or []
        waiting = [c for c in conditions if c.get("reason") == "WaitingForRelease"]
        return waiting[0] if waiting and named in waiting[0]["message"] else None

    said = e2e.wait("the pool's deletion waiting, naming the claim", deletion_waits, 120)
    e2e.seen["deletion_message"] = said["message"]
    assert (pool_dir / "manifest.json").exists() and [p for p in published.load_all(pool_dir) if p.is_dra]
    assert spec in cdi_specs(e2e.node.cdi_dir), "the claim's CDI spec went while its pod runs"

    cp.kubectl("delete", "pod", "engine-near", "-n", e2e.consumer_ns, "--grace-period=1", "--timeout=90s")
    e2e.wait("the pool deleted", lambda: e2e.get("offloadpool", e2e.pool) is None, 180)
    assert spec not in cdi_specs(e2e.node.cdi_dir)
    assert not claim_dir.exists(), list(claim_dir.iterdir())
    assert not [m for m in host_mounts() if near["uid"] in m], "a mount of the claim is left"
    assert not pool_dir.exists(), list(pool_dir.iterdir())
    assert not (e2e.root / ".state" / e2e.pool).exists()


def test_dra_the_guides_walk_of_a_claim_runs_as_written(dra_e2e: DraE2E) -> None:
    """docs/user-guide.md's block marked ``dra-guide-test: claim``, its commands as written on
    this release (DRA on): the pool's file and the pod's with the node's toleration (and a
    nodeSelector), the pod's image the node's local busybox; nothing else substituted. The
    slice it prints shows both shares with their bytes and NUMA node, the claim its share
    reserved for the pod, the pod its share and the pool's files; after the pod's deletion the
    pool's deletion completes (its command's own timeout)."""
    e2e = dra_e2e
    (walk,) = guide_blocks(GUIDE.read_text(), GUIDE_MARKED).values()
    sole = sole_numa_node()
    with tempfile.TemporaryDirectory(prefix="dra-guide-") as tmp:
        pool = yaml.safe_load((EXAMPLES.parent / f"{GUIDE_POOL}.yaml").read_text())
        pool["spec"]["tolerations"] = [TOLERATION]
        pool["spec"]["nodeSelector"] = {"kubernetes.io/hostname": e2e.node.name}
        (Path(tmp) / f"{GUIDE_POOL}.yaml").write_text(yaml.safe_dump(pool))
        pod = yaml.safe_load(EXAMPLE_POD.read_text())
        pod["spec"]["tolerations"] = [TOLERATION]
        for container in pod["spec"]["containers"]:
            container["image"], container["imagePullPolicy"] = e2e.node.images["busybox"], "Never"
        (Path(tmp) / "pod.yaml").write_text(yaml.safe_dump(pod))
        substitutions = {
            f"-f examples/{GUIDE_POOL}.yaml": f"-f {tmp}/{GUIDE_POOL}.yaml",
            "-f examples/dra/pod.yaml": f"-f {tmp}/pod.yaml",
        }
        used = dict.fromkeys(substitutions, 0)
        printed: dict[str, str] = {}
        for command in walk:
            line = command.line
            for old, new in substitutions.items():
                used[old] += line.count(old)
                line = line.replace(old, new)
            out = subprocess.run(
                ["bash", "-c", line],
                cwd=CHART.parents[1],
                env=e2e.cp.env,
                capture_output=True,
                text=True,
                timeout=360,
            )
            print(f"$ {line}\n{out.stdout}{out.stderr}")
            if out.returncode != 0:
                raise AssertionError(f"`{line}` exited {out.returncode}:\n{out.stderr}\n{e2e.diagnostics()}")
            printed[command.line] = out.stdout
    assert all(used.values()), f"substitutions that found nothing in the walk: {used}"
    node_slice = dra.slice_name(GUIDE_POOL, e2e.node.name)
    slices = next(out for line, out in printed.items() if "get resourceslices" in line).split()
    assert slices[4:] == [node_slice, "share-0,share-1", "256Mi,256Mi", f"{sole},{sole}"], slices
    claims = next(out for line, out in printed.items() if "get resourceclaims" in line).split()
    assert claims[:4] == ["CLAIM", "DEVICE", "FROM", "FOR"] and len(claims) == 8, claims
    share = claims[5]
    assert claims[4].startswith(f"{GUIDE_POD}-kv-") and claims[6:] == [node_slice, GUIDE_POD], claims
    assert share in ("share-0", "share-1"), claims
    log = next(out for line, out in printed.items() if " logs " in line)
    assert f"share={dra.share_of_device(share)}" in log.splitlines(), log
    assert f'"pool": "{GUIDE_POOL}"' in log and {"manifest.json", "lease", "mnt"} <= set(log.split()), log
    wait_for("the guide's namespace gone", lambda: e2e.get("namespace", GUIDE_NS) is None, 60)
