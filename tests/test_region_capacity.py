"""A node that is too small fails before anything is created, and the message has the numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fixtures.host import hugepage_totals, private_mounts_python
from offloadpool.region.errors import CapacityError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.memory import mounts
from offloadpool.region.memory.capacity import meminfo
from offloadpool.region.memory.media import is_hugetlbfs
from offloadpool.region.request import PoolRequest

GiB = 1 << 30


def far_too_much() -> int:
    """Twice the machine's memory, rounded to whole GiB (a multiple of every page size)."""
    return (2 * meminfo()["MemTotal"] // GiB + 1) * GiB


@pytest.mark.parametrize("medium", ["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"])
def test_shortfall_fails_before_anything_is_created(region_root, hugepage_baseline, medium):
    size = far_too_much()
    req = PoolRequest(name="huge", capacity=size, medium=medium)
    with pytest.raises(CapacityError) as info:
        provision(req, region_root)
    message = str(info.value)
    assert f"({size} bytes)" in message, message  # what was asked
    assert "short by" in message and re.search(r"short by [\d.]+ GiB \(\d+ bytes\)", message), message
    if is_hugetlbfs(medium):
        pages = size // (2 << 20 if medium == "HugePages-2Mi" else GiB)
        assert f"needs {pages} huge pages" in message, message
        assert "free and unreserved" in message, message
    else:
        assert "available" in message, message
    assert list(region_root.iterdir()) == []
    assert mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


def test_cli_reports_shortfall_with_exit_code(region_root, hugepage_baseline):
    from fixtures.host import cli

    out = cli(
        "provision",
        "--root",
        str(region_root),
        "--name",
        "big",
        "--capacity",
        f"{far_too_much() // GiB}Gi",
        "--medium",
        "HugePages-1Gi",
        check=False,
    )
    assert out.returncode == 1
    assert "insufficient capacity" in out.stderr and "short by" in out.stderr
    assert list(region_root.iterdir()) == []
    assert hugepage_totals() == hugepage_baseline


#: Run in a mount namespace of its own: makes that namespace full (fs.mount-max = its mounts)
#: and provisions; prints the refusal and exits 3, or exits 0 if the pool was built.
_FULL_NAMESPACE = r"""
import sys
from pathlib import Path
from offloadpool.region.errors import CapacityError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.request import PoolRequest

root, medium, limit = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
used = Path("/proc/self/mountinfo").read_text().count("\n")
Path("/proc/sys/fs/mount-max").write_text(str(used))
try:
    provision(PoolRequest(name="full", capacity=4 << 20, medium=medium), root)
except CapacityError as exc:
    print(f"used={used}")
    print(exc)
    sys.exit(3)
finally:
    Path("/proc/sys/fs/mount-max").write_text(limit)
"""


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_full_mount_namespace_is_refused_by_name_with_nothing_left(region_root, hugepage_baseline, medium):
    """fs.mount-max reached: the kernel's refusal of the pool's mount (ENOSPC) is reported as
    the limit, and the half-begun pool is gone — its directory, and for huge pages what it
    added to the kernel's pool. (The limit is not counted ahead of every provision: that would
    read the whole mount table each time.) The sysctl is global, so it is lowered only for the
    provision and put back whatever happens."""
    limit = Path("/proc/sys/fs/mount-max").read_text().strip()
    try:
        out = subprocess.run(
            private_mounts_python(_FULL_NAMESPACE, str(region_root), medium, limit),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        Path("/proc/sys/fs/mount-max").write_text(limit)
    assert out.returncode == 3, (out.returncode, out.stdout, out.stderr)
    used = re.search(r"used=(\d+)", out.stdout)
    assert used, out.stdout
    assert f"already has {used.group(1)} mounts and fs.mount-max is {used.group(1)}" in out.stdout, out.stdout
    assert "ENOSPC" in out.stdout, out.stdout
    assert list(region_root.iterdir()) == []
    assert mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline
