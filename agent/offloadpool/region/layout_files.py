"""Creating and checking the files of a pool: segment files, the lease file, the compat link.

hugetlbfs files cannot be written with write(2); they are sized with ftruncate (which
allocates nothing) and filled later by the pre-fault through a mapping. Growing a file with
ftruncate keeps what it holds, so re-running this on a half-built pool is safe.
"""

from __future__ import annotations

import os
from pathlib import Path

from offloadpool.region.errors import RegionError, fmt_bytes
from offloadpool.region.lease import lease_path
from offloadpool.region.manifest import MOUNT_NAME
from offloadpool.region.planner import Plan
from offloadpool.region.request import PoolRequest


def compat_name(engine_id: str) -> str:
    """Where stock vLLM looks for an existing region, relative to the pool directory."""
    return f"{MOUNT_NAME}/vllm_offload_{engine_id}.mmap"


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
    """Hard-link the single segment as ``vllm_offload_<id>.mmap`` (and drop stale links)."""
    wanted = compat_name(req.compat_engine_id) if req.compat_engine_id else None
    for stale in (pool_dir / MOUNT_NAME).glob("vllm_offload_*.mmap"):
        if wanted is None or stale != pool_dir / wanted:
            stale.unlink()
    if wanted is None:
        return None
    target = pool_dir / wanted
    if not target.exists():
        os.link(pool_dir / plan.segments[0].file, target)
    return wanted


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
    extra = [p.name for p in (pool_dir / MOUNT_NAME).iterdir()
             if p.name not in planned and not p.name.startswith("vllm_offload_")]
    if extra:
        return f"unexpected files in the pool mount: {sorted(extra)}"
    return None
