"""The chart's image on the real node: the agent's provision runs in a kubelet-made pod.

hack/image.py's image is imported into the real node's containerd (``ctr images import``), and
pods run from it as the agent's DaemonSet and an inference pod would: a privileged pod with huge
page/memory limits and the host root as a Bidirectional hostPath provisions a pool that appears
on the host; an unprivileged consumer pod requesting no huge pages, given the pool directory
with HostToContainer, writes into it and the host reads the same memory; a pod whose memory
limit cannot hold a tmpfs pool is refused inside the container with the limit named in its log.
docs/real-node.md, "The image" and "Limits refused up front".
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.node import TOLERATION, RealNode
from fixtures.node_image import REPO, image_tool
from fixtures.wait import wait_for
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import mounts

pytestmark = [pytest.mark.node, pytest.mark.root]

MiB = 1 << 20
ROOT_IN_POD = "/var/lib/offloadpool"
MARK = b"written by the consumer pod"


@pytest.fixture(scope="module")
def chart_image(real_node: RealNode) -> str:
    """The chart's image, built (cached) and imported into the node's containerd; its name."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hack.image", "archive"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr
    archive = out.stdout.strip().splitlines()[-1]
    real_node.ctr("images", "import", "--platform", "linux/amd64", archive)
    name = str(image_tool().image_name())
    assert name in real_node.ctr("images", "ls", "-q").stdout.split()
    return name


@pytest.fixture
def world(real_node: RealNode) -> Iterator[dict[str, Any]]:
    """A namespace and a pool root under the node's shared host root; both cleaned up."""
    ns = f"img-{uuid.uuid4().hex[:8]}"
    real_node.kubectl("create", "namespace", ns)
    wait_for(
        f"ServiceAccount default in {ns}",
        lambda: real_node.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        60,
    )
    pools = real_node.host_root / ns
    try:
        yield {"ns": ns, "pools": pools}
    finally:
        real_node.kubectl(
            "delete", "pods", "--all", "-n", ns, "--grace-period=1", "--timeout=90s", check=False
        )
        real_node.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for child in list(pools.iterdir()) if pools.is_dir() else []:
            if child.is_dir():
                release(pools, child.name, force=True)
        for m in reversed(mounts.mounts_under(pools)):
            mounts.umount(m.target, lazy=True)
        if pools.is_dir():
            pools.rmdir()


