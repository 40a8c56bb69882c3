"""The real node: kubelet + containerd + runc + CNI joined to the session's control plane.

Why: the agent runs as a DaemonSet pod that requests huge pages and mounts the host root with
Bidirectional propagation; these tests prove, on a real kubelet and runtime, the node-side
contracts that rests on: the Node advertises the suite's huge pages, a pod runs and its log is
read through the API server, a hugepages-2Mi pod is admitted, gets a hugetlbfs volume whose
pages it really uses (and what its cgroups charge for them), and a mount a privileged container
makes under a Bidirectional hostPath appears on the host. docs/real-node.md, "The test node".
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.node import HUGE_1G, HUGE_2M, TAINT, TOLERATION, RealNode, nr_hugepages
from fixtures.wait import wait_for
from offloadpool.api.quantity import parse_quantity

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
    real_node: RealNode, namespace: str, record_property: Callable[[str, object], None]
) -> None:
    size = 4 * MiB
    script = (
        f"hugetouch /hp/data {size} && grep -w /hp /proc/mounts && "
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
    log = wait_log(real_node, namespace, "huge", "written and verified")
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
    record_property("charged", json.dumps(charged))
    print("real node hugepages pod cgroups:", json.dumps(charged, indent=1))

    (volume / "done").touch()
    obj = wait_phase(real_node, namespace, "huge", {"Succeeded", "Failed"})
    assert obj["status"]["phase"] == "Succeeded", obj["status"]


def _host_mounts() -> set[str]:
    with open("/proc/self/mountinfo") as fh:
        return {line.split()[4] for line in fh}


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
        wait_for(f"the pod's mount at {target} on the host", lambda: str(target) in _host_mounts(), 120)
        assert (target / "hello").read_text() == "from-the-pod\n"
        (sub / "release").touch()
        obj = wait_phase(real_node, namespace, "prop", {"Succeeded", "Failed"})
        assert obj["status"]["phase"] == "Succeeded", obj["status"]
        # The container is gone; its mount stays on the host (what the agent's pool mounts rely on).
        assert str(target) in _host_mounts()
    finally:
        while str(target) in _host_mounts():
            if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
                break
    assert str(target) not in _host_mounts()


AGENT_ROOT = Path("/var/lib/offloadpool")  # the chart's host root (offloadpool.api's HOST_ROOT)
CHART = Path(__file__).resolve().parents[1] / "charts" / "offloadpool"


def _mounts_under(root: Path) -> list[tuple[str, str]]:
    """(mount point, fstype) of every mount strictly below ``root`` on the host."""
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            point, fstype = fields[4], fields[fields.index("-") + 1]
            if point.startswith(f"{root}/"):
                found.append((point, fstype))
    return found


@pytest.fixture
def shared_agent_root() -> Iterator[Path]:
    """/var/lib/offloadpool as a shared mount (the agent's Bidirectional hostPath needs one; `/`
    is private here); afterwards every mount below it and the bind itself are gone."""
    created = not AGENT_ROOT.exists()
    AGENT_ROOT.mkdir(parents=True, exist_ok=True)
    assert AGENT_ROOT.as_posix() not in _host_mounts(), f"{AGENT_ROOT} is a mount point already"
    subprocess.run(["mount", "--bind", str(AGENT_ROOT), str(AGENT_ROOT)], check=True)
    subprocess.run(["mount", "--make-shared", str(AGENT_ROOT)], check=True)
    try:
        yield AGENT_ROOT
    finally:
        for point, _ in sorted(_mounts_under(AGENT_ROOT), key=lambda m: m[0].count("/"), reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)
        subprocess.run(["umount", "-l", str(AGENT_ROOT)], capture_output=True)
        if created:
            subprocess.run(["rm", "-rf", "--one-file-system", str(AGENT_ROOT)], capture_output=True)


def import_offloadpool_image(real_node: RealNode) -> str:
    """hack/image.py's image (built or cached), imported into the node's containerd; its name."""
    tool = CHART.parents[1] / "hack" / "image.py"
    out = {}
    for command in ("build", "archive"):
        run = subprocess.run(
            [sys.executable, str(tool), command], capture_output=True, text=True, timeout=1500
        )
        assert run.returncode == 0, f"hack/image.py {command} failed:\n{run.stderr[-4000:]}"
        out[command] = Path(run.stdout.strip().splitlines()[-1])
    index = json.loads((out["build"] / "index.json").read_text())
    ref = index["manifests"][0]["annotations"]["io.containerd.image.name"]
    real_node.ctr("images", "import", "--platform", "linux/amd64", str(out["archive"]))
    assert ref in real_node.ctr("images", "ls", "-q").stdout.split()
    return ref


def test_e2e_chart_operator_and_agent_provision_a_memory_thp_pool_on_the_real_node(
    real_node: RealNode, crds_installed: Any, shared_agent_root: Path
) -> None:
    """helm install with the local image: the operator pod runs on the node; a MemoryTHP pool
    tolerating the node's taint gets an agent pod that provisions inside its container, and the
    pool's tmpfs mount appears on the host; deleting the pool releases it."""
    image = import_offloadpool_image(real_node)
    repository, tag = image.rsplit(":", 1)
    release, ns = "op", f"offloadpool-e2e-{uuid.uuid4().hex[:6]}"
    pool = f"e2e-{uuid.uuid4().hex[:6]}"
    toleration = json.dumps([TOLERATION])
    cp = real_node.control_plane
    try:
        cp.helm(
            "install",
            release,
            str(CHART),
            "--namespace",
            ns,
            "--create-namespace",
            "--take-ownership",
            "--set",
            f"image.repository={repository}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "webhook.enabled=false",
            "--set-json",
            f"operator.tolerations={toleration}",
            timeout=120,
        )

        def operator_ready() -> dict | None:
            pods = json.loads(
                cp.kubectl(
                    "get", "pods", "-n", ns, "-l", "app.kubernetes.io/name=offloadpool-operator", "-o", "json"
                ).stdout
            )["items"]
            ready = [
                p
                for p in pods
                if any(
                    c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", [])
                )
            ]
            return ready[0] if ready else None

        try:
            operator = wait_for("the operator pod Ready", operator_ready, 180)
        except AssertionError:
            raise AssertionError(
                cp.kubectl("get", "pods,events", "-n", ns, "-o", "wide").stdout
                + cp.kubectl("logs", "-n", ns, "deploy/op-operator", "--tail=50", check=False).stdout
                + str(real_node.service_errors())
            ) from None
        assert operator["spec"]["nodeName"] == real_node.name
        # Ready comes with the container's start (no readiness probe): it must also stay up.
        time.sleep(10)
        status = json.loads(
            cp.kubectl("get", "pod", "-n", ns, operator["metadata"]["name"], "-o", "json").stdout
        )
        restarts = status["status"]["containerStatuses"][0]["restartCount"]
        assert restarts == 0, (
            "the operator container restarted:\n"
            + cp.kubectl(
                "logs", "-n", ns, operator["metadata"]["name"], "--previous", "--tail=30", check=False
            ).stdout
        )

        body = {
            "apiVersion": "offloadpool.io/v1alpha1",
            "kind": "OffloadPool",
            "metadata": {"name": pool},
            "spec": {"capacity": "64Mi", "medium": "MemoryTHP", "tolerations": [TOLERATION]},
        }
        cp.kubectl("apply", "-f", "-", input=json.dumps(body))

        def provisioned() -> list[tuple[str, str]] | None:
            mounts = [m for m in _mounts_under(shared_agent_root) if m[1] == "tmpfs" and pool in m[0]]
            return mounts or None

        try:
            mounts = wait_for(
                f"pool {pool}'s tmpfs mount under {shared_agent_root} on the host", provisioned, 180
            )
        except AssertionError:
            raise AssertionError(
                cp.kubectl("get", "pods,events", "-n", ns, "-o", "wide").stdout
                + cp.kubectl("get", "offloadpools,offloadpoolnodes", "-o", "yaml").stdout
                + cp.kubectl(
                    "logs", "-n", ns, "-l", "app.kubernetes.io/component=agent", "--tail=50", check=False
                ).stdout
                + cp.kubectl(
                    "logs", "-n", ns, "deploy/op-operator", "--previous", "--tail=60", check=False
                ).stdout
                + cp.kubectl("logs", "-n", ns, "deploy/op-operator", "--tail=80", check=False).stdout
                + cp.kubectl("get", "daemonsets", "-n", ns, "-o", "wide", check=False).stdout
                + str(real_node.service_errors())
            ) from None
        agents = json.loads(
            cp.kubectl(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=agent", "-o", "json"
            ).stdout
        )["items"]
        assert [a["spec"]["nodeName"] for a in agents] == [real_node.name]
        wait_for(
            f"OffloadPoolNode {pool}.{real_node.name} Ready",
            lambda: (
                json.loads(
                    cp.kubectl(
                        "get", "offloadpoolnodes", f"{pool}.{real_node.name}", "-o", "json", check=False
                    ).stdout
                    or "{}"
                )
                .get("status", {})
                .get("phase")
                == "Ready"
            ),
            120,
        )
        point = mounts[0][0]
        with open("/proc/self/mountinfo") as fh:
            options = next(line for line in fh if line.split()[4] == point)
        assert "huge=always" in options, options

        cp.kubectl("delete", "offloadpool", pool, "--timeout=120s", timeout=150)
        wait_for(f"pool {pool}'s mount released", lambda: provisioned() is None, 60)
    finally:
        cp.kubectl("delete", "offloadpool", pool, "--ignore-not-found", "--wait=false", check=False)
        cp.helm("uninstall", release, "--namespace", ns, check=False, timeout=120)
        cp.kubectl("delete", "pods", "--all", "-n", ns, "--grace-period=1", "--timeout=90s", check=False)
        cp.kubectl("delete", "namespace", ns, "--wait=false", check=False)
