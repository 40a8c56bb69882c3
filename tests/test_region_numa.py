"""NUMA placement through mbind: policies apply (and stick to tmpfs files), one-node machines
work, offline nodes are refused before anything is created."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from offloadpool.region.errors import RequestError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory.numa import online_nodes
from offloadpool.region.request import PoolRequest

MiB = 1 << 20


def numa_maps_line(path, size) -> str:
    """The /proc/self/numa_maps line of a fresh mapping of ``path`` after reading every page."""
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, size)
    try:
        for off in range(0, size, 4096):
            m[off]  # fault in: numa_maps then shows where the pages are (N<node>=<pages>)
        buf = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(buf)
        del buf
        with open("/proc/self/numa_maps") as fh:
            return next(line for line in fh if line.startswith(f"{addr:x} "))
    finally:
        m.close()
        os.close(fd)


@pytest.mark.parametrize("medium", ["Memory", "MemoryTHP", "HugePages-2Mi"])
@pytest.mark.parametrize(
    "policy, shown, nodes",
    [
        ("0", "bind:0", [[0], [0]]),
        ("Interleave", "interleave:", None),
        ("Spread", "bind:", None),
        ("None", "default", [[], []]),
    ],
)
def test_numa_policies(region_root, hugepage_baseline, medium, policy, shown, nodes):
    online = online_nodes()
    req = PoolRequest(
        name="numa", capacity=64 * MiB, medium=medium, numa=policy, layout_type="PerRank", ranks=2
    )
    provision(req, region_root)
    state = pool_state(region_root, req.name)
    expected = (
        nodes
        if nodes is not None
        else ([list(online)] * 2 if policy == "Interleave" else [[online[i % len(online)]] for i in range(2)])
    )
    assert [list(n) for n in state.numa_nodes] == expected
    line = numa_maps_line(region_root / req.name / "mnt" / "r1-s000", 32 * MiB)
    if medium != "HugePages-2Mi":
        assert shown in line, line  # tmpfs keeps the policy on the file for every later mapping
    placed = expected[1] or online
    counts = {
        int(tok[1:].split("=")[0]): int(tok.split("=")[1])
        for tok in line.split()
        if tok[:1] == "N" and "=" in tok
    }
    assert counts and set(counts) <= set(placed), line
    release(region_root, req.name)


def test_offline_node_is_refused_before_anything_exists(region_root):
    bad = max(online_nodes()) + 1
    with pytest.raises(RequestError, match=f"node\\(s\\) \\[{bad}\\] that are not online"):
        provision(PoolRequest(name="numa", capacity=64 * MiB, medium="Memory", numa=str(bad)), region_root)
    assert list(region_root.iterdir()) == []
