"""Processes that hold a pool without the lease, in their own mount namespace (as a pod sees a
hostPath, and as stock vLLM maps it), block release and reshaping, are named, and are counted
as attached engines; once they exit, release proceeds and leaves nothing.

Each holder runs under ``unshare --mount --propagation private``: it bind-mounts a pool file at
a path that exists only in its namespace (on the host that path stays an empty file), so the
host's unmount would not fail with EBUSY — only the /proc scan can see it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fixtures.host import cli, private_mounts_python
from offloadpool.region.files import places
from offloadpool.region.files.manifest import MANIFEST_NAME
from offloadpool.region.files.planner import plan
from offloadpool.region.holding import holders, published
from offloadpool.region.holding.holders import PoolInUse, find_holders
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
PATTERN = b"held-in-a-pod:0123456789"

# argv: pool file, private path, "map" | "open", lease dir or "-", the pattern a mapper writes
HOLDER = r"""
import ctypes, os, subprocess, sys
src, private, how, lease_dir, pattern = sys.argv[1:6]
subprocess.run(["mount", "--bind", src, private], check=True)  # visible in this namespace only
fd = os.open(private, os.O_RDWR)
if lease_dir != "-":
    from offloadpool.region.holding.lease import Lease
    lease = Lease.shared(lease_dir)
