"""Provision: make a pool's memory exist on this node, populated, and keep it.

One call does whichever of these the pool needs, judged from what is on disk:

* **Ready with the same shape** → validate mount, files and manifest; apply ownership, mode,
  compat link and generation in place; return ``reused=True`` without touching the memory.
  A provision killed after writing the manifest and before recording Ready left a complete pool
  (engines may already use it): it is finished the same way, without the exclusive lease.
* **Absent** → capacity check (before anything is created), reserve huge pages, mount, create
  files, pre-fault, write the manifest last.
* **Interrupted** (same shape, not Ready: a provision was killed) → finish what is missing;
  the journal says which parts are populated and the pre-fault never rewrites present pages.
* **Different shape** → only if nothing holds the pool (the exclusive lease can be taken and no
  process, in any mount namespace, maps or has open its files; see ``holders``): tear down and
  rebuild; otherwise raise LeaseHeld (PoolInUse naming the holders), the change stays pending
  and the memory is untouched. Finishing an interrupted build needs the same. The holders are
  looked at before the capacity check (and the cgroup limits it reads): a growth the node or
  the agent's pod could not fit yet waits for its holder like any change (LeaseHeld), and fails
  with the shortfall only once nothing holds the pool; that refusal leaves the record as it was.

A fresh build that fails (capacity, mount) is torn down, so nothing half-built is left; an
interrupted one (signal, kill) is left for the next run to finish.

What the node trusts (the record, the journal) is in the pool's root-only state directory;
everything in the pool directory is a pod's to write (``places``). A name there of the wrong
kind (a link, a fifo, a device, a file with other links: ``places.UnsafeEntry``) is never
followed: the pool is torn down and rebuilt when nothing holds it, else the provision fails
(Failed, naming the entry and why) and the memory is left as it is. A record an older
offloadpool left in the pool directory is adopted only after re-validation (``migrate``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.errors import CapacityError, RegionError, fmt_bytes
from offloadpool.region.files import beneath, layout_files, migrate, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import PoolHandle, open_pool
from offloadpool.region.files.journal import populated_bytes, units
from offloadpool.region.files.manifest import LEASE_NAME, MOUNT_NAME, Manifest, ManifestError
from offloadpool.region.files.planner import Plan
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import shares
from offloadpool.region.holding.holders import exclusive_unused
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle import scrub, share_scrub
from offloadpool.region.lifecycle.teardown import teardown
from offloadpool.region.memory import capacity, hugepage_intent, hugepages, mounts, numa
from offloadpool.region.memory.populate import DEFAULT_CHUNK, Progress, populate
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import DRAINING, FAILED, POPULATING, PROVISIONING, READY

PhaseCallback = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class ProvisionResult:
    """What one ``provision`` call left on the node and what it cost (the CLI's summary, the
    agent's status and metrics). Built by keyword only: most fields are numbers of one kind."""

    #: the pool's directory (what engines attach: ``<root>/<pool>``)
    pool_dir: Path
    #: the manifest as written for engines (the region's shape, segments, files)
    manifest: Manifest
    #: bytes this call pre-faulted (0 when it reused the region)
    populated_bytes: int
    #: wall time of this call, seconds
    seconds: float
    #: this call's populate rate (0 when it reused the region)
    gib_per_s: float
    #: the region was there already, validated and kept (nothing populated)
    reused: bool
    #: bytes already populated by an interrupted earlier run (the whole region when reused)
    skipped_bytes: int = 0
    #: populate workers used (0 when nothing was populated)
    workers: int = 0
    #: huge pages this call added to the kernel's pool (``nr_hugepages``)
    hugepages_added: int = 0
    #: share of the region backed by huge pages, percent
    hugepage_coverage_percent: float = 0.0
    #: an older, different-shaped region was torn down first
    rebuilt: bool = False


def _drop_interrupted_writes(pool: PoolHandle) -> None:
    """Remove the temp files of record/manifest writes that a killed process left behind.

    Both are written atomically (temp file, rename); SIGKILL between the two leaves the temp
    file (``.<name>.<random>.tmp``), which nothing else would ever remove while the pool lives.
    The caller holds the pool lock, as every writer of these files does, except a failed
    provision's last record write (made after it let go of the lock): a provision starting at
    that very moment may remove that write's temp file, and the failing run then reports that
    instead of its own error. Names are removed as names, never followed.
    """
    for fd in (pool.fd, pool.state()):
        if fd is None:
            continue
        for name in beneath.listdir(fd):
            if name.startswith(".") and name.endswith(".tmp"):
                places.remove_entry(fd, name)


def mount_options(plan: Plan, req: PoolRequest) -> str:
    total = plan.total_bytes
    if plan.medium.hugetlb:
        # min_size reserves every page at mount time: the pool can never SIGBUS for lack of pages.
        return f"pagesize={plan.page_size},size={total},min_size={total},mode=0755"
    return f"size={total},huge={plan.medium.huge},mode=0755"


def _manifest(req: PoolRequest, plan: Plan, compat: str | None, rec: records.Record) -> Manifest:
    return Manifest(
        pool=req.name,
        generation=req.generation,
        medium=plan.medium.name,
        page_size=plan.page_size,
        layout=plan.layout,
        regions=plan.regions,
        total_bytes=plan.total_bytes,
        alignment=plan.page_size,
        shares=plan.shares,
        uid=req.uid,
        gid=req.gid,
        mode=req.mode,
        compat_file=compat,
        extra={
            "fingerprint": req.fingerprint(),
            "numa_nodes": rec.numa_nodes,  # per region: where the engine's check expects its pages
            "numa_policy": req.numa,
            "hugepage_coverage_percent": rec.hugepage_coverage_percent,
        },
    )


def _reserve_hugepages(plan: Plan, pool: PoolHandle, rec: records.Record) -> int:
    """Grow the kernel pool so a min_size mount of this plan succeeds; return pages added.

    The caller holds :func:`hugepages.reservation_lock`. Before ``nr_hugepages`` is written, the
    intent to grow is (``hugepage_intent``); it stays until the caller has recorded the pages in
    ``rec`` (then clears it), so a kill in between leaves the pages to be given back, not lost.
    """
    page = plan.page_size
    pages = plan.total_bytes // page
    c = hugepages.counters(page)
    missing = max(0, pages - c.available)
    if missing:
        intent = hugepage_intent.Intent(
            "grow", pool.name, page, missing, c.total, rec.hugepages_added, rec.boot_id
        )
        hugepage_intent.write(pool.root, intent)
    try:
        added = hugepages.grow(page, missing)
    except hugepages.PoolFixed as exc:
        hugepages.reconcile(pool.root)  # gives back what a first attempt added, if any
        raise CapacityError(
            f"{plan.medium.name} pool needs {pages} huge pages of {fmt_bytes(page)}; "
            f"{c.available} are free and unreserved and the huge page pool is fixed here ({exc.strerror}): "
            f"short by {missing} pages ({fmt_bytes(missing * page)}); reserve them on the node "
            f"(at boot, or by writing nr_hugepages on the host)"
        ) from None
    if added < missing:
        hugepages.reconcile(pool.root)  # nothing recorded the short grant: it is given back
        raise CapacityError(
            f"{plan.medium.name} pool needs {pages} huge pages of {fmt_bytes(page)}; "
            f"{c.available} were free and unreserved and the kernel could add only {added} "
            f"of the {missing} missing: short by {missing - added} pages "
            f"({fmt_bytes((missing - added) * page)}); "
            + hugepages.shortfall_reason(page, missing - added, capacity.meminfo().get("MemAvailable", 0))
        )
    return added


def provision(
    req: PoolRequest,
    root: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    workers: int | None = None,
    rate_limit: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK,
    on_phase: PhaseCallback | None = None,
) -> ProvisionResult:
    """Make pool ``req`` Ready under ``root`` (see the module docstring for what that takes)."""
    t0 = time.perf_counter()
    plan = make_plan(req)  # validates the request: bad input fails before anything is touched
    policy = numa.parse_policy(req.numa)
    numa_nodes = numa.describe(policy, len(plan.regions))  # offline nodes fail here
    pool_dir = places.pool_dir(root, req.name)  # plan() checked the name; the path says so too
    call = _Call(req, plan, numa_nodes, on_phase or (lambda phase: None), t0)
    with open_pool(pool_dir) as pool:  # the one resolution of the pool by name
        return _provision(pool, call, _PrefaultOptions(progress, workers, rate_limit, chunk_bytes))


def _provision(pool: PoolHandle, call: _Call, opts: _PrefaultOptions) -> ProvisionResult:
    """``provision`` of the pool ``pool``, opened once for this call."""
    req, plan, say, t0 = call.req, call.plan, call.say, call.t0
    rec = records.load(pool)
    if rec is None and pool.has_dir():
        rec = migrate.adopt(pool)  # an older offloadpool's pool, only if it re-validates
    # A pool directory without the node's record was handed out under a right nobody records
    # (a release that could not remove it, an older offloadpool's): never built in again.
    unknown_dir = rec is None and pool.has_dir()
    unsafe: places.UnsafeEntry | None = None
    if rec is not None and rec.fingerprint == req.fingerprint() and rec.phase in (READY, POPULATING):
        with pool.lock():
            try:
                reused = _reuse(pool, plan, req, t0, opts.progress, say)
            except places.UnsafeEntry as exc:
                reused, unsafe = None, exc
        if reused is not None:
            say(READY)
            return reused
    elif pool.has_dir():
        unsafe = _unsafe_entry(pool, rec, plan, req)

    credit = old_pages = 0
    if rec is not None and mounts.mount_at(pool.rel(MOUNT_NAME)) is not None:
        # Memory this pool already holds (a shape being replaced, or an interrupted build
        # being finished) is about to be freed or reused: count it as available.
        old = rec.pool_request()
        credit = old.capacity
        if old.medium == req.medium and plan.medium.hugetlb:
            old_pages = old.capacity // plan.page_size
    fresh = not pool.exists()
    if fresh:
        capacity.check(plan, credit_bytes=credit, credit_pages=old_pages)  # before anything is created
    pool.make_dirs()
    try:
        with pool.lock():
            # never build, tear down or populate under an engine, leased or not
            try:
                lease = exclusive_unused(pool)
            except LeaseHeld as held:
                if unsafe is None:
                    raise
                raise RegionError(f"{unsafe}; the pool is held, so it is not rebuilt: {held}") from None
            try:
                if not fresh:
                    # A pool that is there is checked only once nothing holds it: a change that
                    # waits for an engine (LeaseHeld) must not fail the node on a limit it would
                    # need only once the engine has let go; the old region is left as it is.
                    try:
                        capacity.check(plan, credit_bytes=credit, credit_pages=old_pages)
                    except CapacityError as short:
                        raise _Untouched(short) from short
                return _build(pool, call, opts, rebuild=unsafe is not None, unknown_dir=unknown_dir)
            finally:
                lease.close()
    except _Untouched as untouched:
        raise untouched.error from None  # nothing was touched: the record stays as it was
    except (RegionError, OSError) as exc:
        if fresh and pool.exists():
            teardown(pool)  # nothing half-built is left behind
        elif pool.exists():
            failed = records.load(pool)
            if failed is not None:
                failed.phase, failed.message = FAILED, str(exc)
                records.save(pool, failed)
        raise


class _Untouched(Exception):
    """A check before the build refused (``error``): nothing on the node was changed."""

    def __init__(self, error: CapacityError) -> None:
        super().__init__(str(error))
        self.error = error


def _unsafe_entry(
    pool: PoolHandle, rec: records.Record | None, plan: Plan, req: PoolRequest
) -> places.UnsafeEntry | None:
    """A name of the wrong kind in a pool that is not Ready (or of another shape): the shape
    the record names is checked, else the requested one. None when there is none."""
    if rec is not None:
        try:
            req = rec.pool_request()
            plan = make_plan(req)
        except (RegionError, TypeError, ValueError):
            pass
    try:
        layout_files.check_entries(pool, plan, req)
    except places.UnsafeEntry as exc:
        return exc
    except OSError:
        return None
    return None


def _finished_but_unrecorded(pool: PoolHandle, plan: Plan, rec: records.Record) -> bool:
    """A provision killed after writing the manifest, before recording Ready.

    The manifest is written only after the last page is populated, so the memory is complete
    and engines may already be attached; finishing is only the record, which needs neither
    the exclusive lease nor a pre-fault (the journal must agree, as a second proof).
    """
    if rec.phase != POPULATING:
        return False
    try:
        pool.read_manifest()
    except ManifestError:
        return False
    return populated_bytes(pool, units(plan.segments, plan.page_size)) == plan.total_bytes


def _reuse(
    pool: PoolHandle,
    plan: Plan,
    req: PoolRequest,
    t0: float,
    progress: Progress | None = None,
    say: PhaseCallback = lambda phase: None,
    lease_held: bool = False,  # the caller holds the exclusive lease (``_build``)
) -> ProvisionResult | None:
    """Keep a Ready pool of this shape, applying ownership, mode, compat names and generation;
    None when it does not validate. Raises ``places.UnsafeEntry`` for a name of the wrong kind."""
    _drop_interrupted_writes(pool)
    rec = records.load(pool)
    if rec is None or not (rec.phase == READY or _finished_but_unrecorded(pool, plan, rec)):
        return None
    # A name of the wrong kind raises UnsafeEntry here, before the scrub touches anything; a
    # pool an earlier scrub withheld (no manifest) is checked again once the scrub is done.
    problem = layout_files.check_ready(pool, plan, req)
    if problem is not None and not rec.scrub_pending:
        return None
    scrub.before_reuse(
        pool,
        plan,
        req,
        rec,
        restore_manifest=lambda: pool.write_manifest(_manifest(req, plan, None, rec)),
        progress=progress,
        say=say,
        lease_held=lease_held,
    )
    if problem is not None and layout_files.check_ready(pool, plan, req) is not None:
        return None
    if rec.phase != READY:
        coverage = pool.read_manifest().extra.get("hugepage_coverage_percent")
        if isinstance(coverage, (int, float)) and not isinstance(coverage, bool) and 0 <= coverage <= 100:
            rec.hugepage_coverage_percent = float(coverage)
        rec.phase = READY
    pool.make_dirs()  # root's, 0755, whatever a pod did to them
    layout_files.secure_mount_dir(pool)
    layout_files.own_segments(pool, plan, req)
    layout_files.ensure_lease_file(pool)
    compat = layout_files.sync_compat(pool, plan, req)
    manifest = pool.read_manifest()
    wanted = _manifest(req, plan, compat, rec)
    shares.write(pool, wanted, req.uid, req.gid, req.mode)
    if manifest != wanted:
        pool.write_manifest(wanted)
        manifest = wanted
    rec.request = records.Record.new(req).request
    rec.orphaned = ""  # a pool of this name owns it again
    rec.deleting = ""
    share_scrub.settle(pool, plan, req, rec)  # a share's zeroing a plugin left: done or withheld
    records.save(pool, rec)
    return ProvisionResult(
        pool_dir=pool.path,
        manifest=manifest,
        populated_bytes=0,
        seconds=time.perf_counter() - t0,
        gib_per_s=0.0,
        reused=True,
        skipped_bytes=plan.total_bytes,
        hugepage_coverage_percent=rec.hugepage_coverage_percent,
    )


def _holds_something(pool: PoolHandle) -> bool:
    """Whether the pool directory holds more than a lease (or nothing): a mount, a manifest, a
    ``mnt``, the names an older offloadpool kept there."""
    if mounts.mount_at(pool.rel(MOUNT_NAME)) is not None:
        return True
    return any(name != LEASE_NAME for name in beneath.listdir(pool.fd))


@dataclass(frozen=True)
class _Call:
    """One provision call: the pool it serves, its plan, and how it reports."""

    req: PoolRequest
    plan: Plan
    numa_nodes: list[list[int]]  # per region, as numa.describe gives them
    say: PhaseCallback
    t0: float  # time.perf_counter() when the call began


@dataclass(frozen=True)
class _PrefaultOptions:
    """How the caller wants the pre-fault run (``provision``'s keyword arguments)."""

    progress: Progress | None
    workers: int | None
    rate_limit: float | None
    chunk_bytes: int


def _build(
    pool: PoolHandle,
    call: _Call,
    opts: _PrefaultOptions,
    *,
    rebuild: bool = False,
    unknown_dir: bool = False,
) -> ProvisionResult:
    """Build, finish or rebuild the pool; the caller holds the pool's lock and exclusive lease.

    A name of the wrong kind found while finishing (``places.UnsafeEntry``) makes it start
    over once from a torn-down pool: nothing holds it (the caller made sure). ``unknown_dir``:
    the pool directory was there without the node's record; it is replaced by a new one."""
    try:
        return _build_once(pool, call, opts, rebuild=rebuild, unknown_dir=unknown_dir)
    except places.UnsafeEntry:
        if rebuild:
            raise
        return _build_once(pool, call, opts, rebuild=True)


def _build_once(
    pool: PoolHandle, call: _Call, opts: _PrefaultOptions, *, rebuild: bool, unknown_dir: bool = False
) -> ProvisionResult:
    req, plan, say, t0 = call.req, call.plan, call.say, call.t0
    _drop_interrupted_writes(pool)
    rec = records.load(pool)
    rebuilt = False
    if not rebuild and rec is not None and rec.fingerprint == req.fingerprint() and rec.phase == READY:
        if layout_files.check_ready(pool, plan, req) is None:  # another provisioner finished meanwhile
            reused = _reuse(pool, plan, req, t0, opts.progress, say, lease_held=True)
            if reused is not None:
                return reused
    if rec is not None and (
        rebuild or rec.fingerprint != req.fingerprint() or rec.phase in (READY, DRAINING, FAILED)
    ):
        # Different shape, a Ready pool that no longer validates, or a name of the wrong kind:
        # rebuild from scratch.
        teardown(pool, keep_dir=True)  # the caller holds the lock and the exclusive lease
        rec, rebuilt = None, True
    elif rec is None and (unknown_dir or _holds_something(pool)):
        # No record of this pool's (lost, or an older offloadpool's that did not re-validate):
        # what is there is unknown, so it is taken apart, never built upon. A directory that was
        # there before this call was handed to consumers under a right nobody records now: it
        # is replaced (a pod's files in it set aside), so no mount of it shows the new pool.
        rebuilt = _holds_something(pool)
        teardown(pool, keep_dir=True)
        if unknown_dir:
            pool.renew_dir()
    if rec is None:
        rec = records.Record.new(req)
    else:
        rec.request = records.Record.new(req).request
    rec.phase, rec.message, rec.numa_nodes, rec.orphaned = PROVISIONING, "", call.numa_nodes, ""
    records.save(pool, rec)
    say(PROVISIONING)

    mnt = pool.rel(MOUNT_NAME)
    made = beneath.mkdir(pool.fd, MOUNT_NAME, 0o755)
    try:
        os.close(beneath.open_dir(pool.fd, MOUNT_NAME))  # a directory, not a link to one
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    # a directory made just now is no mount point: no mount table to read
    existing = None if made else mounts.mount_at(mnt)
    if existing is not None and "shared:" not in existing.propagation:
        mounts.make_shared(mnt, dir_fd=pool.fd)  # an earlier run was killed between mount(2) and MS_SHARED
    if existing is None:
        if plan.medium.hugetlb:
            rec.hugepage_size = plan.page_size
            if rec.boot_id != records.boot_id():
                rec.hugepages_added = 0  # added in an earlier boot: the kernel pool was reset since
            rec.boot_id = records.boot_id()
            # Growing the pool and mounting (which reserves the pages) under one lock, so two
            # offloadpool processes cannot take each other's freshly added pages. Taking it
            # settles a grow or give-back a killed process left unrecorded (hugepage_intent).
            with hugepages.reservation_lock(pool.root):
                added = _reserve_hugepages(plan, pool, rec)
                rec.hugepages_added += added
                records.save(pool, rec)
                if added:
                    hugepage_intent.clear(pool.root)  # the record shows the pages now
                mounts.mount(plan.medium.fstype, mnt, mount_options(plan, req), dir_fd=pool.fd)
        else:
            mounts.mount(plan.medium.fstype, mnt, mount_options(plan, req), dir_fd=pool.fd)
        rec.mounted = True
        records.save(pool, rec)
    layout_files.secure_mount_dir(pool)
    layout_files.create_segments(pool, plan, req)
    layout_files.ensure_lease_file(pool)

    rec.phase = POPULATING
    records.save(pool, rec)
    say(POPULATING)
    stats = populate(
        pool,
        plan,
        workers=opts.workers or req.workers,
        progress=opts.progress,
        numa_policy=req.numa,
        chunk_bytes=opts.chunk_bytes,
        rate_limit=opts.rate_limit,
    )
    if plan.medium.hugetlb:
        coverage = 100.0
    else:
        coverage = round(100.0 * stats.thp_bytes / plan.total_bytes, 1) if plan.total_bytes else 0.0
    rec.hugepage_coverage_percent = coverage
    rec.populate = {
        "seconds": stats.seconds,
        "gib_per_s": stats.gib_per_s,
        "workers": stats.workers,
        "mode": stats.mode,
        "populated_bytes": stats.populated_bytes,
        "skipped_bytes": stats.skipped_bytes,
    }
    # -- scrub hook: memory handed out before (an interrupted run) is zeroed first when due --
    scrub.before_hand_out(pool, plan, req, rec, progress=opts.progress, say=say)
    compat = layout_files.sync_compat(pool, plan, req)
    manifest = _manifest(req, plan, compat, rec)
    shares.write(pool, manifest, req.uid, req.gid, req.mode)  # attachable once the pool's is
    pool.write_manifest(manifest)  # last: from here on engines may attach
    rec.phase = READY
    records.save(pool, rec)
    say(READY)
    return ProvisionResult(
        pool_dir=pool.path,
        manifest=manifest,
        populated_bytes=stats.populated_bytes,
        seconds=time.perf_counter() - t0,
        gib_per_s=stats.gib_per_s,
        reused=False,
        skipped_bytes=stats.skipped_bytes,
        workers=stats.workers,
        hugepages_added=rec.hugepages_added,
        hugepage_coverage_percent=coverage,
        rebuilt=rebuilt,
    )
