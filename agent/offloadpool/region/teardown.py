"""Taking a pool apart: the one path used by release and by a rebuild after a spec change.

Order matters: the manifest goes first (no new engine attaches to a pool being removed), then
the mount (which frees every page of every file at once; if some process still has a file open
or mapped the unmount fails with EBUSY and the manifest is put back: nothing changed), then the
huge pages this node added to the kernel pool (announced in the huge page intent first, so a kill
cannot give them back twice), then the directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from offloadpool.region import hugepage_intent, hugepages, mounts
from offloadpool.region import record as records
from offloadpool.region.errors import RegionError
from offloadpool.region.manifest import LEASE_NAME, MANIFEST_NAME, MOUNT_NAME, ManifestError
from offloadpool.region.manifest import load as load_manifest


def teardown(pool_dir: Path, *, lazy: bool = False, keep_dir: bool = False) -> int:
    """Remove everything of the pool at ``pool_dir``; return the huge pages given back.

    ``lazy`` detaches a busy mount (MNT_DETACH): processes that still map it keep their
    memory until they exit, and the kernel frees it then. ``keep_dir`` empties the directory
    but keeps it and its lease file (a rebuild holds both while it works).
    """
    rec = records.load(pool_dir)
    try:
        manifest = load_manifest(pool_dir)
    except ManifestError:
        manifest = None
    (pool_dir / MANIFEST_NAME).unlink(missing_ok=True)
    mnt = pool_dir / MOUNT_NAME
    if mounts.mount_at(mnt) is not None:
        try:
            mounts.umount(mnt, lazy=lazy)  # frees every page of every file in it
        except RegionError:
            if manifest is not None:  # still intact: put it back as it was
                manifest.write(pool_dir)
            raise
    if rec is not None:
        rec.phase = "Draining"
        rec.mounted = False
        records.save(pool_dir, rec)
    given = 0
    root = pool_dir.parent
    owes = rec is not None and rec.hugepages_added > 0 and rec.hugepage_size > 0
    if owes or hugepage_intent.pending(root):
        # Taking the lock settles a grow or give-back a killed process left (hugepage_intent).
        with hugepages.pool_lock(root):
            if rec is not None and owes:
                given = _give_back_hugepages(pool_dir, rec)
    if keep_dir:
        for entry in pool_dir.iterdir():
            if entry.name == LEASE_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    else:
        shutil.rmtree(pool_dir)
    return given


def _give_back_hugepages(pool_dir: Path, rec: records.Record) -> int:
    """Give back the huge pages ``rec`` says this node added; return how many.

    The caller holds :func:`hugepages.pool_lock`. The intent comes first, then the record
    saying none are held, then ``nr_hugepages``: a kill anywhere leaves the next lock holder
    able to finish the give-back exactly once (``hugepage_intent``). After a reboot the kernel
    pool was reset: nothing is given back, the record just forgets them.
    """
    pages, size = rec.hugepages_added, rec.hugepage_size
    same_boot = rec.boot_id == records.boot_id()
    if same_boot:
        total = hugepages.counters(size).total
        intent = hugepage_intent.Intent("shrink", pool_dir.name, size, pages, total, pages, rec.boot_id)
        hugepage_intent.write(pool_dir.parent, intent)
    rec.hugepages_added = 0
    records.save(pool_dir, rec)
    if not same_boot:
        return 0
    hugepages.shrink(size, pages)
    hugepage_intent.clear(pool_dir.parent)
    return pages
