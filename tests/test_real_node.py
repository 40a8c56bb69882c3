"""The real node: kubelet + containerd + runc + CNI joined to the session's control plane.

Why: the agent runs as a DaemonSet pod that requests huge pages and mounts the host root with
Bidirectional propagation; these tests prove, on a real kubelet and runtime, the node-side
contracts that rests on: the Node advertises the suite's huge pages, a pod runs and its log is
read through the API server, a hugepages-2Mi pod is admitted, gets a hugetlbfs volume whose
pages it really uses (and what its cgroups charge for them), and a mount a privileged container
makes under a Bidirectional hostPath appears on the host. docs/real-node.md, "The test node".

The ``test_e2e_chart_*`` tests at the end run the whole product there as a user would: helm
install of the chart with the locally built image, a HugePages-2Mi and a MemoryTHP pool
provisioned by admitted agent pods, consumer pods attaching and pinning, agent pods replaced
without re-populating, and the pools' deletion giving every mount, file and huge page
back. docs/real-node.md, "The chart on the real node".
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
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
from fixtures.node import HUGE_1G, HUGE_2M, TAINT, TOLERATION, RealNode, nr_hugepages
from fixtures.wait import wait_for
from offloadpool.api.constants import POOL_NAME_LABEL
from offloadpool.api.quantity import parse_quantity, parse_quantity_exact
from offloadpool.region.files import manifest as manifest_mod
from offloadpool.region.memory import hugepages

pytestmark = pytest.mark.node

MiB = 1 << 20


@pytest.fixture
def namespace(real_node: RealNode) -> Iterator[str]:
    """A namespace of the test's own, deleted with its pods afterwards (the kubelet then
    removes their containers and volumes)."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    real_node.kubectl("create", "namespace", name)
    wait_for(
        f"ServiceAccount default in {name}",
        lambda: (
            real_node.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0
        ),
        60,
    )
    yield name
    real_node.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=1", "--timeout=90s", check=False)
    real_node.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pod(real_node: RealNode, name: str, script: str, **extra: Any) -> dict:
    """A one-container busybox pod on the real node that runs ``script`` with sh and ends."""
    container: dict[str, Any] = {
        "name": "main",
        "image": real_node.images["busybox"],
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
    }
    container.update(extra.pop("container", {}))
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
        "tolerations": [TOLERATION],
    }
    spec.update(extra)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def create(real_node: RealNode, namespace: str, manifest: dict) -> None:
    real_node.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def pod_json(real_node: RealNode, namespace: str, name: str) -> dict:
    return json.loads(real_node.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)


def wait_phase(
    real_node: RealNode, namespace: str, name: str, phases: set[str], timeout: float = 120
) -> dict:
    """Wait for the pod's phase; on timeout the message carries the pod and the node's logs."""
    deadline = time.monotonic() + timeout
    while True:
        obj = pod_json(real_node, namespace, name)
        if obj["status"].get("phase") in phases:
            return obj
        if time.monotonic() > deadline:
            events = real_node.kubectl("get", "events", "-n", namespace, check=False).stdout
            raise AssertionError(
                f"pod {name} not in {phases} after {timeout}s: "
                f"{json.dumps(obj['status'], indent=1)}\n{events}\n{real_node.logs(3000)}"
            )
        time.sleep(0.5)


def wait_log(real_node: RealNode, namespace: str, name: str, needle: str, timeout: float = 120) -> str:
    """The log of a running pod once ``needle`` is in it.

    A log is read while the container still writes: only what comes before ``needle`` is
    certain to be there, so wait for the last line the caller asserts on (a marker the
    script echoes after its other output), never an earlier one.
    """

    def found() -> str | None:
        out = real_node.kubectl("logs", name, "-n", namespace, check=False)
        return out.stdout if out.returncode == 0 and needle in out.stdout else None

    return wait_for(f"{needle!r} in the log of {name}", found, timeout)


def pod_cgroups(uid: str) -> dict[str, Path]:
    """The pod's cgroup directory in every hierarchy that has one (cgroupfs driver naming)."""
    found = {}
    for hierarchy in sorted(Path("/sys/fs/cgroup").iterdir()):
        for d in (hierarchy / "kubepods").glob(f"**/pod{uid}"):
            found[hierarchy.name] = d
    return found