if how == "map":
    # MAP_SHARED through libc, then close the fd: a mapping and nothing else (Python's mmap
    # would keep a dup of the fd), no lock taken - stock vLLM's way
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    c_int = ctypes.c_int
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, c_int, c_int, c_int, ctypes.c_long]
    addr = libc.mmap(None, os.fstat(fd).st_size, 0x3, 0x01, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    os.close(fd)
    ctypes.memmove(addr, pattern.encode(), len(pattern.encode()))
print("ready", os.getpid(), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def start_holder(
    processes, tmp_path: Path, src: Path, how: str, lease_dir: Path | None = None
) -> subprocess.Popen:
    """A holder in a private mount namespace; returns once it maps (or opens) the file."""
    private = tmp_path / f"pod-{len(list(tmp_path.glob('pod-*')))}" / "vllm_offload_pod.mmap"
    private.parent.mkdir()
    private.touch()  # the bind mount's target; on the host it stays this empty file
    proc = processes(
        private_mounts_python(
            HOLDER, str(src), str(private), how, str(lease_dir) if lease_dir else "-", PATTERN.decode()
        ),
        stdin=subprocess.PIPE,
    )
    line = proc.stdout.readline().split()
    assert line == ["ready", str(proc.pid)], (
        f"holder did not start: {line} {proc.stderr.read() if proc.poll() is not None else ''}"
    )
    st = os.stat(private)
    assert st.st_size == 0 and (st.st_dev, st.st_ino) != (os.stat(src).st_dev, os.stat(src).st_ino), (
        "the holder's bind mount leaked into the host's mount namespace"
    )
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


def first_file(req: PoolRequest, root: Path) -> Path:
    return root / req.name / plan(req).segments[0].file


def read_back(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(len(PATTERN))


def assert_intact(root: Path, req: PoolRequest) -> None:
    pool_dir = root / req.name
    state = pool_state(root, req.name)
    assert state.phase == "Ready" and state.total_bytes == req.capacity and state.medium == req.medium
    assert (pool_dir / MANIFEST_NAME).exists()
    assert mounts.mount_at(pool_dir / "mnt") is not None
    assert first_file(req, root).stat().st_size > 0
    assert read_back(first_file(req, root)) == PATTERN


def test_release_refuses_a_lockless_holder_in_another_mount_namespace(region_root, processes, tmp_path):
    req = PoolRequest(name="podheld", capacity=64 * MiB, medium="Memory", compat_engine_id="pod1")
    provision(req, region_root)
    pool_dir = region_root / req.name
    compat = pool_dir / "mnt" / "vllm_offload_pod1.mmap"  # what stock vLLM maps
    engine = start_holder(processes, tmp_path, compat, "map")

    with pytest.raises(
        PoolInUse,
        match=rf"held by 1 attached engine: pid {engine.pid} \(python[^)]*\) "
        r"maps the pool's memory",
    ) as exc:
        release(region_root, req.name)
    assert isinstance(exc.value, LeaseHeld)
    assert [(h.pid, h.mapped, h.open, h.lease) for h in exc.value.holders] == [
        (engine.pid, True, False, False)
    ]
    assert_intact(region_root, req)

    out = cli("release", req.name, "--root", str(region_root), check=False)
    assert out.returncode == 3, out.stdout + out.stderr
    said = " ".join(out.stderr.split())  # the console wraps long lines
    assert "in use" in said and f"pid {engine.pid} (python" in said
    assert "freed" not in out.stdout
    assert_intact(region_root, req)
    assert sorted(p.name for p in (pool_dir / "mnt").iterdir()) == ["r0-s000", "vllm_offload_pod1.mmap"]

    stop(engine)
    result = release(region_root, req.name)
    assert result.existed and not result.forced and result.warnings == ()
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []


def test_reshape_refuses_while_mapped_and_keeps_the_pool_and_its_data(region_root, processes, tmp_path):
    old = PoolRequest(name="reshape", capacity=64 * MiB, medium="MemoryTHP")
    provision(old, region_root)
    pool_dir = region_root / old.name
    engine = start_holder(processes, tmp_path, first_file(old, region_root), "map")

    new = PoolRequest(name="reshape", capacity=128 * MiB, medium="MemoryTHP")
    with pytest.raises(LeaseHeld, match=rf"pid {engine.pid} \(python"):
        provision(new, region_root)
    assert_intact(region_root, old)
    assert len(mounts.mounts_under(region_root)) == 1  # no second pool next to the held one

    out = cli(
        "provision",
        "--root",
        str(region_root),
        "--name",
        "reshape",
        "--capacity",
        "128Mi",
        "--medium",
        "MemoryTHP",
        check=False,
    )
    assert out.returncode == 3 and f"pid {engine.pid} (python" in " ".join(out.stderr.split()), out.stderr
    assert_intact(region_root, old)
    assert len(mounts.mounts_under(region_root)) == 1

    stop(engine)
    result = provision(new, region_root)
    assert result.rebuilt and not result.reused
    state = pool_state(region_root, new.name)
    assert state.phase == "Ready" and state.total_bytes == 128 * MiB
    assert release(region_root, new.name).existed
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []


def test_engines_attached_counts_each_holding_process_once(region_root, processes, tmp_path):
    req = PoolRequest(name="counted", capacity=64 * MiB, medium="Memory")
    provision(req, region_root)
    pool_dir = region_root / req.name
    seg = first_file(req, region_root)
    assert pool_state(region_root, req.name).engines_attached == 0

    both = start_holder(processes, tmp_path, seg, "map", lease_dir=pool_dir)  # maps and holds the lease
    assert pool_state(region_root, req.name).engines_attached == 1
    assert [(h.pid, h.mapped, h.open, h.lease) for h in find_holders(pool_dir)] == [
        (both.pid, True, False, True)
    ]

    opener = start_holder(processes, tmp_path, seg, "open")  # an open fd, no mapping, no lease
    assert pool_state(region_root, req.name).engines_attached == 2
    holders = {h.pid: h for h in find_holders(pool_dir)}
    assert set(holders) == {both.pid, opener.pid}
    assert (holders[opener.pid].open, holders[opener.pid].mapped, holders[opener.pid].lease) == (
        True,
        False,
        False,
    )
    assert holders[both.pid].comm.startswith("python")

    with pytest.raises(LeaseHeld, match="held by 2 attached engines") as exc:
        release(region_root, req.name)
    assert {h.pid for h in exc.value.holders} == {both.pid, opener.pid}
    assert_intact(region_root, req)

    stop(both)
    assert pool_state(region_root, req.name).engines_attached == 1
    with pytest.raises(LeaseHeld, match=rf"pid {opener.pid} \(python[^)]*\) has a pool file open"):
        release(region_root, req.name)
    assert_intact(region_root, req)

    stop(opener)
    assert pool_state(region_root, req.name).engines_attached == 0
    assert release(region_root, req.name).existed
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []


def test_force_release_names_the_lockless_holder_it_breaks(region_root, processes, tmp_path):
    req = PoolRequest(name="forced", capacity=64 * MiB, medium="Memory")
    provision(req, region_root)
    pool_dir = region_root / req.name
    engine = start_holder(processes, tmp_path, first_file(req, region_root), "map")

    result = release(region_root, req.name, force=True)
    assert result.forced and result.engines_broken == 1
    assert f"pid {engine.pid} (python" in result.warnings[0]
    assert "keep mapping memory that no pool accounts for" in result.warnings[0]
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []
    stop(engine)


def test_csi_published_records_name_the_pod_and_older_records_still_count(tmp_path: Path) -> None:
    """A published volume names its pod by namespace, name and uid in every wait message; a
    record written without the pod's name (before it was kept) is still that holder, and one
    with an unknown field is a holder that cannot be read, never nothing."""
    pool_dir = places.pool_dir(tmp_path, "kv")
    uid = "0f8e1c2a-1111-4222-8333-444455556666"
    published.save(pool_dir, published.Published("csi-new", uid, "team-a", "/t/new", "engine-0"))
    state = tmp_path / places.STATE_DIR_NAME / "kv" / published.DIR_NAME
    old = {"volume_id": "csi-old", "pod_uid": uid, "pod_namespace": "team-b", "target_path": "/t/old"}
    (state / "csi-old.json").write_text(json.dumps(old))
    (state / "csi-odd.json").write_text(json.dumps({**old, "volume_id": "csi-odd", "extra": "x"}))
    found = {p.volume_id: p for p in holders.csi_holders(pool_dir)}
    assert found["csi-new"].describe() == f"csi volume csi-new of pod team-a/engine-0 (uid {uid})"
    assert found["csi-old"] == published.Published("csi-old", uid, "team-b", "/t/old")
    assert found["csi-old"].describe() == f"csi volume csi-old of pod team-b/{uid}"
    assert found["csi-odd"].pod_uid == published.UNREADABLE
    said = str(holders.PoolInUse(pool_dir, [], list(found.values())))
    assert "held by 3 attached engines" in said and "team-a/engine-0" in said, said
