"""Taking a pool apart: the one path used by release and by a rebuild after a spec change.

Order matters: the manifest goes first (no new engine attaches to a pool being removed), then
the mount (which frees every page of every file at once; if some process still has a file open
or mapped the unmount fails with EBUSY and the manifests are put back byte for byte: nothing
changed), then the
huge pages this node added to the kernel pool (announced in the huge page intent first, so a kill
cannot give them back twice), then the names the node made.

Only those names are removed, one by one, each as a name (``unlinkat``/``rmdir``, never through
a link): the manifest (the shares' with it), the shares' directories (``region.holding.shares``), the
lease, the plan's segment and compat names, ``mnt``, the names an
older offloadpool kept in the pool directory, then the record, the journal, the shares'
reservation mutex and the state directory. Nothing is removed recursively: whatever else is
found (a pod's files, a directory where a file belongs) is left and reported, and the
directory holding it stays.

Teardown parses nothing a pod can write: how many shares the pool has comes from the node's
record (root-only); the manifests are kept as bytes to be put back, never read as JSON.
"""

from __future__ import annotations

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.journal import JOURNAL_NAME
from offloadpool.region.files.layout_files import compat_names
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME, MOUNT_NAME
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import shares
from offloadpool.region.memory import hugepage_intent, hugepages, mounts
from offloadpool.region.vocabulary import DRAINING


def teardown(
    pool: PoolHandle, *, lazy: bool = False, keep_dir: bool = False, left: list[str] | None = None
) -> int:
    """Remove everything of the pool ``pool``; return the huge pages given back.

    ``lazy`` detaches a busy mount (MNT_DETACH): processes that still map it keep their
    memory until they exit, and the kernel frees it then. ``keep_dir`` empties the directory
    but keeps it, its lease file and the state directory (a rebuild holds them while it works);
    ``mnt`` goes either way, when it is empty or not a directory.
    What could not be removed is appended to ``left``, one line each.
    """
    rec = records.load(pool)
    count = _shares_of(rec)
    manifests = [MANIFEST_NAME, *(f"{shares.share_rel(i)}/{MANIFEST_NAME}" for i in range(count))]
    pfd = _pool_fd(pool)
    kept = _keep(pfd, manifests) if pfd is not None else {}
    if pfd is not None:
        _remove(pfd, MANIFEST_NAME, left)
    if count > 1:
        shares.withdraw(pool, count)
    mnt = pool.rel(MOUNT_NAME)
    if mounts.mount_at(mnt) is not None:
        try:
            mounts.umount(mnt, lazy=lazy)  # frees every page of every file in it
        except RegionError:
            _put_back(pool, kept)  # still intact: as it was, byte for byte
            raise
    if rec is not None:
        rec.phase = DRAINING
        rec.mounted = False
        records.save(pool, rec)
    given = 0
    root = pool.root
    owes = rec is not None and rec.hugepages_added > 0 and rec.hugepage_size > 0
    if owes or hugepage_intent.pending(root):
        # Taking the lock settles a grow or give-back a killed process left (hugepage_intent).
        with hugepages.reservation_lock(root):
            if rec is not None and owes:
                given = _give_back_hugepages(pool, rec)
    _remove_made(pool, rec, keep_dir=keep_dir, left=left)
    return given


def _shares_of(rec: records.Record | None) -> int:
    """The shares the node's record says the pool has (1 without a record or a plan)."""
    if rec is None:
        return 1
    try:
        return max(1, rec.pool_request().partitions)
    except (RegionError, TypeError, ValueError):
        return 1


def _keep(pfd: int, names: list[str]) -> dict[str, bytes]:
    """The bytes of each manifest among ``names``, as they are (never parsed: a pod can write
    them, and teardown must not depend on what they hold); one that is not a plain file within
    ``beneath.MAX_READ`` bytes is not kept (the next provision writes it again)."""
    kept = {}
    for rel in names:
        try:
            kept[rel] = beneath.read_file(pfd, rel)
        except OSError:  # none, a link, a fifo, too long (beneath.WrongEntry), ...
            continue
    return kept