def read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def test_node_is_ready_and_advertises_the_suites_huge_pages(real_node: RealNode) -> None:
    node = real_node.node_json()
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions.get("Ready") == "True", node["status"]["conditions"]
    capacity, allocatable = node["status"]["capacity"], node["status"]["allocatable"]
    pages_2m = real_node.hugepages_at_start[HUGE_2M]
    # The suite's reservation (hack/hugepages.py) was in place before the kubelet started.
    assert pages_2m >= 1, "no 2 MiB huge pages reserved before the kubelet started"
    # The kubelet read the pool when it started; a concurrent test may have resized it since.
    assert parse_quantity(capacity["hugepages-2Mi"]) in {
        pages_2m * HUGE_2M,
        nr_hugepages(HUGE_2M) * HUGE_2M,
    }, (capacity, real_node.hugepages_at_start)
    assert parse_quantity(allocatable["hugepages-2Mi"]) == parse_quantity(capacity["hugepages-2Mi"])
    assert parse_quantity(capacity["hugepages-1Gi"]) in {
        real_node.hugepages_at_start[HUGE_1G] * HUGE_1G,
        nr_hugepages(HUGE_1G) * HUGE_1G,
    }
    # Tainted, so the session's other tests' DaemonSets and pools leave it alone.
    assert TAINT in node["spec"].get("taints", []), node["spec"]
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    # The API server reaches the kubelet by the Hostname address (it resolves to loopback).
    assert addresses.get("Hostname") == real_node.name, addresses
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"


def test_busybox_pod_succeeds_and_its_log_is_read_through_the_api(
    real_node: RealNode, namespace: str
) -> None:
    token = uuid.uuid4().hex
    create(real_node, namespace, pod(real_node, "hello", f"echo hello {token}; cat /proc/1/cgroup"))
    obj = wait_phase(real_node, namespace, "hello", {"Succeeded", "Failed"})
    assert obj["status"]["phase"] == "Succeeded", obj["status"]
    # Scheduled by the real kube-scheduler onto the real node, through the pod network.
    assert obj["spec"]["nodeName"] == real_node.name
    assert obj["status"]["podIP"].startswith("10.244.77."), obj["status"]
    log = real_node.kubectl("logs", "hello", "-n", namespace).stdout
    assert f"hello {token}" in log
    assert "kubepods" in log, f"the container does not run in a kubepods cgroup:\n{log}"


def test_a_pod_reaches_the_api_server_at_the_kubernetes_service_with_its_token(
    real_node: RealNode, namespace: str
) -> None:
    """In-cluster clients (the operator, the agents) dial KUBERNETES_SERVICE_HOST and present
    their ServiceAccount token: both must work on this node without kube-proxy."""
    api = "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT"
    review = '{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}'
    script = (
        f"wget -q -O- --no-check-certificate {api}/version && echo && "
        "token=$(cat /var/run/secrets/kubernetes.io/serviceaccount/token) && "
        f'wget -q -O- --no-check-certificate --header "Authorization: Bearer $token" '
        f"--header 'Content-Type: application/json' --post-data '{review}' "
        f"{api}/apis/authentication.k8s.io/v1/selfsubjectreviews"
    )
    manifest = pod(real_node, "incluster", script, automountServiceAccountToken=True)
    create(real_node, namespace, manifest)
    obj = wait_phase(real_node, namespace, "incluster", {"Succeeded", "Failed"})
    log = real_node.kubectl("logs", "incluster", "-n", namespace).stdout
    assert obj["status"]["phase"] == "Succeeded", (log, real_node.service_errors())
    assert '"gitVersion": "v1.37.2"' in log, log
    assert f'"username": "system:serviceaccount:{namespace}:default"' in log.replace('":"', '": "'), log


