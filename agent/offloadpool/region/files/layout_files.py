"""Creating and checking the files of a pool: segment files, the lease file, the compat links.

hugetlbfs files cannot be written with write(2); they are sized with ftruncate (which
allocates nothing) and filled later by the pre-fault through a mapping. Growing a file with
ftruncate keeps what it holds, so re-running this on a half-built pool is safe.

Every name here is in the pool directory, which pods may write: each is opened beneath the
pool directory's descriptor without following links (``beneath``), refused when it is not a
regular file with the links it should have (``places.UnsafeEntry``), and owned and moded
through the open descriptor. A segment has one link, or two when stock vLLM's name for it is a
hard link of it (``sync_compat``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from offloadpool.region.errors import RegionError, fmt_bytes
from offloadpool.region.files import beneath, places, vllm_compat
from offloadpool.region.files.handle import Pool, PoolHandle, given
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME, MOUNT_NAME, ManifestError
from offloadpool.region.files.planner import Plan
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest


def compat_name(engine_id: str) -> str:
    """Where stock vLLM looks for an existing region, relative to the pool directory."""
    return f"{MOUNT_NAME}/{vllm_compat.region_file(engine_id)}"


def compat_names(engine_id: str, count: int) -> list[str]:
    """Every file of a ``count``-file region under vLLM's names, relative to the pool directory."""
    return [f"{MOUNT_NAME}/{name}" for name in vllm_compat.file_names(engine_id, count)]


def segment_links(req: PoolRequest) -> int:
    """How many hard links a segment file may have: its own name, and vLLM's when compat."""
    return 2 if req.compat_engine_id else 1


@contextmanager
def opened(
    pool: PoolHandle, rel: str, flags: int = os.O_RDONLY, mode: int = 0o600, links: int = 1
) -> Iterator[int]:
    """``rel`` in the pool directory, opened through ``beneath`` (UnsafeEntry if of the wrong kind)."""
    try:
        fd = beneath.open_file(pool.fd, rel, flags, mode, links=links)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    try:
        yield fd
    finally:
        os.close(fd)


def own(fd: int, req: PoolRequest) -> None:
    """The consumers' ownership and mode, set on the open file (never by name)."""
    os.fchown(fd, req.uid, req.gid)
    os.fchmod(fd, req.mode)


def secure_mount_dir(pool: PoolHandle) -> None:
    """The pool's mount root owned by root, 0755 (as mounted): a consumer that is not root can
    create no name in it; a pod that changed that is undone at every provision."""
    try:
        fd = beneath.open_dir(pool.fd, MOUNT_NAME)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


def create_segments(pool: PoolHandle, plan: Plan, req: PoolRequest) -> None:
    """Make every planned segment file exist with its planned size and the pool's ownership."""
    for seg in plan.segments:
        with opened(pool, seg.file, os.O_RDWR | os.O_CREAT, 0o600, segment_links(req)) as fd:
            size = os.fstat(fd).st_size
            if size > seg.bytes:
                raise RegionError(
                    f"segment {pool.rel(seg.file)} holds {fmt_bytes(size)}, more than the planned "
                    f"{fmt_bytes(seg.bytes)}; release the pool and provision again"
                )
            if size < seg.bytes:
                os.ftruncate(fd, seg.bytes)
            own(fd, req)


def own_segments(pool: PoolHandle, plan: Plan, req: PoolRequest) -> None:
    """Apply the pool's ownership and mode to every segment file (a consumers change)."""
    for seg in plan.segments:
        with opened(pool, seg.file, links=segment_links(req)) as fd:
            own(fd, req)


#: the pool lease's mode: every engine, whatever its uid and gid, can open it read-only, which
#: is all an flock needs; nobody but root can write it
LEASE_MODE = 0o644


def ensure_lease_file(pool: PoolHandle) -> None:
    """The lease: root's, 0644, empty. Engines (and the lease sidecar) open it read-only to
    flock it, so no consumer needs to write it, and a file on the host's disk that a consumer
    could write would be one it could fill without limit (the pool directory is on the host's
    file system, not the pool's bounded mount). A lease an older release made the consumers'
    is taken back at the next provision; an engine holding it keeps its open file and lock."""
    with opened(pool, LEASE_NAME, os.O_RDWR | os.O_CREAT, 0o600) as fd:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, LEASE_MODE)
        os.ftruncate(fd, 0)


def _compat_drift(pfd: int, wanted: list[str], plan: Plan) -> list[tuple[str, str]]:
    """Each of vLLM's names (``wanted``, one per segment) that is not a hard link of its segment,
    with what it is instead: the one rule ``sync_compat`` repairs by and ``handed_out_problem``
    reports by. Nothing is followed (``lstat`` of the name itself)."""
    drift = []
    for name, seg in zip(wanted, plan.segments, strict=False):  # no names without compat
        here = beneath.lstat(pfd, name)
        segment = beneath.lstat(pfd, seg.file)
        if segment is None:
            raise RegionError(f"segment {seg.file} is missing")
        if here is None:
            drift.append((name, "missing"))
        elif (here.st_dev, here.st_ino) != (segment.st_dev, segment.st_ino):
            drift.append((name, f"{beneath.kind(here.st_mode)}, not a link of segment {seg.file}"))
    return drift


def _wanted_compat(plan: Plan, req: PoolRequest) -> list[str]:
    return compat_names(req.compat_engine_id, len(plan.segments)) if req.compat_engine_id else []


