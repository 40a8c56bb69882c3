"""Counting attached engines scans /proc only when a pool file is open or mapped somewhere.

``holders.count`` first asks the kernel, with one write-lease attempt per file, whether any
open file description of the pool's files exists (a mapping keeps the one it was made from);
only then does it scan every process (``holders.scans()`` counts those scans). Real processes
on real tmpfs and hugetlbfs regions: a holder in its own mount namespace that opens a pool file
through a private bind mount (as a pod does), one that maps and closes its fd (stock vLLM),
one that holds only the lease. Each is counted while there and not after. Releasing or
rebuilding a pool (``exclusive_unused``) scans only when the probe finds a file open or mapped.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offloadpool.region.files.manifest import MANIFEST_NAME
from offloadpool.region.holding import holders
from offloadpool.region.holding.lease import lease_path
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.request import PoolRequest
from test_region_holders import first_file, start_holder, stop

MiB = 1 << 20


def region(region_root: Path, name: str, medium: str = "Memory") -> tuple[PoolRequest, Path]:
    req = PoolRequest(name=name, capacity=8 * MiB, medium=medium)
    provision(req, region_root)
    return req, region_root / name


def test_an_idle_pool_is_counted_without_a_scan(region_root):
    _, pool_dir = region(region_root, "idle")
    scans = holders.scans()
    for _ in range(5):
        assert holders.count(pool_dir) == 0
    (pool_dir / MANIFEST_NAME).read_bytes()  # reading the manifest is not holding the memory
    assert holders.count(pool_dir) == 0
    assert holders.scans() == scans, "an idle pool was scanned"
    assert holders.open_anywhere(pool_dir) is False


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_an_opener_in_another_mount_namespace_is_seen_and_its_exit_too(
    region_root, processes, tmp_path, medium
):
    req, pool_dir = region(region_root, "opened", medium)
    holder = start_holder(processes, tmp_path, first_file(req, region_root), "open")
    scans = holders.scans()
    assert holders.open_anywhere(pool_dir) is True
    assert holders.count(pool_dir) == 1 and holders.scans() == scans + 1
    stop(holder)
    assert holders.count(pool_dir) == 0 and holders.scans() == scans + 1, "gone: no scan needed"


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_a_mapping_without_an_open_fd_is_counted_until_it_goes(region_root, processes, tmp_path, medium):
    req, pool_dir = region(region_root, "mapped", medium)
    mapper = start_holder(processes, tmp_path, first_file(req, region_root), "map")
    assert holders.open_anywhere(pool_dir) is True, "a mapping whose fd was closed went unseen"
    assert holders.count(pool_dir) == 1
    stop(mapper)
    assert holders.open_anywhere(pool_dir) is False
    assert holders.count(pool_dir) == 0


def test_a_lease_holder_that_maps_nothing_is_counted_without_a_scan(region_root, processes):
    _, pool_dir = region(region_root, "leased")
    fd = os.open(lease_path(pool_dir), os.O_RDWR)
    try:
        code = (
            "import fcntl, sys; fcntl.flock(%d, fcntl.LOCK_SH); print('locked', flush=True); sys.stdin.read()"
        )
        locker = processes([sys.executable, "-c", code % fd], stdin=subprocess.PIPE, pass_fds=(fd,))
        assert locker.stdout.readline().strip() == "locked"
        scans = holders.scans()
        assert holders.count(pool_dir) == 1 and holders.scans() == scans
        locker.stdin.close()
        assert locker.wait(timeout=30) == 0
        fcntl.flock(fd, fcntl.LOCK_UN)  # the lock was the shared open file description's
    finally:
        os.close(fd)
    assert holders.count(pool_dir) == 0


def test_this_process_holding_a_file_open_is_not_an_engine(region_root):
    req, pool_dir = region(region_root, "self")
    with open(first_file(req, region_root), "rb"):
        assert holders.open_anywhere(pool_dir) is True  # the probe cannot tell whose
        scans = holders.scans()
        assert holders.count(pool_dir) == 0 and holders.scans() == scans + 1  # the scan can
    assert holders.count(pool_dir) == 0


def test_release_and_rebuild_of_an_idle_pool_scan_nothing_but_a_holder_still_stops_them(
    region_root, processes, tmp_path
):
    """``exclusive_unused`` (taken by release and by a rebuild) skips the scan only when the
    probe says no file is open or mapped: a stock-vLLM-like mapper, which takes no lease,
    still stops a release and is named."""
    req, pool_dir = region(region_root, "gate")
    mapper = start_holder(processes, tmp_path, first_file(req, region_root), "map")
    scans = holders.scans()
    with pytest.raises(holders.PoolInUse, match=r"maps the pool's memory"):
        release(region_root, "gate")
    assert holders.scans() > scans, "a mapped pool was released without looking for its holder"
    assert (pool_dir / MANIFEST_NAME).exists(), "the refused release touched the pool"
    stop(mapper)

    scans = holders.scans()
    rebuilt = provision(PoolRequest(name="gate", capacity=2 * req.capacity, medium="Memory"), region_root)
    assert not rebuilt.reused and rebuilt.manifest.total_bytes == 2 * req.capacity
    release(region_root, "gate")
    assert holders.scans() == scans, "an idle pool's rebuild or release scanned every process"
    assert not pool_dir.exists()