def test_hugepages_pod_is_admitted_uses_its_hugetlbfs_volume_and_what_its_cgroups_charge(
    real_node: RealNode, namespace: str
) -> None:
    size = 4 * MiB
    script = (
        f"hugetouch /hp/data {size} && grep -w /hp /proc/mounts && echo mounts-listed && "
        "i=0; while [ ! -e /hp/done ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done; "
        "[ -e /hp/done ]"
    )
    resources = {"hugepages-2Mi": "4Mi", "memory": "64Mi", "cpu": "100m"}
    manifest = pod(
        real_node,
        "huge",
        script,
        container={
            "resources": {"requests": resources, "limits": resources},
            "volumeMounts": [{"name": "hp", "mountPath": "/hp"}],
        },
        volumes=[{"name": "hp", "emptyDir": {"medium": "HugePages-2Mi"}}],
    )
    create(real_node, namespace, manifest)
    log = wait_log(real_node, namespace, "huge", "mounts-listed")
    assert "written and verified" in log
    assert "hugetlbfs" in log and "pagesize=2M" in log, log
    obj = pod_json(real_node, namespace, "huge")
    assert obj["status"]["qosClass"] == "Guaranteed"
    uid = obj["metadata"]["uid"]

    # The same pages, seen from the host: the kubelet's hugetlbfs volume holds the pod's file.
    volume = real_node.workdir / "kubelet" / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / "hp"
    with open(volume / "data", "r+b") as fh, mmap.mmap(fh.fileno(), size) as mem:
        sample = bytes(mem[: 251 * 3])
    assert sample == bytes(i % 251 for i in range(251 * 3))

    cgroups = pod_cgroups(uid)
    assert "memory" in cgroups, f"no memory cgroup for pod {uid}: {cgroups}"
    charged: dict[str, Any] = {"cgroups": {k: str(v) for k, v in cgroups.items()}}
    memory = cgroups["memory"]
    # The memory limit is enforced (v1 memory controller): the pod cgroup carries it.
    charged["memory.limit_in_bytes"] = int(read(memory / "memory.limit_in_bytes") or -1)
    charged["memory.usage_in_bytes"] = int(read(memory / "memory.usage_in_bytes") or -1)
    assert charged["memory.limit_in_bytes"] == 64 * MiB
    # Huge pages are not memory-cgroup memory: the 4 MiB in use are not in the pod's usage
    # beyond what the shell and the runtime take (well under the limit).
    assert charged["memory.usage_in_bytes"] < 64 * MiB
    # Hugetlb: whatever hierarchy has a hugetlb controller for the pod must carry the request.
    limits = {}
    for hierarchy, d in cgroups.items():
        for limit_file, usage_file in (
            ("hugetlb.2MB.limit_in_bytes", "hugetlb.2MB.usage_in_bytes"),
            ("hugetlb.2MB.max", "hugetlb.2MB.current"),
        ):
            value = read(d / limit_file)
            if value is not None:
                limits[f"{hierarchy}/{limit_file}"] = value
                charged[f"{hierarchy}/{usage_file}"] = read(d / usage_file)
    charged["hugetlb limits"] = limits
    # cgroup v2 charges a resource to the nearest ancestor whose parent enables the controller:
    # if hugetlb is enabled anywhere above the pod in the unified hierarchy, the pod's pages
    # must be counted there (charged, with no per-pod limit).
    unified = cgroups.get("unified")
    if unified is not None:
        charged["unified/pod cgroup.controllers"] = read(unified / "cgroup.controllers")
        for d in [unified, *unified.parents]:
            current = read(d / "hugetlb.2MB.current")
            if current is not None:
                charged[f"{d}/hugetlb.2MB.current"] = current
                charged[f"{d}/hugetlb.2MB.max"] = read(d / "hugetlb.2MB.max")
                assert int(current) >= size, (
                    f"{d}/hugetlb.2MB.current is {current} with the pod's {size} in use"
                )
                break
            if d == Path("/sys/fs/cgroup/unified"):
                break
    for where, value in limits.items():
        assert value == str(size), f"{where} is {value}, the pod asked for {size}"
    print("real node hugepages pod cgroups:", json.dumps(charged, indent=1))

    (volume / "done").touch()
    obj = wait_phase(real_node, namespace, "huge", {"Succeeded", "Failed"})
    assert obj["status"]["phase"] == "Succeeded", obj["status"]


def test_bidirectional_host_path_mount_made_in_a_container_appears_on_the_host(
    real_node: RealNode, namespace: str
) -> None:
    sub = real_node.host_root / f"prop-{uuid.uuid4().hex[:6]}"
    target = sub / "m"
    script = (
        "mkdir -p /host/m && mount -t tmpfs -o size=1m offloadpool-prop /host/m && "
        "echo from-the-pod > /host/m/hello && "
        "i=0; while [ ! -e /host/release ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done"
    )
    manifest = pod(
        real_node,
        "prop",
        script,
        container={
            "securityContext": {"privileged": True},
            "volumeMounts": [{"name": "host", "mountPath": "/host", "mountPropagation": "Bidirectional"}],
        },
        volumes=[{"name": "host", "hostPath": {"path": str(sub), "type": "DirectoryOrCreate"}}],
    )
    try:
        create(real_node, namespace, manifest)
        wait_for(f"the pod's mount at {target} on the host", lambda: str(target) in host_mounts(), 120)
        assert (target / "hello").read_text() == "from-the-pod\n"
        (sub / "release").touch()
        obj = wait_phase(real_node, namespace, "prop", {"Succeeded", "Failed"})
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        # The container is gone; its mount stays on the host (what the agent's pool mounts rely on).
        assert str(target) in host_mounts()
    finally:
        while str(target) in host_mounts():
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                break
    assert str(target) not in host_mounts()