def _put_back(pool: PoolHandle, kept: dict[str, bytes]) -> None:
    """Write back the manifests ``_keep`` read, after an unmount that failed (nothing changed)."""
    pfd = _pool_fd(pool)
    if pfd is None:
        return
    for rel, data in kept.items():
        try:
            beneath.write_file(pfd, rel, data)
        except OSError:  # its directory went meanwhile: the next provision writes it
            continue


def _give_back_hugepages(pool: PoolHandle, rec: records.Record) -> int:
    """Give back the huge pages ``rec`` says this node added; return how many.

    The caller holds :func:`hugepages.reservation_lock`. The intent comes first, then the record
    saying none are held, then ``nr_hugepages``: a kill anywhere leaves the next lock holder
    able to finish the give-back exactly once (``hugepage_intent``). After a reboot the kernel
    pool was reset: nothing is given back, the record just forgets them.
    """
    pages, size = rec.hugepages_added, rec.hugepage_size
    same_boot = rec.boot_id == records.boot_id()
    if same_boot:
        total = hugepages.counters(size).total
        intent = hugepage_intent.Intent("shrink", pool.name, size, pages, total, pages, rec.boot_id)
        hugepage_intent.write(pool.root, intent)
    rec.hugepages_added = 0
    records.save(pool, rec)
    if not same_boot:
        return 0
    hugepages.shrink(size, pages)
    hugepage_intent.clear(pool.root)
    return pages


def made_names(rec: records.Record | None) -> list[str]:
    """The names in the pool directory the node made for the pool ``rec`` records, files first."""
    names: list[str] = []
    if rec is not None:
        try:
            req = rec.pool_request()
            plan = make_plan(req)
            names += [seg.file for seg in plan.segments]
            if req.compat_engine_id:
                names += compat_names(req.compat_engine_id, len(plan.segments))
        except (RegionError, TypeError, ValueError):
            pass  # a record of no plan: only the fixed names below
    return names


def _remove_made(
    pool: PoolHandle, rec: records.Record | None, *, keep_dir: bool, left: list[str] | None
) -> None:
    shares.remove(pool, left if left is not None else [])  # a rebuild makes them again
    pfd = _pool_fd(pool)
    if pfd is not None:
        if mounts.mount_at(pool.rel(MOUNT_NAME)) is None:  # else a lazy unmount left it busy
            for rel in made_names(rec):
                _remove(pfd, rel, left)
            _remove(pfd, MOUNT_NAME, left)  # a rebuild makes it again (a link a pod put there too)
        for name in (places.OLD_RECORD_NAME, places.OLD_JOURNAL_NAME, *_temp_names(pfd)):
            _remove(pfd, name, left)
        if not keep_dir:
            _remove(pfd, LEASE_NAME, left)
    sfd = pool.state()
    if sfd is not None:
        for name in (JOURNAL_NAME, records.RECORD_NAME, shares.MUTEX_NAME, *_temp_names(sfd)):
            _remove(sfd, name, left)
    if keep_dir:
        return
    pool.remove_dirs(left)


def _pool_fd(pool: PoolHandle) -> int | None:
    """The pool directory's descriptor, None when there is none (a state directory alone)."""
    try:
        return pool.fd
    except FileNotFoundError:
        return None


def _temp_names(dirfd: int) -> list[str]:
    """Temp files of atomic writes a killed process left (``.<name>.<random>.tmp``), and those an
    older offloadpool named ``.state.*.tmp`` and ``.manifest.*.tmp``."""
    return [n for n in beneath.listdir(dirfd) if n.startswith(".") and n.endswith(".tmp")]


def _remove(dirfd: int, rel: str, left: list[str] | None) -> None:
    """Remove the name ``rel`` (a link as a link); what cannot be removed goes to ``left``."""
    try:
        why = places.remove_entry(dirfd, rel)
    except FileNotFoundError:
        return  # a directory on the way is gone: so is the name
    except beneath.WrongEntry as exc:
        why = str(exc)
    if why is not None and left is not None:
        left.append(why)
