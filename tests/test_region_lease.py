"""The lease protects attached engines: release and reshaping wait for it, --force says what
it breaks, and a killed holder frees the pool."""

from __future__ import annotations

import mmap
import os
import signal
import sys
from pathlib import Path

import pytest

from fixtures.host import hugepage_totals
from fixtures.wait import wait_for
from offloadpool.region.errors import RegionError
from offloadpool.region.holding.lease import LeaseHeld, count_holders, lease_path
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20

HOLDER = r"""
import sys, time
from offloadpool.region.holding.lease import Lease
lease = Lease.shared(sys.argv[1])
print("held", flush=True)
time.sleep(3600)
"""


def hold(processes, pool_dir):
    proc = processes([sys.executable, "-c", HOLDER, str(pool_dir)])
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_release_refuses_while_held_and_succeeds_after_holder_is_killed(
    region_root, hugepage_baseline, processes
):
    req = PoolRequest(name="held", capacity=128 * MiB, medium="HugePages-2Mi", min_segment=32 * MiB)
    added = provision(req, region_root).hugepages_added  # 64 unless free pages were already there
    pool_dir = region_root / req.name
    engine = hold(processes, pool_dir)
    assert count_holders(lease_path(pool_dir)) == 1
    assert pool_state(region_root, req.name).engines_attached == 1

    with pytest.raises(LeaseHeld, match="held by 1 attached engine"):
        release(region_root, req.name)
    assert pool_state(region_root, req.name).phase == "Ready"  # untouched
    assert mounts.mount_at(pool_dir / "mnt") is not None

    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=30)
    wait_for(
        "the kernel to drop the flock", lambda: count_holders(lease_path(pool_dir)) == 0, 10, interval=0.01
    )
    result = release(region_root, req.name)
    assert result.existed and result.hugepages_returned == added
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


def test_spec_change_is_pending_while_held_then_applied(region_root, hugepage_baseline, processes):
    old = PoolRequest(name="reshape", capacity=64 * MiB, medium="MemoryTHP")
    provision(old, region_root)
    pool_dir = region_root / old.name
    fd = os.open(pool_dir / "mnt" / "r0-s000", os.O_RDWR)
    m = mmap.mmap(fd, 64 * MiB)
    m[:5] = b"kept!"
    m.close()
    os.close(fd)
    engine = hold(processes, pool_dir)

    new = PoolRequest(name="reshape", capacity=128 * MiB, medium="HugePages-2Mi")
    with pytest.raises(LeaseHeld):
        provision(new, region_root)
    state = pool_state(region_root, old.name)
    assert state.phase == "Ready" and state.medium == "MemoryTHP" and state.total_bytes == 64 * MiB
    with open(pool_dir / "mnt" / "r0-s000", "rb") as fh:
        assert fh.read(5) == b"kept!"
    # a generation bump with the same shape is applied in place, even while held
    same = provision(
        PoolRequest(name="reshape", capacity=64 * MiB, medium="MemoryTHP", generation=2, mode=0o600),
        region_root,
    )
    assert same.reused and same.manifest.generation == 2 and same.manifest.mode == 0o600

    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=30)
    result = provision(new, region_root)
    assert result.rebuilt and not result.reused
    state = pool_state(region_root, new.name)
    assert state.phase == "Ready" and state.medium == "HugePages-2Mi" and state.total_bytes == 128 * MiB
    assert mounts.mount_at(pool_dir / "mnt").fstype == "hugetlbfs"
    release(region_root, new.name)
    assert hugepage_totals() == hugepage_baseline


def test_force_release_says_what_it_breaks(region_root, hugepage_baseline, processes):
    req = PoolRequest(name="forced", capacity=64 * MiB, medium="HugePages-2Mi")
    provision(req, region_root)
    pool_dir = region_root / req.name
    engine = hold(processes, pool_dir)
    result = release(region_root, req.name, force=True)
    assert result.forced and result.engines_broken == 1
    assert "1 attached engine(s) keep mapping memory that no pool accounts for" in result.warnings[0]
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []
    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=30)
    assert hugepage_totals() == hugepage_baseline