# ---- the chart end to end ----------------------------------------------------------------------
# One helm release for the tests below, which run in order and build on each other as a user's
# session would: two pools provisioned by their agent pods -> consumer pods attach, write and
# pin -> the agent pods are replaced and reuse the regions -> the pools are deleted and
# everything is given back. A later test fails (never skips) when an earlier one did.

RELEASE = "op"
POOL_BYTES = 64 * MiB
FSTYPE = {"HugePages-2Mi": "hugetlbfs", "MemoryTHP": "tmpfs"}
#: What the operator renders for a 64Mi pool with the chart's defaults (agent.cpuRequest 100m,
#: agent.memoryOverhead 256Mi): huge pages = the pool; tmpfs media's memory = pool + overhead.
AGENT_RESOURCES = {
    "HugePages-2Mi": {
        "requests": {"hugepages-2Mi": "64Mi", "memory": "256Mi", "cpu": "100m"},
        "limits": {"hugepages-2Mi": "64Mi", "memory": "256Mi"},
    },
    "MemoryTHP": {"requests": {"memory": "320Mi", "cpu": "100m"}, "limits": {"memory": "320Mi"}},
}
#: The consumer pod's program: what an engine does with the pinning helper, in a few lines.
CONSUMER = """
import sys
from offloadpool.pinning import attach
pool_dir, token = sys.argv[1], sys.argv[2].encode()
with attach(pool_dir, rank=0) as region:
    view = region.memoryview()
    view[: len(token)] = token
    view[region.size - len(token) :] = token
    view.release()
    stats = region.pin(backend="mlock")
    vmlck = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmLck:"))
    print(f"{region.manifest.medium}: wrote {token.decode()} and pinned "
          f"{stats.bytes_registered} bytes with {stats.backend}, VmLck {vmlck} kB")
"""


def _quantities(resources: dict[str, dict[str, str]]) -> dict[str, dict[str, Fraction]]:
    """Requests/limits as exact numbers ("100m" == "0.1"), however the API server spells them."""
    return {
        kind: {k: parse_quantity_exact(v) for k, v in values.items()} for kind, values in resources.items()
    }


def _pool_mounts(pool_dir: Path) -> dict[str, tuple[str, str, str]]:
    """Mounts at or below ``pool_dir`` on the host: point -> (mount id, fstype, super options)."""
    found = {}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            point, dash = fields[4], fields.index("-")
            if point == str(pool_dir) or point.startswith(f"{pool_dir}/"):
                found[point] = (fields[0], fields[dash + 1], fields[dash + 3])
    return found