def sync_compat(pool: PoolHandle, plan: Plan, req: PoolRequest) -> str | None:
    """Hard-link segment i as vLLM's file i (``vllm_offload_<id>.mmap``, ``.mmap.1`` …), drop
    stale links, and return the name of file 0 (the manifest's ``compat_file``).

    Hard links, not copies or symlinks: the same memory under vLLM's names, given to pods as
    ``subPath`` mounts of the pool directory, and the segment names the pinning helper maps
    stay as they are. A name that is not a link of its segment (another shape's, or anything a
    pod put there: a symlink, a file of its own) is removed as a name (``unlinkat``) and made
    again."""
    wanted = _wanted_compat(plan, req)
    pfd = pool.fd
    try:
        for name in beneath.listdir(pfd, MOUNT_NAME):
            rel = f"{MOUNT_NAME}/{name}"
            if name.startswith("vllm_offload_") and ".mmap" in name and rel not in wanted:
                left = places.remove_entry(pfd, rel)
                if left is not None:
                    raise RegionError(f"{pool.rel(rel)}: {left}")
        segments = {name: seg for name, seg in zip(wanted, plan.segments, strict=False)}
        for name, what in _compat_drift(pfd, wanted, plan):
            if what != "missing":
                left = places.remove_entry(pfd, name)  # another shape's segment, or a pod's
                if left is not None:
                    raise RegionError(f"{pool.rel(name)}: {left}")
            beneath.link(pfd, segments[name].file, name)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    return wanted[0] if wanted else None


def check_entries(pool: PoolHandle, plan: Plan, req: PoolRequest) -> str | None:
    """None if the pool directory holds what a Ready pool of ``plan`` holds, else what is wrong.

    Raises UnsafeEntry for a name of the wrong kind (a link, a fifo, a device, a directory
    where a file belongs, a file with other links): that is never followed, and the caller
    rebuilds the pool when nothing holds it, or fails it. vLLM's names are not checked here:
    whatever a pod made of one, ``sync_compat`` removes it as a name and links it again."""
    links = segment_links(req)
    pfd = pool.fd
    try:
        for rel in (LEASE_NAME, MANIFEST_NAME):
            fd = beneath.open_file(pfd, rel)
            os.close(fd)
        beneath.listdir(pfd, MOUNT_NAME)  # a directory, reached without a link
        for seg in plan.segments:
            try:
                fd = beneath.open_file(pfd, seg.file, links=links)
            except FileNotFoundError:
                return f"segment {seg.file} is missing"
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size != seg.bytes:
                return f"segment {seg.file} is {size} bytes, planned {seg.bytes}"
        planned = {Path(s.file).name for s in plan.segments}
        extra = [
            name
            for name in beneath.listdir(pfd, MOUNT_NAME)
            if name not in planned and not name.startswith("vllm_offload_")
        ]
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    except FileNotFoundError as exc:
        return f"{exc.filename or 'an entry'} is missing"
    if extra:
        return f"unexpected files in the pool mount: {sorted(extra)}"
    return None


def handed_out_problem(pool: Pool, plan: Plan, req: PoolRequest) -> str | None:
    """What a pod changed of what a Ready pool hands out, in one line; None when nothing.

    The check a provision makes before it keeps a pool (``check_entries``: every name of the
    right kind, no segment replaced or re-linked) and the rule ``sync_compat`` repairs vLLM's
    names by, without repairing anything: the agent runs it at every heartbeat of a Ready pool
    and provisions again when it finds something, which repairs vLLM's names in place and
    rebuilds (or fails, naming the entry) a pool whose segments were touched. A pod that
    replaced a name with a link is then never handed it: the kubelet resolves a compat file as
    a subPath beneath the pool directory (refusing a link out of it) at each container start,
    and by the next heartbeat the name is the segment's again.

    Raises ``places.UnsafeEntry`` for a name of the wrong kind, as ``check_entries`` does."""
    with given(pool) as handle:
        problem = check_entries(handle, plan, req)
        if problem is not None:
            return problem
        try:
            drift = _compat_drift(handle.fd, _wanted_compat(plan, req), plan)
        except beneath.WrongEntry as exc:
            raise places.UnsafeEntry(handle.path, exc) from None
        if drift:
            return "; ".join(f"{handle.rel(name)} is {what}" for name, what in drift)
        return None


def check_ready(pool: PoolHandle, plan: Plan, req: PoolRequest) -> str | None:
    """None if the Ready pool on disk matches ``plan``; otherwise why not.

    Raises ``places.UnsafeEntry`` for a name of the wrong kind in the pool directory."""
    m = mounts.mount_at(pool.rel(MOUNT_NAME))
    if m is None or m.fstype != plan.medium.fstype:
        return "its mount is gone (node rebooted or unmounted by hand)"
    size = mount_bytes(pool)
    if size != plan.total_bytes:
        return f"its mount holds {size} bytes, planned {plan.total_bytes}"
    problem = check_entries(pool, plan, req)  # before the manifest is read
    if problem is not None:
        return problem
    try:
        manifest = pool.read_manifest()
    except ManifestError as exc:
        return str(exc)
    if manifest.pool != req.name or manifest.regions != plan.regions or manifest.page_size != plan.page_size:
        return "its manifest describes other segments"
    return None


def mount_bytes(pool: PoolHandle) -> int | None:
    """The size of the pool's mount as its file system states it (tmpfs ``size=``, hugetlbfs
    ``size=``): what the node mounted, which no pod can change."""
    pfd = pool.fd
    try:
        fd = beneath.open_dir(pfd, MOUNT_NAME)
    except (OSError, beneath.WrongEntry):
        return None
    try:
        st = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return st.f_blocks * st.f_frsize
