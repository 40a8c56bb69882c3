"""Release: give a pool's memory back to the node, only when no engine holds it.

The exclusive lease is the proof that no engine is attached (engines hold it shared for as long
as they live). ``force`` exists for operators who need the memory back regardless; it detaches
the mount lazily, so attached engines keep working on memory that is no longer accounted to any
pool until they exit, and their next start finds no pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from offloadpool.region.errors import RegionError
from offloadpool.region.lease import Lease, LeaseHeld, count_holders, lease_path
from offloadpool.region.provision import pool_lock
from offloadpool.region import record as records
from offloadpool.region.teardown import teardown

FORCE_CONSEQUENCES = (
    "forced release: {n} attached engine(s) keep mapping memory that no pool accounts for; it is "
    "freed only when they exit, a new pool may over-commit the node meanwhile, and their next "
    "start finds no pool"
)


@dataclass(frozen=True)
class ReleaseResult:
    name: str
    existed: bool
    freed_bytes: int = 0
    hugepages_returned: int = 0
    forced: bool = False
    engines_broken: int = 0
    warnings: tuple[str, ...] = field(default_factory=tuple)


def release(root: str | os.PathLike[str], name: str, *, force: bool = False) -> ReleaseResult:
    """Unmount, delete and return reserved huge pages of pool ``name`` under ``root``.

    Raises LeaseHeld if an engine holds the lease and ``force`` is false. Releasing a pool that
    does not exist is not an error (``existed=False``): release is idempotent.
    """
    pool_dir = Path(root) / name
    if not pool_dir.is_dir():
        return ReleaseResult(name, existed=False)
    with pool_lock(pool_dir):
        if not pool_dir.is_dir():
            return ReleaseResult(name, existed=False)
        rec = records.load(pool_dir)
        total = int(rec.request.get("capacity", 0)) if rec else 0
        lease = None
        holders = 0
        try:
            lease = Lease.exclusive(pool_dir)
        except LeaseHeld:
            if not force:
                raise
            holders = count_holders(lease_path(pool_dir))
        try:
            try:
                given = teardown(pool_dir, lazy=force)
            except RegionError as exc:
                if force:
                    raise
                raise RegionError(f"releasing {name}: {exc}") from exc
        finally:
            if lease is not None:
                lease.close()
        warnings = (FORCE_CONSEQUENCES.format(n=holders),) if force and holders else ()
        return ReleaseResult(name, True, total, given, force, holders, warnings)