def _region_bytes(pool_dir: Path, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of the pool's region 0, read on the host from its segment
    files through the manifest (by mmap, as an engine reads them; hugetlbfs has no write(2))."""
    region = manifest_mod.load(pool_dir).regions[0]
    for seg in region.segments:
        if seg.offset <= offset and offset + length <= seg.offset + seg.bytes:
            with open(pool_dir / seg.file, "r+b") as fh, mmap.mmap(fh.fileno(), seg.bytes) as mem:
                return bytes(mem[offset - seg.offset : offset - seg.offset + length])
    raise AssertionError(f"no segment of {pool_dir} holds bytes {offset}..{offset + length}")


def _hugepages_2m() -> tuple[int, int, int]:
    """(HugePages_Total, HugePages_Free, HugePages_Rsvd) of the 2 MiB pool."""
    c = hugepages.counters(HUGE_2M)
    return c.total, c.free, c.reserved


@dataclass
class ChartE2E(ReleaseOnNode):
    """The release and what the tests learned so far (``seen``), shared along the module."""

    node: RealNode
    root: Path
    ns: str
    consumers_ns: str
    image: str
    pools: dict[str, str]  # medium -> pool name
    hugepages_before: tuple[int, int, int]
    seen: dict[str, Any] = field(default_factory=dict)

    def pool_node(self, pool: str) -> dict | None:
        return self.get("offloadpoolnodes", f"{pool}.{self.node.name}")

    def agent_pods(self, pool: str) -> list[dict]:
        selector = f"app.kubernetes.io/name=offloadpool-agent,{POOL_NAME_LABEL}={pool}"
        found = self.get("pods", "-n", self.ns, "-l", selector)
        return [] if found is None else found["items"]

    def pool_dir(self, pool: str) -> Path:
        return self.root / pool

    def diagnostics(self) -> str:
        cp = self.cp
        agents = "app.kubernetes.io/component=agent"
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.consumers_ns, check=False).stdout,
                cp.kubectl("get", "offloadpools,offloadpoolnodes", "-o", "yaml", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", agents, "--tail=40", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "deploy/op-operator", "--tail=60", check=False).stdout,
                str(self.node.service_errors()),
            ]
        )

    def ready_agent(self, pool: str, not_uid: str | None = None) -> dict | None:
        """The pool's agent pod once it is Ready (a different one than ``not_uid``)."""
        for p in self.agent_pods(pool):
            conditions = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            if p["metadata"]["uid"] != not_uid and conditions.get("Ready") == "True":
                return p
        return None

    def pool_node_status(self, pool: str, **expected: str) -> dict | None:
        """The OffloadPoolNode's status once every field in ``expected`` has that value."""
        status = (self.pool_node(pool) or {}).get("status") or {}
        return status if all(status.get(k) == v for k, v in expected.items()) else None


@pytest.fixture(scope="module")
def chart_e2e(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[ChartE2E]:
    """helm install of the chart with the local image; afterwards the pools, the release, the
    namespaces and (by ``shared_agent_root``) every mount are gone, whatever happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    e2e = ChartE2E(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-e2e-{suffix}",
        consumers_ns=f"e2e-consumers-{suffix}",
        image=image,
        pools={"HugePages-2Mi": f"e2e-hp-{suffix}", "MemoryTHP": f"e2e-thp-{suffix}"},
        hugepages_before=_hugepages_2m(),
    )
    cp = real_node.control_plane
    try:
        cp.kubectl("create", "namespace", e2e.consumers_ns)
        # The webhook on (the chart's default): the API server reaches the operator pod's
        # Service through its endpoints (--enable-aggregator-routing; there is no kube-proxy).
        cp.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            e2e.ns,
            "--create-namespace",
            "--take-ownership",
            *node_values(image),
            timeout=120,
        )
        yield e2e
    finally:
        remove_release(cp, RELEASE, e2e.ns, e2e.pools.values(), real_node.name, [e2e.consumers_ns])


def test_e2e_chart_two_pools_get_admitted_agent_pods_that_provision_them_onto_the_host(
    chart_e2e: ChartE2E,
) -> None:
    """The operator pod runs from the image; a HugePages-2Mi and a MemoryTHP pool each get an
    agent pod admitted with the pool's huge pages / memory (as the API shows it, and as the
    kubelet's memory cgroup enforces it) that provisions inside its container: the
    OffloadPoolNode goes Ready and the pool's mount appears on the host."""
    e2e, cp, node = chart_e2e, chart_e2e.cp, chart_e2e.node

    def operator_ready() -> dict | None:
        pods = e2e.get("pods", "-n", e2e.ns, "-l", "app.kubernetes.io/name=offloadpool-operator")
        for p in (pods or {}).get("items", []):
            if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])):
                return p
        return None

    operator = e2e.wait("the operator pod Ready", operator_ready, 180)
    assert operator["spec"]["nodeName"] == node.name
    for medium, pool in e2e.pools.items():
        body = {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": pool},
            "spec": {"capacity": "64Mi", "medium": medium, "tolerations": [TOLERATION]},
        }
        cp.kubectl("apply", "-f", "-", input=json.dumps(body))

    for medium, pool in e2e.pools.items():
        agent = e2e.wait(f"the agent pod of {pool} Ready", lambda pool=pool: e2e.ready_agent(pool), 180)
        assert agent["spec"]["nodeName"] == node.name
        container = agent["spec"]["containers"][0]
        assert _quantities(container["resources"]) == _quantities(AGENT_RESOURCES[medium]), container[
            "resources"
        ]
        assert agent["status"]["containerStatuses"][0]["restartCount"] == 0, agent["status"]
        # The kubelet gave the pod the memory limit it asked for (v1 memory, enforced here).
        memory_cgroup = pod_cgroups(agent["metadata"]["uid"]).get("memory")
        assert memory_cgroup is not None, f"no memory cgroup for agent pod {agent['metadata']['uid']}"
        limit = parse_quantity(AGENT_RESOURCES[medium]["limits"]["memory"])
        assert int((memory_cgroup / "memory.limit_in_bytes").read_text()) == limit

        status = e2e.wait(
            f"OffloadPoolNode {pool}.{node.name} Ready",
            lambda pool=pool: e2e.pool_node_status(pool, phase="Ready"),
            60,
        )
        assert status["reason"] == "Populated", status
        assert status["bytesTotal"] == POOL_BYTES and status["bytesPopulated"] == POOL_BYTES, status
        pool_dir = e2e.pool_dir(pool)
        mounts = {point: m for point, m in _pool_mounts(pool_dir).items() if m[1] == FSTYPE[medium]}
        assert len(mounts) == 1, (_pool_mounts(pool_dir), e2e.diagnostics())
        ((point, (mount_id, _fstype, options)),) = mounts.items()
        manifest = manifest_mod.load(pool_dir)
        assert manifest.total_bytes == POOL_BYTES and manifest.medium == medium
        segment = pool_dir / manifest.regions[0].segments[0].file
        assert str(segment).startswith(f"{point}/"), (segment, point)
        if medium == "MemoryTHP":
            assert "huge=always" in options, options
        else:
            assert "pagesize=2M" in options, options
            # The mount's own pages: all 32 in use by the pool (no cross-talk from other pools).
            st = os.statvfs(point)
            assert (st.f_blocks - st.f_bfree) * st.f_frsize == POOL_BYTES, (st, options)
        e2e.seen[pool] = {
            "agent": agent["metadata"]["uid"],
            "mount": point,
            "mount_id": mount_id,
            "segment": segment,
            "inode": segment.stat().st_ino,
        }

    # The operator stayed up through both pools' rollouts.
    operator = e2e.get("pod", "-n", e2e.ns, operator["metadata"]["name"])
    assert operator is not None and operator["status"]["containerStatuses"][0]["restartCount"] == 0, (
        cp.kubectl("logs", "-n", e2e.ns, "deploy/op-operator", "--previous", "--tail=30", check=False).stdout
    )


