"""Creating and checking the files of a pool: segment files, the lease file, the compat links.

hugetlbfs files cannot be written with write(2); they are sized with ftruncate (which
allocates nothing) and filled later by the pre-fault through a mapping. Growing a file with
ftruncate keeps what it holds, so re-running this on a half-built pool is safe.
"""

from __future__ import annotations

import os
from pathlib import Path

from offloadpool.region import vllm_compat
from offloadpool.region.errors import RegionError, fmt_bytes
from offloadpool.region.lease import lease_path
from offloadpool.region.manifest import MOUNT_NAME
from offloadpool.region.planner import Plan
from offloadpool.region.request import PoolRequest


def compat_name(engine_id: str) -> str:
    """Where stock vLLM looks for an existing region, relative to the pool directory."""
    return f"{MOUNT_NAME}/{vllm_compat.region_file(engine_id)}"


def compat_names(engine_id: str, count: int) -> list[str]:
    """Every file of a ``count``-file region under vLLM's names, relative to the pool directory."""
    return [f"{MOUNT_NAME}/{name}" for name in vllm_compat.file_names(engine_id, count)]


def own(path: Path, req: PoolRequest) -> None:
    os.chown(path, req.uid, req.gid)
    os.chmod(path, req.mode)


def create_segments(pool_dir: Path, plan: Plan, req: PoolRequest) -> None:
    """Make every planned segment file exist with its planned size and the pool's ownership."""
    for seg in plan.segments:
        path = pool_dir / seg.file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, req.mode)
        try:
            size = os.fstat(fd).st_size
            if size > seg.bytes:
                raise RegionError(
                    f"segment {path} holds {fmt_bytes(size)}, more than the planned "
                    f"{fmt_bytes(seg.bytes)}; release the pool and provision again"
                )
            if size < seg.bytes:
                os.ftruncate(fd, seg.bytes)
        finally:
            os.close(fd)
        own(path, req)


def ensure_lease_file(pool_dir: Path, req: PoolRequest) -> None:
    """Engines running as the consumers' uid must be able to open the lease to flock it."""
    path = lease_path(pool_dir)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, req.mode))
    own(path, req)


def sync_compat(pool_dir: Path, plan: Plan, req: PoolRequest) -> str | None:
    """Hard-link segment i as vLLM's file i (``vllm_offload_<id>.mmap``, ``.mmap.1`` …), drop
    stale links, and return the name of file 0 (the manifest's ``compat_file``).

    Hard links, not copies or symlinks: the same memory under vLLM's names, visible through a
    hostPath file mount, and the segment names the pinning helper maps stay as they are."""
    wanted = compat_names(req.compat_engine_id, len(plan.segments)) if req.compat_engine_id else []
    for stale in (pool_dir / MOUNT_NAME).glob("vllm_offload_*.mmap*"):
        if stale.relative_to(pool_dir).as_posix() not in wanted:
            stale.unlink()
    for name, seg in zip(wanted, plan.segments, strict=False):  # no names without compat
        target = pool_dir / name
        if target.exists() and os.stat(target).st_ino != os.stat(pool_dir / seg.file).st_ino:
            target.unlink()  # a link to another shape's segment
        if not target.exists():
            os.link(pool_dir / seg.file, target)
    return wanted[0] if wanted else None


def check_segments(pool_dir: Path, plan: Plan) -> str | None:
    """None if every planned segment exists with its planned size, else what is wrong."""
    for seg in plan.segments:
        try:
            size = os.stat(pool_dir / seg.file).st_size
        except FileNotFoundError:
            return f"segment {seg.file} is missing"
        if size != seg.bytes:
            return f"segment {seg.file} is {size} bytes, planned {seg.bytes}"
    planned = {Path(s.file).name for s in plan.segments}
    extra = [
        p.name
        for p in (pool_dir / MOUNT_NAME).iterdir()
        if p.name not in planned and not p.name.startswith("vllm_offload_")
    ]
    if extra:
        return f"unexpected files in the pool mount: {sorted(extra)}"
    return None
