"""A pool its own cgroup cannot hold is refused before a byte is touched, with the limit named.

Real cgroups: each test makes a child cgroup (hugetlb on the cgroup v2 hierarchy, memory on
whichever hierarchy holds it here — v1 on the hybrid machines), sets a limit as the kubelet
would from a pod's resources, and runs ``offloadpool provision`` (or the agent) as a process
moved into it. Before the check, such a process crashed with a traceback
(``VMError: [Errno 12] mmap ... Cannot allocate memory`` past ``hugetlb.2MB.rsvd.max``); the
last test shows that the kernel still enforces the limit the check reads, so the refusal is
about a real limit. Every cgroup made here is removed afterwards.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.cgroups import Cgroups, in_cgroups
from fixtures.host import cli_argv, hugepage_totals
from offloadpool.api import agent_env
from offloadpool.region.memory import cgroup_limits, mounts

pytestmark = pytest.mark.root  # builds images, mounts, cgroups: root only

MiB = 1 << 20
GROUP, VERSION = "offloadpool.io", "v1alpha1"


def run_provision(
    groups: list[Path], root: Path, name: str, capacity: str, medium: str
) -> subprocess.CompletedProcess:
    argv = cli_argv(
        "provision", "--root", str(root), "--name", name, "--capacity", capacity, "--medium", medium
    )
    return subprocess.run(
        in_cgroups(groups, argv),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "400"},
    )


def read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def flat(text: str) -> str:
    """The CLI's message on one line (rich wraps long lines)."""
    return " ".join(text.split())


def assert_nothing_built(root: Path, baseline: dict[int, int]) -> None:
    assert list(root.iterdir()) == [], "a refused pool left files behind"
    assert mounts.mounts_under(root) == [], "a refused pool left a mount behind"
    assert hugepage_totals() == baseline, "a refused pool changed the huge page pool"


@pytest.mark.parametrize("limit_file", ["hugetlb.2MB.max", "hugetlb.2MB.rsvd.max"])
def test_hugetlb_limit_refuses_the_pool_on_the_cli(
    cgroups, region_root, hugepage_baseline, limit_file
) -> None:
    cg = cgroups.child("hugetlb")
    (cg / limit_file).write_text(str(16 * MiB))
    out = run_provision([cg], region_root, "capped", "32Mi", "HugePages-2Mi")
    message = flat(out.stderr)
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert "insufficient capacity" in message, message
    assert f"{cg / limit_file} is 16.00 MiB ({16 * MiB} bytes)" in message, message
    assert f"needs 32.00 MiB ({32 * MiB} bytes)" in message, message
    assert "short by 16.00 MiB" in message, message
    assert "resources.limits.hugepages-2Mi: 32Mi" in message, message
    assert read_int(cg / "hugetlb.2MB.current") == 0 and read_int(cg / "hugetlb.2MB.rsvd.current") == 0
    assert_nothing_built(region_root, hugepage_baseline)


def test_a_limit_on_an_ancestor_binds_and_is_named(cgroups, region_root, hugepage_baseline) -> None:
    parent = cgroups.child("hugetlb")
    (parent / "hugetlb.2MB.max").write_text(str(8 * MiB))
    child = cgroups.child("hugetlb", parent=parent)  # no limit of its own
    out = run_provision([child], region_root, "capped", "16Mi", "HugePages-2Mi")
    message = flat(out.stderr)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{parent / 'hugetlb.2MB.max'} is 8.00 MiB" in message, message
    assert f"an ancestor of this process's cgroup ({child})" in message, message
    assert_nothing_built(region_root, hugepage_baseline)