def _consumer(e2e: ChartE2E, pool: str, token: str, **labels: str) -> dict:
    """The consumer pod as a user writes it: no volume, no mount, no environment, no sidecar.
    Its program gets the pool's directory from ``$(OFFLOADPOOL_POOL_DIR)``, which only the
    webhook's environment makes a path (the kubelet leaves an unknown variable as it is)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"consumer-{pool}", "labels": labels},
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
                    "command": ["python", "-c", CONSUMER, "$(OFFLOADPOOL_POOL_DIR)", token],
                    "resources": {"limits": {"memory": "64Mi", "cpu": "100m"}},
                    # mlock past RLIMIT_MEMLOCK (8 MiB here) needs CAP_IPC_LOCK, as in any pod
                    "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                }
            ],
        },
    }


def test_e2e_chart_the_guard_refuses_a_hand_written_pool_mount(chart_e2e: ChartE2E) -> None:
    """The API server calls the operator's pod (its Service, routed to the endpoint): an
    unlabelled pod mounting a pool's directory by hand is refused by the guard, in its words."""
    e2e = chart_e2e
    pool = next(iter(e2e.pools.values()))
    manifest = _consumer(e2e, pool, "never-runs")
    manifest["metadata"]["name"] = "hand-written"
    spec = manifest["spec"]
    spec["volumes"] = [{"name": "pool", "hostPath": {"path": str(e2e.pool_dir(pool)), "type": "Directory"}}]
    spec["containers"][0]["volumeMounts"] = [{"name": "pool", "mountPath": f"/offloadpool/{pool}"}]

    def answered() -> subprocess.CompletedProcess[str] | None:
        out = e2e.cp.kubectl(
            "apply", "-n", e2e.consumers_ns, "-f", "-", input=json.dumps(manifest), check=False
        )
        # until the operator has served once and written its caBundle, the call itself fails
        return None if "failed calling webhook" in out.stderr else out

    out = e2e.wait("the webhook answering", answered, 120)
    assert out.returncode != 0, f"a hand-written mount of the pool was admitted: {out.stdout}"
    # It answered through the Service, over TLS the API server verified with the CA the
    # operator made in its pod and wrote into the configurations itself.
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        configuration = e2e.get(kind, "offloadpool")
        assert configuration is not None
        for hook in configuration["webhooks"]:
            client_config = hook["clientConfig"]
            assert client_config["service"]["name"] == f"{RELEASE}-webhook", client_config
            assert client_config["service"]["namespace"] == e2e.ns, client_config
            assert "BEGIN CERTIFICATE" in base64.b64decode(client_config["caBundle"]).decode(), hook["name"]
    assert 'admission webhook "pods.guard.offloadpool.io" denied the request' in out.stderr, out.stderr
    assert f"hostPath '{e2e.pool_dir(pool)}' reaches /var/lib/offloadpool" in out.stderr, out.stderr
    assert e2e.get("pod", "hand-written", "-n", e2e.consumers_ns) is None


