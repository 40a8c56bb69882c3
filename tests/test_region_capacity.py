"""A node that is too small fails before anything is created, and the message has the numbers."""

from __future__ import annotations

import re

import pytest

from fixtures.host import hugepage_totals
from offloadpool.region import mounts
from offloadpool.region.capacity import meminfo
from offloadpool.region.errors import CapacityError
from offloadpool.region.provision import provision
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
    if medium.startswith("HugePages"):
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