def run_pod(
    real_node: RealNode, ns: str, name: str, image: str, command: list[str], **container: Any
) -> tuple[dict, str]:
    """Create a one-container pod tolerating the node's taint; wait until it ends; (pod, log)."""
    volumes = container.pop("volumes", [])
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "tolerations": [TOLERATION],
        "volumes": volumes,
        "containers": [
            {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command, **container}
        ],
    }
    if container.get("securityContext", {}).get("privileged"):
        spec["hostPID"] = True  # as the agent's DaemonSet runs
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    real_node.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(manifest))
    deadline = time.monotonic() + 180
    while True:
        obj = json.loads(real_node.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
        if obj["status"].get("phase") in ("Succeeded", "Failed"):
            break
        if time.monotonic() > deadline:
            events = real_node.kubectl("get", "events", "-n", ns, check=False).stdout
            raise AssertionError(
                f"pod {name} did not end: {json.dumps(obj['status'])}\n{events}\n{real_node.logs()}"
            )
        time.sleep(0.5)
    log = real_node.kubectl("logs", name, "-n", ns, check=False)
    return obj, log.stdout + log.stderr


def agent_pod(
    real_node: RealNode, w: dict[str, Any], image: str, medium: str, capacity: str, limits: dict[str, str]
) -> tuple[dict, str]:
    command = ["offloadpool", "provision", "--root", ROOT_IN_POD, "--name", "pool", "--capacity", capacity]
    return run_pod(
        real_node,
        w["ns"],
        f"agent-{uuid.uuid4().hex[:6]}",
        image,
        [*command, "--medium", medium],
        securityContext={"privileged": True},
        resources={"limits": limits},
        volumeMounts=[{"name": "host", "mountPath": ROOT_IN_POD, "mountPropagation": "Bidirectional"}],
        volumes=[{"name": "host", "hostPath": {"path": str(w["pools"]), "type": "DirectoryOrCreate"}}],
    )


@pytest.mark.parametrize(
    "medium,fstype,limits",
    [
        ("HugePages-2Mi", "hugetlbfs", {"hugepages-2Mi": "64Mi", "memory": "256Mi", "cpu": "200m"}),
        ("MemoryTHP", "tmpfs", {"memory": "320Mi", "cpu": "200m"}),
    ],
)
def test_agent_pod_provisions_and_a_consumer_pod_uses_the_pool(
    real_node: RealNode,
    chart_image: str,
    world: dict[str, Any],
    medium: str,
    fstype: str,
    limits: dict[str, str],
) -> None:
    obj, log = agent_pod(real_node, world, chart_image, medium, "64Mi", limits)
    assert obj["status"]["phase"] == "Succeeded", (obj["status"], log)

    pool = world["pools"] / "pool"
    m = mounts.mount_at(pool / "mnt")
    assert m is not None and m.fstype == fstype, "the pool's mount did not reach the host"
    manifest = json.loads((pool / "manifest.json").read_text())
    assert manifest["total_bytes"] == 64 * MiB
    # Where the pool is charged once the agent's pod has ended (docs/real-node.md, "What the
    # cgroups charge"): tmpfs pages stay in the pods' memory cgroup tree (kubepods, the limit
    # that is enforced here); huge pages are not memory-cgroup memory, and are charged to the
    # unified kubepods when the unified root enables hugetlb (no per-pod hugetlb cgroup here).
    kubepods_memory = int(Path("/sys/fs/cgroup/memory/kubepods/memory.usage_in_bytes").read_text())
    hugetlb = Path("/sys/fs/cgroup/unified/kubepods/hugetlb.2MB.current")
    if fstype == "tmpfs":
        assert kubepods_memory >= 64 * MiB, kubepods_memory
    elif hugetlb.exists():
        assert int(hugetlb.read_text()) >= 64 * MiB
    seg = sorted(p for p in (pool / "mnt").iterdir() if p.is_file() and p.stat().st_size > 0)[0]

    code = (
        f"import mmap, os; fd = os.open('/pool/mnt/{seg.name}', os.O_RDWR); "
        f"m = mmap.mmap(fd, os.fstat(fd).st_size); m[:{len(MARK)}] = {MARK!r}; m.flush(); print('wrote')"
    )
    obj, log = run_pod(
        real_node,
        world["ns"],
        "consumer",
        chart_image,
        ["python", "-c", code],
        resources={"limits": {"memory": "64Mi", "cpu": "100m"}},  # no huge pages requested
        volumeMounts=[{"name": "pool", "mountPath": "/pool", "mountPropagation": "HostToContainer"}],
        volumes=[{"name": "pool", "hostPath": {"path": str(pool), "type": "Directory"}}],
    )
    assert obj["status"]["phase"] == "Succeeded" and "wrote" in log, (obj["status"], log)
    with open(seg, "rb") as fh:
        assert fh.read(len(MARK)) == MARK


def test_a_pod_whose_memory_limit_cannot_hold_the_pool_is_refused_by_name(
    real_node: RealNode, chart_image: str, world: dict[str, Any]
) -> None:
    obj, log = agent_pod(real_node, world, chart_image, "Memory", "128Mi", {"memory": "96Mi", "cpu": "100m"})
    assert obj["status"]["phase"] == "Failed", (obj["status"], log)
    state = obj["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 1, state  # refused, not OOM-killed (137)
    text = " ".join(log.split())
    assert "Traceback" not in log, log
    assert "memory.limit_in_bytes is 96.00 MiB" in text or "memory.max is 96.00 MiB" in text, text
    assert "resources.limits.memory: " in text, text
    assert [m for m in mounts.mounts_under(world["pools"]) if Path(m.target) != world["pools"]] == []
