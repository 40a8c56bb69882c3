"""The agent's mount, made inside the image's container, reaches the host and a consumer container.

The containers run under runc from the image hack/image.py builds, set up as the kubelet's
runtime sets up the agent pod (privileged, host PID, the host root as a hostPath volume with
``mountPropagation: Bidirectional``) and a consumer pod (unprivileged, the pool directory with
``HostToContainer``). As on a node, the agent's hostPath must sit on a shared mount: here a
bind mount of a test directory onto itself, made shared (a node's ``/`` usually is shared; the
kubelet refuses Bidirectional otherwise). The control: with propagation ``None`` the same
provision succeeds in the container and nothing reaches the host.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.node_image import build_image, image_manifest, runc_bundle, runc_run, unpack
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import mounts

pytestmark = pytest.mark.root  # builds images, mounts, cgroups: root only

MiB = 1 << 20
AGENT_ROOT = "/var/lib/offloadpool"  # the chart's host root, mounted at the same path
MARK = b"written by the consumer container"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    if shutil.which("runc") is None:
        pytest.fail("runc is not installed (apt-get install runc; hack/test.sh installs it)")
    layout, _, _ = build_image()
    _, _, config = image_manifest(layout)
    rootfs = tmp_path_factory.mktemp("runc-image") / "rootfs"
    unpack(layout, rootfs)
    yield rootfs, config
    shutil.rmtree(rootfs, ignore_errors=True)


@pytest.fixture
def host_root(tmp_path: Path, hugepage_baseline: dict[int, int]) -> Iterator[Path]:
    """The agent's host root on a shared mount; every pool under it released afterwards."""
    root = tmp_path / "host-root"
    root.mkdir()
    subprocess.run(["mount", "--bind", str(root), str(root)], check=True)
    subprocess.run(["mount", "--make-shared", str(root)], check=True)
    try:
        yield root
    finally:
        for child in list(root.iterdir()):
            if child.is_dir():
                try:
                    release(root, child.name, force=True)
                except Exception:
                    pass
        for m in reversed(mounts.mounts_under(root)):
            mounts.umount(m.target, lazy=True)
        if mounts.mount_at(root) is not None:
            subprocess.run(["umount", "-l", str(root)], check=True)


def provision_in_agent_container(
    image: tuple[Path, dict[str, Any]], host_root: Path, bundle: Path, medium: str, propagation: str
) -> subprocess.CompletedProcess:
    rootfs, config = image
    args = [
        "offloadpool",
        "provision",
        "--root",
        AGENT_ROOT,
        "--name",
        "pool",
        "--capacity",
        "64Mi",
        "--medium",
        medium,
    ]
    runc_bundle(bundle, rootfs, config, args, [(host_root, AGENT_ROOT, propagation)], privileged=True)
    return runc_run(bundle, timeout=300)


@pytest.mark.parametrize("medium,fstype", [("Memory", "tmpfs"), ("HugePages-2Mi", "hugetlbfs")])
def test_bidirectional_mount_reaches_host_and_consumer(
    image, host_root: Path, tmp_path: Path, medium: str, fstype: str
) -> None:
    out = provision_in_agent_container(image, host_root, tmp_path / "agent", medium, "Bidirectional")
    assert out.returncode == 0, (out.stdout, out.stderr)

    # on the host: the pool's own mount, made in the container, with its manifest
    pool = host_root / "pool"
    m = mounts.mount_at(pool / "mnt")
    assert m is not None and m.fstype == fstype, mounts.mounts_under(host_root)
    manifest = json.loads((pool / "manifest.json").read_text())
    assert manifest["total_bytes"] == 64 * MiB and manifest["medium"] == medium
    files = sorted(p for p in (pool / "mnt").iterdir() if p.is_file() and p.stat().st_size > 0)
    assert files, list((pool / "mnt").iterdir())

    # a consumer pod: the pool directory with HostToContainer, unprivileged; writes through
    # the mount it sees, and the host reads the same memory
    rootfs, config = image
    seg = files[0].name
    code = (
        f"import mmap, os; fd = os.open('/pool/mnt/{seg}', os.O_RDWR); "
        f"m = mmap.mmap(fd, os.fstat(fd).st_size); m[:{len(MARK)}] = {MARK!r}; m.flush(); "
        "print(os.fstat(fd).st_size)"
    )
    runc_bundle(
        tmp_path / "consumer",
        rootfs,
        config,
        ["python", "-c", code],
        [(pool, "/pool", "HostToContainer")],
        privileged=False,
    )
    out = runc_run(tmp_path / "consumer")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert int(out.stdout) == files[0].stat().st_size
    with open(files[0], "rb") as fh:
        assert fh.read(len(MARK)) == MARK


def test_without_propagation_nothing_reaches_the_host(image, host_root: Path, tmp_path: Path) -> None:
    """The control: the same container with propagation None provisions in its own mount
    namespace only; when it exits the memory is gone and the host never saw a mount."""
    out = provision_in_agent_container(image, host_root, tmp_path / "agent", "Memory", "None")
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert mounts.mount_at(host_root / "pool" / "mnt") is None
    assert [m for m in mounts.mounts_under(host_root) if Path(m.target) != host_root] == []


def test_the_containers_memory_limit_refuses_a_tmpfs_pool_inside_it(
    image, host_root: Path, tmp_path: Path
) -> None:
    """The agent's container with a memory limit below the pool (as the kubelet sets it from
    resources.limits.memory): the check reads the limit through the container's own cgroup
    mount and refuses, naming it, before anything reaches the host."""
    rootfs, config = image
    args = ["offloadpool", "provision", "--root", AGENT_ROOT, "--name", "pool", "--capacity", "128Mi"]
    args += ["--medium", "Memory"]
    runc_bundle(
        tmp_path / "agent",
        rootfs,
        config,
        args,
        [(host_root, AGENT_ROOT, "Bidirectional")],
        privileged=True,
        resources={"memory": {"limit": 96 * MiB}},
    )
    out = runc_run(tmp_path / "agent")
    message = " ".join(out.stderr.split())
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert "memory.limit_in_bytes is 96.00 MiB" in message or "memory.max is 96.00 MiB" in message, message
    assert "Memory pool (tmpfs) needs 128.00 MiB" in message and "resources.limits.memory: " in message, (
        message
    )
    assert not (host_root / "pool").exists() or not any((host_root / "pool").iterdir())
    assert [m for m in mounts.mounts_under(host_root) if Path(m.target) != host_root] == []
