"""Across processes: a killed engine releases its lease; pinning is all-or-nothing under a real
RLIMIT_MEMLOCK failure; registration of a file is serialised by its lock; background pinning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest

from fixtures.pinning_pools import MiB, PoolFactory, run_python, traces_of, vm_locked_bytes
from offloadpool.pinning import PinCancelled, PinStats, attach
from offloadpool.region.files.manifest import load
from offloadpool.region.holding.lease import Lease, LeaseHeld, count_holders, lease_path
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory.media import is_hugetlbfs

HOLDER = """
import sys, time
from offloadpool.pinning import attach
region = attach(sys.argv[1])
region.pin("mlock")
print("READY", flush=True)
time.sleep(600)
"""


def start_child(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"child did not get ready: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc


def test_killed_holder_releases_its_lease(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    child = start_child(HOLDER, str(pool))
    try:
        assert count_holders(lease_path(pool)) == 1
        assert vm_locked_bytes(child.pid) == 64 * MiB
        with pytest.raises(LeaseHeld):
            Lease.exclusive(pool)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert count_holders(lease_path(pool)) == 0
    with Lease.exclusive(pool):
        pass
    # And the node can really take the memory back: nothing maps the mount any more.
    assert release(pool.parent, pool.name).existed


def test_second_process_attaches_while_first_holds(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=64 * MiB)
    child = start_child(HOLDER, str(pool))
    try:
        with attach(pool) as att:
            att.pin("mlock")
            assert count_holders(lease_path(pool)) == 2
    finally:
        child.kill()
        child.wait()
    assert count_holders(lease_path(pool)) == 0


ROLLBACK = """
import json, os, resource, sys
from offloadpool.pinning import BackendError, PinError, attach
from offloadpool.pinning.backends.mlock import MlockBackend, has_cap_ipc_lock, locked_bytes
limit = int(sys.argv[2])
_soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, hard))  # lowering needs no privilege
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # an unprivileged engine: RLIMIT_MEMLOCK applies, no CAP_IPC_LOCK
out = {"cap_ipc_lock": has_cap_ipc_lock()}
with attach(sys.argv[1]) as region:
    try:
        # 2 MiB calls; let the kernel itself refuse part-way
        region.pin(MlockBackend(check_limit=False), max_chunk=2 << 20)
        out["partial"] = "pinned?!"
    except PinError as exc:
        out["partial"] = str(exc)
        out["partial_offset"] = exc.offset
    out["locked_after_partial"] = locked_bytes()
    out["pinned_after_partial"] = region.pinned
    try:
        region.pin("mlock")  # default: checks the limit before touching memory
        out["preflight"] = "pinned?!"
    except BackendError as exc:
        out["preflight"] = str(exc)
    out["locked_after_preflight"] = locked_bytes()
print(json.dumps(out))
"""


def test_partial_failure_rolls_back_every_lock(make_pool: PoolFactory) -> None:
    """An unprivileged engine with a 5 MiB memlock limit pinning in 2 MiB calls: the third call
    fails in the kernel; the two locked before it are unlocked again (VmLck back to 0)."""
    pool = make_pool("kv", capacity=64 * MiB, mode=0o666)
    assert [s.bytes for s in load(pool).regions[0].segments] == [16 * MiB] * 4
    out = json.loads(run_python(ROLLBACK, str(pool), str(5 * MiB)).stdout)
    assert out["cap_ipc_lock"] is False
    assert out["partial_offset"] == 4 * MiB
    assert "chunk offset 4194304 (0x400000), length 2097152 bytes, in segment mnt/r0-s000" in out["partial"]
    assert "Cannot allocate memory" in out["partial"] or "Resource temporarily" in out["partial"]
    assert "rolled back 2 registered ranges in reverse" in out["partial"]
    assert out["locked_after_partial"] == 0
    assert out["pinned_after_partial"] is False
    assert "RLIMIT_MEMLOCK" in out["preflight"]
    assert out["locked_after_preflight"] == 0
    assert count_holders(lease_path(pool)) == 0


LOCKER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("READY", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_registration_waits_for_the_file_lock(
    make_pool: PoolFactory, medium: str, locked: Callable[[], int]
) -> None:
    """Another process registering segment 0 (holding its lock: an flock on the segment file
    itself, which works on tmpfs and hugetlbfs alike) holds up our registration of that file;
    nothing is locked until the other lets go."""
    pool = make_pool("kv", capacity=64 * MiB, medium=medium)
    counted = 0 if is_hugetlbfs(medium) else 64 * MiB
    first = load(pool).regions[0].segments[0].file
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(pool / first)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "READY"
        with attach(pool, rank=0) as att:
            future = att.pin("mlock", background=True)
            time.sleep(1.0)
            assert not future.done(), "registration did not wait for the segment's lock"
            assert locked() == 0
            assert locker.stdin is not None
            locker.stdin.write("\n")
            locker.stdin.flush()
            stats = future.result(timeout=60)
            assert isinstance(stats, PinStats) and stats.bytes_registered == 64 * MiB
            assert locked() == counted
        assert locked() == 0
    finally:
        locker.kill()
        locker.wait()


def test_background_pin_returns_a_future(make_pool: PoolFactory, locked: Callable[[], int]) -> None:
    pool = make_pool("kv", capacity=128 * MiB)
    with attach(pool) as att:
        future = att.pin("mlock", background=True)
        stats = future.result(timeout=60)
        assert stats.bytes_registered == 128 * MiB and att.pinned and att.pin_stats == stats
        assert locked() == 128 * MiB
    assert locked() == 0 and traces_of(pool) == []


def test_close_during_background_pin_leaves_nothing_locked(
    make_pool: PoolFactory, locked: Callable[[], int]
) -> None:
    pool = make_pool("kv", capacity=256 * MiB)
    att = attach(pool)
    future = att.pin("mlock", background=True, max_chunk=1 * MiB)  # 256 calls: room to cancel
    att.close()
    assert future.done()
    exc = future.exception()
    assert exc is None or isinstance(exc, PinCancelled)
    assert locked() == 0 and traces_of(pool) == []
    assert count_holders(lease_path(pool)) == 0
