"""The agent's engine count skips its /proc scan only while no pool file can have been opened.

Real processes on a real tmpfs region: a holder in its own mount namespace that opens a pool
file through a private bind mount (as a pod does), one that maps and closes (stock vLLM), one
that takes the lease after opening it before the watch existed. Each is counted at the first
count after it appears, and counted gone after it leaves; with nothing attached, counts do no
scan at all. ``scans`` is the counter's own tally of /proc scans.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from offloadpool.agent.holder_watch import HolderCount
from offloadpool.region import holders
from offloadpool.region.lease import lease_path
from offloadpool.region.manifest import MANIFEST_NAME
from offloadpool.region.provision import provision
from offloadpool.region.release import release
from offloadpool.region.request import PoolRequest
from test_region_holders import first_file, start_holder, stop

MiB = 1 << 20


def region(region_root: Path, name: str) -> tuple[PoolRequest, Path]:
    req = PoolRequest(name=name, capacity=8 * MiB, medium="Memory")
    provision(req, region_root)
    return req, region_root / name


def test_counts_without_scanning_while_nothing_is_attached(region_root):
    _, pool_dir = region(region_root, "idle")
    counter = HolderCount(pool_dir)
    assert counter.count() == 0 and counter.scans == 1
    for _ in range(5):
        assert counter.count() == 0
    assert counter.scans == 1, "an idle pool was scanned again"
    # the agent's own reads of the pool directory (manifest, listing the mount) change nothing
    assert (pool_dir / MANIFEST_NAME).read_bytes()
    os.listdir(pool_dir / "mnt")
    assert counter.count() == 0 and counter.scans == 1


def test_an_opener_in_another_mount_namespace_is_seen_and_its_exit_too(region_root, processes, tmp_path):
    req, pool_dir = region(region_root, "opened")
    counter = HolderCount(pool_dir)
    assert counter.count() == 0
    scans = counter.scans
    holder = start_holder(processes, tmp_path, first_file(req, region_root), "open")
    assert counter.count() == 1 and counter.scans == scans + 1
    assert counter.count() == 1 and counter.scans == scans + 2, "a held pool must be scanned every time"
    stop(holder)
    assert counter.count() == 0
    scans = counter.scans
    assert counter.count() == 0 and counter.scans == scans, "idle again: no more scans"


def test_a_mapping_without_an_open_file_is_counted_until_it_goes(region_root, processes, tmp_path):
    req, pool_dir = region(region_root, "mapped")
    counter = HolderCount(pool_dir)
    assert counter.count() == 0
    mapper = start_holder(processes, tmp_path, first_file(req, region_root), "map")
    assert counter.count() == 1  # it opened (an event), mapped, and closed its fd
    assert counter.count() == 1, "no event when the fd closed: the mapping is still found"
    stop(mapper)
    assert counter.count() == 0


def test_a_lease_opened_before_the_watch_and_locked_after_it_is_counted(region_root, processes):
    _, pool_dir = region(region_root, "leased")
    fd = os.open(lease_path(pool_dir), os.O_RDWR)  # opened before any watch: no event will say so
    try:
        counter = HolderCount(pool_dir)
        assert counter.count() == 0
        code = f"import fcntl, sys; fcntl.flock({fd}, fcntl.LOCK_SH); print('locked', flush=True); sys.stdin.read()"  # noqa: E501
        locker = processes([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(fd,))
        assert locker.stdout.readline().strip() == "locked"
        assert holders.pool_lockers(pool_dir) == {locker.pid}
        assert counter.count() == 1, "a flock taken without a new open was missed"
        locker.stdin.close()
        assert locker.wait(timeout=30) == 0
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert counter.count() == 0


def test_a_rebuilt_region_is_watched_afresh(region_root, processes, tmp_path):
    req, pool_dir = region(region_root, "rebuilt")
    counter = HolderCount(pool_dir)
    assert counter.count() == 0
    release(region_root, req.name)
    assert counter.count() == 0
    req, pool_dir = region(region_root, "rebuilt")  # a new mount, new inodes
    assert counter.count() == 0
    scans = counter.scans
    holder = start_holder(processes, tmp_path, first_file(req, region_root), "open")
    assert counter.count() == 1 and counter.scans == scans + 1, "the new mount's opens are not watched"
    stop(holder)
    assert counter.count() == 0