def test_memory_limit_refuses_a_tmpfs_pool(cgroups, region_root, hugepage_baseline) -> None:
    h = cgroup_limits.hierarchy("memory")
    assert h is not None
    cg = cgroups.child("memory")
    limit_name = "memory.max" if h.version == 2 else "memory.limit_in_bytes"
    (cg / limit_name).write_text(str(96 * MiB))
    out = run_provision([cg], region_root, "capped", "128Mi", "Memory")
    message = flat(out.stderr)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{cg / limit_name} is 96.00 MiB ({96 * MiB} bytes)" in message, message
    assert "Memory pool (tmpfs) needs 128.00 MiB" in message, message
    # the pod must ask for the pool plus what the process itself uses, in whole MiB
    asked = re.search(r"resources\.limits\.memory: (\d+)Mi", message)
    assert asked and 128 < int(asked[1]) < 128 + 96, message
    assert_nothing_built(region_root, hugepage_baseline)


@pytest.mark.parametrize("medium", ["HugePages-2Mi", "MemoryTHP"])
def test_a_pool_within_the_limits_is_built_and_charged_to_that_cgroup(
    cgroups, region_root, hugepage_baseline, medium
) -> None:
    """The check passes what fits, and the charge lands where the module says it does."""
    huge, mem = cgroups.child("hugetlb"), cgroups.child("memory")
    mem_h = cgroup_limits.hierarchy("memory")
    assert mem_h is not None
    (huge / "hugetlb.2MB.max").write_text(str(32 * MiB))
    (huge / "hugetlb.2MB.rsvd.max").write_text(str(32 * MiB))
    (mem / ("memory.max" if mem_h.version == 2 else "memory.limit_in_bytes")).write_text(str(256 * MiB))
    out = run_provision([huge, mem], region_root, "fits", "32Mi", medium)
    assert out.returncode == 0, (out.stdout, out.stderr)
    usage = "memory.current" if mem_h.version == 2 else "memory.usage_in_bytes"
    if medium == "HugePages-2Mi":
        # both charges stay with the provisioning process's cgroup after it exited
        assert read_int(huge / "hugetlb.2MB.current") == 32 * MiB
        assert read_int(huge / "hugetlb.2MB.rsvd.current") == 32 * MiB
    else:
        assert read_int(huge / "hugetlb.2MB.current") == 0
        assert read_int(mem / usage) >= 32 * MiB  # the tmpfs pages, still charged

    # A consumer (an inference pod requesting no huge pages and little memory) in cgroups that
    # allow it no huge pages at all and 48 MiB of memory maps the pool and writes every page:
    # it succeeds, and nothing of the pool is charged to it (less than 16 MiB, its own Python).
    c_huge, c_mem = cgroups.child("hugetlb"), cgroups.child("memory")
    (c_huge / "hugetlb.2MB.max").write_text("0")
    (c_huge / "hugetlb.2MB.rsvd.max").write_text("0")
    (c_mem / ("memory.max" if mem_h.version == 2 else "memory.limit_in_bytes")).write_text(str(48 * MiB))
    files = sorted(
        str(p) for p in (region_root / "fits" / "mnt").iterdir() if p.is_file() and p.stat().st_size
    )
    code = (
        "import mmap, os, sys\n"
        "for path in sys.argv[1:]:\n"
        "    fd = os.open(path, os.O_RDWR); size = os.fstat(fd).st_size\n"
        "    m = mmap.mmap(fd, size)\n"
        "    for off in range(0, size, 4096): m[off] = 7\n"
        "    m.close(); os.close(fd)\n"
        "print('wrote')\n"
    )
    before = read_int(c_mem / usage)
    out = subprocess.run(
        in_cgroups([c_huge, c_mem], [sys.executable, "-c", code, *files]),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "wrote" in out.stdout, (out.returncode, out.stderr)
    assert (
        read_int(c_huge / "hugetlb.2MB.current") == 0 and read_int(c_huge / "hugetlb.2MB.rsvd.current") == 0
    )
    assert read_int(c_mem / usage) - before < 16 * MiB, "the pool's pages were charged to the consumer"


def test_the_kernel_enforces_the_limit_the_check_reads(cgroups, tmp_path) -> None:
    """Without the check, the pre-fault's own mmap fails past hugetlb.2MB.rsvd.max (the
    traceback the issue reported): the limits read are the ones that bite."""
    cg = cgroups.child("hugetlb")
    (cg / "hugetlb.2MB.rsvd.max").write_text(str(4 * MiB))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M,size=8M", "probe", str(mnt)], check=True)
    try:
        code = (
            "import os, sys; from offloadpool.region.memory import vm\n"
            f"fd = os.open({str(mnt / 'f')!r}, os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, {8 * MiB})\n"
            "try:\n    vm.map_shared(fd, %d)\nexcept vm.VMError as e:\n    print(e.errno); sys.exit(3)\n"
            % (8 * MiB)
        )
        out = subprocess.run(
            in_cgroups([cg], [sys.executable, "-c", code]), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 3 and out.stdout.strip() == "12", (out.stdout, out.stderr)  # ENOMEM
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ---- the agent: the same refusal reaches the OffloadPoolNode status ---------------------------


@pytest.fixture
def agent_world(crds_installed: Any, cgroups: Cgroups) -> Iterator[dict[str, Any]]:
    from kubernetes import client

    from test_agent_process import remove_world

    cp = crds_installed
    work = Path(tempfile.mkdtemp(prefix="offloadpool-cgroup-agent-"))
    api = cp.api_client()
    custom = client.CustomObjectsApi(api)
    state: dict[str, Any] = {"cp": cp, "work": work, "custom": custom, "procs": [], "names": []}
    try:
        yield state
    finally:
        for proc in state["procs"]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        remove_world(state, api)


@pytest.mark.controlplane
def test_agent_reports_the_cgroup_limit_in_status(agent_world, cgroups) -> None:
    from fixtures.cluster import free_port
    from fixtures.wait import wait_for
    from test_agent_process import create

    pool, node = "cg-capped", "node-cg"
    custom = agent_world["custom"]
    # the operator's part, played by hand as in the agent's own tests
    create(agent_world, pool, node, {"capacity": "32Mi", "medium": "HugePages-2Mi"})

    cg = cgroups.child("hugetlb")
    (cg / "hugetlb.2MB.max").write_text(str(16 * MiB))
    root = agent_world["work"] / "root"
    env = {
        **os.environ,
        "KUBECONFIG": str(agent_world["cp"].kubeconfig),
        agent_env.POOL_NAME_ENV: pool,
        agent_env.NODE_NAME_ENV: node,
        agent_env.POD_NAMESPACE_ENV: "default",
        agent_env.ROOT_ENV: str(root),
        agent_env.HTTP_PORT_ENV: str(free_port()),
        agent_env.HEARTBEAT_ENV: "1",
        agent_env.RETRY_ENV: "1",
        "PYTHONUNBUFFERED": "1",
    }
    exe = str(Path(sys.executable).parent / "offloadpool-agent")
    log = open(agent_world["work"] / "agent.log", "wb")
    agent_world["procs"].append(
        subprocess.Popen(
            in_cgroups([cg], [exe]), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    )

    def failed() -> dict[str, Any] | None:
        obj = custom.get_cluster_custom_object(GROUP, VERSION, "offloadpoolnodes", f"{pool}.{node}")
        st = obj.get("status") or {}
        return st if st.get("phase") == "Failed" else None

    st = wait_for("Failed", failed, timeout=90)
    assert st["reason"] == "InsufficientHugePages", st
    assert f"{cg / 'hugetlb.2MB.max'} is 16.00 MiB" in st["message"], st["message"]
    assert "resources.limits.hugepages-2Mi: 32Mi" in st["message"], st["message"]
    assert not (root / pool).exists() or not any((root / pool).iterdir())
    assert read_int(cg / "hugetlb.2MB.current") == 0
    assert "Traceback" not in (agent_world["work"] / "agent.log").read_text()