def test_e2e_chart_labelled_consumer_pods_are_mutated_then_attach_write_and_pin_each_pool(
    chart_e2e: ChartE2E,
) -> None:
    """A consumer pod of the same image, written with nothing but the label
    ``offloadpool.io/pool`` (no huge pages requested, memory 64Mi: the pool's pages are not
    charged to it): the API server has the operator's webhook add the pool's volume, mount,
    environment and lease sidecar (the pod as stored has them), the kubelet runs it, and it
    attaches with the pinning helper, writes a pattern, pins with mlock and exits 0; the host
    reads the pattern back from the pool's files."""
    e2e, node = chart_e2e, chart_e2e.node
    assert set(e2e.seen) == set(e2e.pools.values()), "the pools were not provisioned (test above)"
    tokens = {}
    for medium, pool in e2e.pools.items():
        tokens[pool] = f"consumer-{medium}-{uuid.uuid4().hex[:8]}"
        manifest = _consumer(e2e, pool, tokens[pool], **{POOL_NAME_LABEL: pool})
        e2e.cp.kubectl("apply", "-n", e2e.consumers_ns, "-f", "-", input=json.dumps(manifest))

        # What the API server stored is what the webhook made of it.
        stored = e2e.get("pod", f"consumer-{pool}", "-n", e2e.consumers_ns)
        assert stored is not None
        spec = stored["spec"]
        volume = {v["name"]: v for v in spec.get("volumes", [])}.get(f"offloadpool-{pool}")
        expected = {"path": str(e2e.pool_dir(pool)), "type": "Directory"}
        assert volume is not None and volume["hostPath"] == expected, spec.get("volumes")
        engine = spec["containers"][0]
        mount = {m["name"]: m for m in engine.get("volumeMounts", [])}.get(f"offloadpool-{pool}")
        assert mount is not None and mount["mountPath"] == f"/offloadpool/{pool}", engine.get("volumeMounts")
        assert mount["mountPropagation"] == "HostToContainer" and mount["readOnly"] is True, mount
        env = {e["name"]: e.get("value") for e in engine.get("env", [])}
        assert env.get("OFFLOADPOOL_POOL_DIR") == f"/offloadpool/{pool}", env
        assert env.get("OFFLOADPOOL_MEDIUM") == medium and env.get("OFFLOADPOOL_POOL") == pool, env
        sidecar = spec["initContainers"][0]
        assert sidecar["name"] == "offloadpool-lease" and sidecar["restartPolicy"] == "Always", sidecar
        assert sidecar["image"] == e2e.image, sidecar
        assert sidecar["resources"]["limits"].get(f"offloadpool.io/{pool}") == "1", sidecar["resources"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"key": f"pool.offloadpool.io/{pool}", "operator": "In", "values": ["ready"]} in terms[
            "nodeSelectorTerms"
        ][0]["matchExpressions"], terms

    for medium, pool in e2e.pools.items():
        name = f"consumer-{pool}"

        def ended(name: str = name) -> dict | None:
            obj = e2e.get("pod", name, "-n", e2e.consumers_ns)
            return obj if obj and obj["status"].get("phase") in ("Succeeded", "Failed") else None

        obj = e2e.wait(f"consumer pod {name} ended", ended, 120)
        log = e2e.cp.kubectl("logs", name, "-n", e2e.consumers_ns, "-c", "engine", check=False)
        assert obj["status"]["phase"] == "Succeeded", (obj["status"], log.stdout, log.stderr)
        print(f"consumer pod {name}: {log.stdout.strip()}")
        assert obj["spec"]["nodeName"] == node.name
        resources = _quantities(obj["spec"]["containers"][0]["resources"])
        assert not [r for kind in resources.values() for r in kind if r.startswith("hugepages-")], resources
        statuses = {c["name"]: c for c in obj["status"]["containerStatuses"]}
        assert statuses["engine"]["state"]["terminated"]["exitCode"] == 0
        assert f"{medium}: wrote {tokens[pool]} and pinned {POOL_BYTES} bytes with mlock" in log.stdout, (
            log.stdout
        )
        if medium == "MemoryTHP":  # hugetlb pages are never counted in VmLck; tmpfs pages are
            vmlck = int(log.stdout.rsplit("VmLck ", 1)[1].split()[0]) * 1024
            assert vmlck >= POOL_BYTES, log.stdout

        token = tokens[pool].encode()
        pool_dir = e2e.pool_dir(pool)
        assert _region_bytes(pool_dir, 0, len(token)) == token
        assert _region_bytes(pool_dir, POOL_BYTES - len(token), len(token)) == token
        e2e.seen[pool]["token"] = token


