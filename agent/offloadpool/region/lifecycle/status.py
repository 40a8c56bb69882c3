"""What a pool looks like on this node right now, read from disk and the kernel.

Used by the CLI's ``status`` and by the agent for its OffloadPoolNode status; it never changes
anything, so it can run while a provision is populating (progress comes from the journal).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import PoolHandle, open_pool
from offloadpool.region.files.journal import populated_bytes, units
from offloadpool.region.files.manifest import MANIFEST_NAME, MOUNT_NAME, Manifest, ManifestError
from offloadpool.region.files.names import pool_name_error
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import holders, shares
from offloadpool.region.memory import mounts
from offloadpool.region.vocabulary import (
    ABSENT,
    FAILED,
    ORPHANED,
    POPULATING,
    PROVISIONING,
    READY,
    SCRUBBING,
    STATE_PHASES,
)


@dataclass(frozen=True)
class PoolState:
    name: str
    phase: str
    total_bytes: int = 0
    populated_bytes: int = 0
    medium: str = ""
    hugepage_coverage_percent: float = 0.0
    numa_nodes: tuple[tuple[int, ...], ...] = ()
    engines_attached: int = 0
    manifest: Manifest | None = None
    message: str = ""
    populate_gib_per_s: float = 0.0
    in_progress: bool = False  # a provision is working on it right now
    #: a partitioned pool's shares, each claimed or free and by whom (empty: no shares)
    shares: tuple[shares.ShareState, ...] = ()

    @property
    def progress(self) -> float:
        return self.populated_bytes / self.total_bytes if self.total_bytes else 0.0

    @property
    def shares_claimed(self) -> str:
        """ "claimed/total" of a partitioned pool's shares; "" for a pool without shares."""
        return shares.claimed_of(list(self.shares)) if self.shares else ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shares"] = [
            {
                "index": s.index,
                "claimed": s.claimed,
                "via": s.via,
                "holder": s.holder,
                "engines": len(s.holders),
            }
            for s in self.shares
        ]
        d["manifest"] = self.manifest.to_dict() if self.manifest else None
        d["progress"] = round(self.progress, 4)
        return d


def pool_state(root: str | os.PathLike[str], name: str) -> PoolState:
    """The pool ``name`` under ``root``, from its record (RequestError for a name that cannot
    name a pool: no path is made of it)."""
    with open_pool(places.pool_dir(root, name)) as pool:
        return state_of(pool)


def state_of(pool: PoolHandle) -> PoolState:
    """``pool_state`` of a pool an operation holds open (its lock too, maybe: then it reads as
    in progress, as it is)."""
    name = pool.name
    rec = records.load(pool)
    if rec is None:
        if pool.has_dir() and _has_any(pool, MANIFEST_NAME, places.OLD_RECORD_NAME):
            return PoolState(
                name,
                FAILED,
                message="pool has no provisioning record of this node's (an older offloadpool's, or lost); "
                "provision again to adopt or rebuild it",
            )
        return PoolState(name, ABSENT)
    try:
        req = rec.pool_request()
        plan = make_plan(req)
    except (RegionError, TypeError, ValueError) as exc:
        return PoolState(name, FAILED, message=f"unreadable provisioning record: {exc}")
    busy = pool.busy()
    # every process holding the lease or mapping/opening the files, leased or not, once each
    engines = holders.count(pool)
    # what every phase reports; each return below fills in its phase and progress
    common = PoolState(
        name,
        rec.phase,
        total_bytes=plan.total_bytes,
        medium=req.medium,
        hugepage_coverage_percent=rec.hugepage_coverage_percent,
        numa_nodes=tuple(tuple(n) for n in rec.numa_nodes),
        engines_attached=engines,
        populate_gib_per_s=float(rec.populate.get("gib_per_s", 0.0)),
        in_progress=busy,
        shares=_shares(pool, req.partitions),
    )
    if rec.scrub_pending:  # withheld from engines until its memory is zero (region.lifecycle.scrub)
        waits = "" if busy else "; waits for its holders to leave (provision again once they have)"
        message = rec.scrub_pending + waits
        return replace(common, phase=SCRUBBING, populated_bytes=plan.total_bytes, message=message)
    if rec.phase == READY:
        message = ""
        manifest = None
        try:
            manifest = pool.read_manifest()
        except ManifestError as exc:
            message = str(exc)
        m = mounts.mount_at(pool.rel(MOUNT_NAME))
        if m is None:
            message = "the pool's mount is gone; provision again to rebuild it"
        if message:
            return replace(common, phase=FAILED, populated_bytes=0, manifest=manifest, message=message)
        if rec.orphaned:  # Ready memory that no OffloadPool accounts for
            message = (
                f"{rec.orphaned}: no OffloadPool owns it; a pool of this name and shape adopts it, "
                f"`offloadpool release {name}` frees it"
            )
            return replace(
                common, phase=ORPHANED, populated_bytes=plan.total_bytes, manifest=manifest, message=message
            )
        return replace(common, phase=READY, populated_bytes=plan.total_bytes, manifest=manifest)
    done = populated_bytes(pool, units(plan.segments, plan.page_size))
    phase = rec.phase if rec.phase in STATE_PHASES else PROVISIONING  # Draining shows as in progress
    message = rec.message
    if phase in (PROVISIONING, POPULATING) and not busy:
        message = message or "interrupted: provision again to finish (populated parts are kept)"
    return replace(common, phase=phase, populated_bytes=done, message=message)


def _shares(pool: PoolHandle, partitions: int) -> tuple[shares.ShareState, ...]:
    if partitions < 2:
        return ()
    try:
        return tuple(shares.states(pool, partitions))
    except (OSError, places.UnsafeEntry):
        return ()


def local_region(root: str | os.PathLike[str], name: str) -> tuple[int, int] | None:
    """(generation, total bytes) of the complete region on this node, from the node's own
    record (never the manifest, which a pod can write); None when there is none."""
    rec = records.load(places.pool_dir(root, name))
    if rec is None or rec.phase != READY:
        return None
    try:
        req = rec.pool_request()
        return req.generation, make_plan(req).total_bytes
    except (RegionError, TypeError, ValueError):
        return None


def _has_any(pool: PoolHandle, *names: str) -> bool:
    try:
        return any(beneath.lstat(pool.fd, n) is not None for n in names)
    except (OSError, places.UnsafeEntry):
        return False


def list_pools(root: str | os.PathLike[str]) -> list[PoolState]:
    """Every pool under ``root`` (a state directory, or a pool directory holding a manifest or
    an older offloadpool's record), by name; names that cannot name a pool are not looked at."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = {p.name for p in root.iterdir() if p.is_dir() and not p.is_symlink()}
    state = root / places.STATE_DIR_NAME
    if state.is_dir() and not state.is_symlink():
        found |= {p.name for p in state.iterdir()}
    out = []
    for name in sorted(n for n in found if pool_name_error(n) is None):
        with open_pool(root / name) as pool:  # looked at and read back through one opening
            if records.load(pool) is not None or _has_any(pool, MANIFEST_NAME, places.OLD_RECORD_NAME):
                out.append(state_of(pool))
    return out