def test_release_refuses_when_a_file_is_still_mapped_without_the_lease(region_root, hugepage_baseline):
    """A process that maps a segment without taking the lease still blocks the unmount: the
    release fails with a reason and leaves the pool intact (manifest put back)."""
    req = PoolRequest(name="mapped", capacity=64 * MiB, medium="Memory")
    provision(req, region_root)
    fd = os.open(region_root / req.name / "mnt" / "r0-s000", os.O_RDWR)
    try:
        with pytest.raises(RegionError, match="still has files of this pool mapped or open"):
            release(region_root, req.name)
        assert pool_state(region_root, req.name).phase == "Ready"
    finally:
        os.close(fd)
    assert release(region_root, req.name).existed
    assert mounts.mounts_under(region_root) == []


def test_a_growth_past_what_the_node_has_waits_for_the_holder_then_fails_untouched(
    region_root, hugepage_baseline, processes
):
    """Holders are looked at before the capacity check: a growth the node could not fit (here
    past its memory; in a pod, past the agent's cgroup limit) under a holder is LeaseHeld, not
    a capacity failure. Once nothing holds the pool it fails with the shortfall, and the old
    region is still Ready and reused as it was (its record is not marked Failed)."""
    old = PoolRequest(name="grow", capacity=32 * MiB, medium="Memory", min_segment=16 * MiB)
    provision(old, region_root)
    pool_dir = region_root / old.name
    engine = hold(processes, pool_dir)

    grown = PoolRequest(name="grow", capacity=64 << 40, medium="Memory", min_segment=16 * MiB, generation=2)
    with pytest.raises(LeaseHeld, match="held by 1 attached engine"):
        provision(grown, region_root)
    state = pool_state(region_root, old.name)
    assert state.phase == "Ready" and state.total_bytes == 32 * MiB

    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=30)
    wait_for(
        "the kernel to drop the flock", lambda: count_holders(lease_path(pool_dir)) == 0, 10, interval=0.01
    )
    with pytest.raises(RegionError, match="short by"):
        provision(grown, region_root)
    state = pool_state(region_root, old.name)
    assert state.phase == "Ready" and state.total_bytes == 32 * MiB
    assert provision(old, region_root).reused
    release(region_root, old.name)


#: As a consumer's uid: take the shared lease the way an engine does, then try to write the lease
#: file; print what happened.
CONSUMER = r"""
import json, os, sys
from offloadpool.region.holding.lease import Lease, lease_path
pool_dir, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
lease = Lease.shared(pool_dir, blocking=False)
try:
    fd = os.open(lease_path(pool_dir), os.O_WRONLY)
except PermissionError:
    wrote = False
else:
    os.write(fd, b"x" * 4096)
    wrote = True
print(json.dumps({"leased": lease.fd >= 0, "wrote": wrote}))
"""


def test_a_consumer_takes_the_lease_but_cannot_write_it_to_the_hosts_disk(hugepage_baseline):
    """The pool directory lives on the host's file system: a lease the consumers owned was a
    file there they could fill without limit. It is root's, 0644, and emptied at every
    provision (an older release's consumer-owned lease is taken back); an engine of any uid
    still takes its shared flock read-only."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="offloadpool-lease-"))  # not pytest's 0700 tree
    os.chmod(base, 0o711)
    region_root = base / "root"
    region_root.mkdir(mode=0o755)
    try:
        _consumer_cannot_write_the_lease(region_root)
    finally:
        release(region_root, "leased", force=True)
        shutil.rmtree(base)


def _consumer_cannot_write_the_lease(region_root: Path) -> None:
    req = PoolRequest(name="leased", capacity=8 * MiB, medium="Memory", uid=1003, gid=1003, mode=0o600)
    provision(req, region_root)
    lease = lease_path(region_root / req.name)
    st = os.stat(lease, follow_symlinks=False)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777, st.st_size) == (0, 0, 0o644, 0)

    # as an older release left it: the consumers' own, with bytes a consumer wrote
    os.chown(lease, 1003, 1003)
    os.chmod(lease, 0o600)
    lease.write_bytes(b"y" * 65536)
    provision(req, region_root)  # the same shape: reused, the lease taken back
    st = os.stat(lease, follow_symlinks=False)
    assert (st.st_uid, st.st_mode & 0o7777, st.st_size) == (0, 0o644, 0)

    import json
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", CONSUMER, str(region_root / req.name), "1003"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"leased": True, "wrote": False}
    assert os.stat(lease).st_size == 0
