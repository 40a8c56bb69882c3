"""Provision, keep and release every medium x layout with real mounts, files and madvise."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.host import hugepage_totals
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.files.planner import plan
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import list_pools, pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB, GiB = 1 << 20, 1 << 30
PROBE = 64 * 1024

# (capacity, min_segment, slot) per medium, small enough for a shared 2-core machine, big
# enough for several segment files per region.
SIZES = {
    "HugePages-2Mi": (256 * MiB, 64 * MiB, 2 * MiB),
    "HugePages-1Gi": (2 * GiB, GiB, 512 * MiB),
    "Memory": (128 * MiB, 32 * MiB, 64 * 1024),
    "MemoryTHP": (256 * MiB, 64 * MiB, 2 * MiB),
}

READER = r"""
import hashlib, json, mmap, os, sys
out = []
for path, off, n in json.loads(sys.argv[1]):
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    out.append(hashlib.sha256(m[off:off + n]).hexdigest())
    m.close(); os.close(fd)
print(json.dumps(out))
"""


def request(medium: str, layout: str) -> PoolRequest:
    cap, min_seg, slot = SIZES[medium]
    ranks = 2
    if layout == "Replicated":
        ranks = 1
        if medium == "HugePages-1Gi":
            cap = GiB
    return PoolRequest(
        name=f"t-{medium.lower()}-{layout.lower()}",
        capacity=cap,
        medium=medium,
        layout_type=layout,
        ranks=ranks,
        min_segment=min_seg,
        slot_bytes=slot if layout == "Interleaved" else None,
        uid=1234,
        gid=2345,
        mode=0o640,
    )


def write_probes(pool_dir: Path, manifest) -> list[tuple[str, int, int, str]]:
    """Write random bytes at the start and end of every segment through one mapping."""
    probes = []
    for region in manifest.regions:
        for seg in region.segments:
            path = str(pool_dir / seg.file)
            fd = os.open(path, os.O_RDWR)
            m = mmap.mmap(fd, seg.bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for off in (0, seg.bytes - PROBE):
                data = os.urandom(PROBE)
                m[off : off + PROBE] = data
                probes.append((path, off, PROBE, hashlib.sha256(data).hexdigest()))
            m.close()
            os.close(fd)
    return probes


def read_probes_elsewhere(probes) -> list[str]:
    """Hashes of the probed ranges read through fresh mappings in another process."""
    arg = json.dumps([(p, o, n) for p, o, n, _ in probes])
    out = subprocess.run([sys.executable, "-c", READER, arg], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("layout", ["Replicated", "PerRank", "Interleaved"])
@pytest.mark.parametrize("medium", ["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"])
def test_provision_keep_release(region_root, hugepage_baseline, medium, layout):
    req = request(medium, layout)
    expected = plan(req)
    seen = []
    result = provision(req, region_root, progress=lambda done, total: seen.append((done, total)))
    pool_dir = region_root / req.name

    # what was planned is what exists
    assert not result.reused and result.populated_bytes == req.capacity
    manifest = load_manifest(pool_dir)
    assert manifest == result.manifest
    assert manifest.regions == expected.regions and manifest.total_bytes == req.capacity
    assert len(manifest.regions) == (2 if layout == "PerRank" else 1)
    if medium != "HugePages-1Gi":  # 1 GiB pages: a region of 1-2 pages, kept small on purpose
        assert all(len(r.segments) >= 2 for r in manifest.regions), (
            "sizes chosen for several files per region"
        )
    m = mounts.mount_at(pool_dir / "mnt")
    assert m is not None and m.fstype == expected.medium.fstype
    assert "shared:" in m.propagation
    files = sorted(p.name for p in (pool_dir / "mnt").iterdir())
    assert files == sorted(Path(s.file).name for s in expected.segments)
    for seg in expected.segments:
        st = os.stat(pool_dir / seg.file)
        assert st.st_size == seg.bytes
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 2345, 0o640)
    assert seen and seen[-1] == (req.capacity, req.capacity)

    state = pool_state(region_root, req.name)
    assert state.phase == "Ready" and state.populated_bytes == req.capacity
    assert state.engines_attached == 0
    if expected.medium.hugetlb:
        assert state.hugepage_coverage_percent == 100.0
    elif medium == "MemoryTHP":
        assert state.hugepage_coverage_percent > 0
    else:
        assert state.hugepage_coverage_percent == 0
    assert [s.name for s in list_pools(region_root)] == [req.name]

    # byte-exact through one mapping, read back through a fresh one in another process
    probes = write_probes(pool_dir, manifest)
    assert read_probes_elsewhere(probes) == [h for *_, h in probes]

    # a second provision of the same spec keeps the region and its data
    again = provision(req, region_root)
    assert again.reused and again.populated_bytes == 0
    assert read_probes_elsewhere(probes) == [h for *_, h in probes]

    # release leaves no mount, no file and no reserved huge page
    rel = release(region_root, req.name)
    assert rel.existed and not rel.forced
    assert not pool_dir.exists()
    assert mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline
    assert release(region_root, req.name).existed is False
