"""Release: give a pool's memory back to the node, only when no process holds it.

Two proofs that nothing is attached, both needed: the exclusive lease (engines using the
pinning helper hold it shared for as long as they live) and a scan of ``/proc`` for processes
that map or have open the pool's files (stock vLLM takes no lease, and a pod's bind mount in
its own mount namespace does not make the host's unmount fail). See ``holders``.

``force`` exists for operators who need the memory back regardless; it skips both proofs and
detaches the mount lazily, so every holder (lease or not, any namespace) keeps working on memory
that is no longer accounted to any pool until it exits, and its next start finds no pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from offloadpool.region.errors import RegionError
from offloadpool.region.files import places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import SET_ASIDE, PoolHandle, open_pool
from offloadpool.region.holding.holders import Holder, describe, exclusive_unused, find_holders
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.teardown import teardown

FORCE_CONSEQUENCES = (
    "forced release: {n} attached engine(s) keep mapping memory that no pool accounts for; it is "
    "freed only when they exit, a new pool may over-commit the node meanwhile, and their next "
    "start finds no pool ({holders})"
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

    Raises LeaseHeld (PoolInUse, naming the processes, when it can see them) if any process
    holds the lease or maps or has open the pool's files, and ``force`` is false. Releasing a
    pool that does not exist is not an error (``existed=False``): release is idempotent.
    A ``name`` that cannot name a pool (``..``, ``x/../..``, ``/``, ``.state``, ...) raises
    RequestError before any path is made of it. Names the node did not make are left and
    listed in ``warnings``; nothing is removed recursively.
    """
    pool_dir = places.pool_dir(root, name)  # a name that is no pool name makes no path
    with open_pool(pool_dir) as pool:
        if not pool.exists():
            return ReleaseResult(name, existed=False)
        with pool.lock():
            return _release(pool, name, force=force)


def _release(pool: PoolHandle, name: str, *, force: bool) -> ReleaseResult:
    """``release`` of the pool ``pool``, whose lock the caller holds."""
    if not pool.exists():
        return ReleaseResult(name, existed=False)
    rec = records.load(pool)
    total = int(rec.request.get("capacity", 0)) if rec else 0
    lease = None
    holders: list[Holder] = []
    left: list[str] = []
    try:
        if pool.has_dir():
            lease = exclusive_unused(pool)
    except LeaseHeld:
        if not force:
            raise
        holders = find_holders(pool)
    try:
        try:
            given = teardown(pool, lazy=force, left=left)
        except RegionError as exc:
            if force:
                raise
            raise RegionError(f"releasing {name}: {exc}") from exc
    finally:
        if lease is not None:
            lease.close()
    warnings = [FORCE_CONSEQUENCES.format(n=len(holders), holders=describe(holders))] if holders else []
    warnings += [line if line.startswith(SET_ASIDE) else f"left in place: {line}" for line in left]
    return ReleaseResult(name, True, total, given, force, len(holders), tuple(warnings))
