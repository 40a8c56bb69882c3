"""Adopting a pool that an older offloadpool provisioned, whose record is in the pool directory.

Older releases kept the provisioning record (``state.json``) and the populate journal in
``<root>/<pool>/``, where every pod given the pool can write. Such a record is never trusted as
it stands: a forged ``hugepages_added`` would make release shrink the node's huge page pool, a
forged request would make the node act on memory it never made. On upgrade it is read once, as
hostile input, and adopted only when everything it claims is checked against what the kernel
shows:

* it parses strictly (``record.parse``: types, a known phase, a request that validates, for
  this very pool name) and says ``Ready``;
* the pool's mount is there, of the medium's file system, holding exactly the planned bytes
  (``statvfs``: what the node mounted, no pod can change it), every planned segment is a plain
  file of its planned size, no name is of the wrong kind, and the manifest agrees
  (``layout_files.check_ready``).

An adopted pool keeps its memory (engines attached through the upgrade keep working). What cannot
be checked is not carried over: the huge pages it says the node added are taken as none (a
release then leaves them in the kernel's free pool, rather than shrink a reservation a pod could
have forged), and the populate journal is not read (only Ready pools are adopted). Anything else
(an interrupted build, a record that does not re-validate) leaves the pool unknown: it is taken
apart and rebuilt when nothing holds it (``provision``). The old names are removed either way.
"""

from __future__ import annotations

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, layout_files, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.vocabulary import READY


def adopt(pool: PoolHandle) -> records.Record | None:
    """The pool's record, re-validated from the old place and saved in the new one; None when
    there is no old record or it does not hold up. Takes the pool's lock."""
    with pool.lock():
        rec = records.load(pool)
        if rec is not None:  # adopted meanwhile by another provision
            return rec
        pfd = pool.fd
        try:
            data = beneath.read_file(pfd, places.OLD_RECORD_NAME)
        except OSError:  # none, or a link, a fifo, ...: never followed
            data = b""
        old = records.parse(data) if data else None
        adopted = _revalidated(pool, old) if old is not None else None
        if adopted is not None:
            records.save(pool, adopted)
        for name in (places.OLD_RECORD_NAME, places.OLD_JOURNAL_NAME):
            places.remove_entry(pfd, name)
        return adopted


def _revalidated(pool: PoolHandle, old: records.Record) -> records.Record | None:
    if old.phase != READY:
        return None
    try:
        req = old.pool_request()
        plan = make_plan(req)
        if req.name != pool.name or layout_files.check_ready(pool, plan, req) is not None:
            return None
    except (RegionError, TypeError, ValueError):
        return None
    rec = records.Record.new(req)
    rec.phase = READY
    rec.mounted = True
    rec.boot_id = records.boot_id()
    rec.hugepage_size = plan.page_size if plan.medium.hugetlb else 0
    rec.hugepages_added = 0  # not checkable: never given back rather than possibly forged
    if _numa_nodes(old.numa_nodes, len(plan.regions)):
        rec.numa_nodes = old.numa_nodes
    coverage = old.hugepage_coverage_percent
    rec.hugepage_coverage_percent = float(coverage) if 0 <= coverage <= 100 else 0.0
    return rec


def _numa_nodes(value: object, regions: int) -> bool:
    """Whether ``value`` is a list of node lists, one per region (as ``numa.describe`` gives)."""
    return (
        isinstance(value, list)
        and len(value) == regions
        and all(
            isinstance(nodes, list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nodes)
            for nodes in value
        )
    )