def test_e2e_chart_a_deleted_agent_pod_is_replaced_and_reuses_the_region_with_its_data(
    chart_e2e: ChartE2E,
) -> None:
    """Deleting each agent pod: the DaemonSet controller makes a replacement; the mount, the
    segment file (same inode) and the consumer's bytes stay; the replacement validates the
    region and reports it Reused, nothing re-populated."""
    e2e, cp = chart_e2e, chart_e2e.cp
    seen = e2e.seen
    assert all("token" in seen.get(pool, {}) for pool in e2e.pools.values()), "no consumer data (test above)"
    old = {
        pool: next(p for p in e2e.agent_pods(pool) if p["metadata"]["uid"] == seen[pool]["agent"])
        for pool in e2e.pools.values()
    }
    names = [p["metadata"]["name"] for p in old.values()]
    cp.kubectl("delete", "pods", "-n", e2e.ns, *names, "--timeout=90s", timeout=120)

    for medium, pool in e2e.pools.items():
        new = e2e.wait(
            f"a replacement agent pod of {pool} Ready",
            lambda pool=pool: e2e.ready_agent(pool, not_uid=seen[pool]["agent"]),
            120,
        )
        owner = new["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("DaemonSet", f"offloadpool-agent-{pool}"), owner
        assert new["spec"]["nodeName"] == e2e.node.name
        status = e2e.wait(
            f"OffloadPoolNode {pool}.{e2e.node.name} Reused",
            lambda pool=pool: e2e.pool_node_status(pool, phase="Ready", reason="Reused"),
            60,
        )
        assert "validated the existing region" in status["message"], status
        assert "nothing re-populated" in status["message"], status
        print(f"replacement agent of {pool}: {status['reason']}: {status['message']}")
        assert status["bytesTotal"] == POOL_BYTES, status

        # The memory stayed: the same mount (its id), the same file (its inode), the same bytes.
        point = seen[pool]["mount"]
        mount = _pool_mounts(e2e.pool_dir(pool)).get(point)
        assert mount is not None and mount[0] == seen[pool]["mount_id"], (mount, seen[pool])
        assert seen[pool]["segment"].stat().st_ino == seen[pool]["inode"]
        token = seen[pool]["token"]
        pool_dir = e2e.pool_dir(pool)
        assert _region_bytes(pool_dir, 0, len(token)) == token
        assert _region_bytes(pool_dir, POOL_BYTES - len(token), len(token)) == token
        if medium == "HugePages-2Mi":
            st = os.statvfs(point)
            assert (st.f_blocks - st.f_bfree) * st.f_frsize == POOL_BYTES, st


def test_e2e_chart_deleting_the_pools_gives_everything_back(chart_e2e: ChartE2E) -> None:
    """kubectl delete of both pools: no mount or file of either is left on the host, the 2 MiB
    huge pages are back (Total/Free/Rsvd as before the release was installed), and the
    OffloadPoolNodes and agent DaemonSets are gone."""
    e2e, cp, node = chart_e2e, chart_e2e.cp, chart_e2e.node
    pools = list(e2e.pools.values())
    assert all(e2e.pool_dir(pool).is_dir() for pool in pools), "the pools are not there (tests above)"
    cp.kubectl("delete", "offloadpools", *pools, "--timeout=120s", timeout=150)

    for pool in pools:
        e2e.wait(
            f"no mount of {pool} on the host", lambda pool=pool: not _pool_mounts(e2e.pool_dir(pool)), 60
        )
        assert not e2e.pool_dir(pool).exists(), sorted(e2e.pool_dir(pool).rglob("*"))
        e2e.wait(
            f"OffloadPoolNode {pool}.{node.name} gone", lambda pool=pool: e2e.pool_node(pool) is None, 60
        )
        e2e.wait(
            f"DaemonSet offloadpool-agent-{pool} gone",
            lambda pool=pool: e2e.get("daemonset", "-n", e2e.ns, f"offloadpool-agent-{pool}") is None,
            60,
        )
    # The huge pages went back to the kernel's pool (the reservation is as before the chart).
    e2e.wait(
        f"2 MiB huge pages (total, free, reserved) back to {e2e.hugepages_before}",
        lambda: _hugepages_2m() == e2e.hugepages_before,
        30,
    )
