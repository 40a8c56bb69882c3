"""Scrub: zero a pool's memory before it is handed to another consumer.

A pool outlives its engines by design, so whatever a tenant wrote stays in the memory after it
exits; handed to the next tenant as it is, the next tenant reads it. The node zeroes the memory
when the request says the memory is for someone else (``scrub_needed``, a pure decision from
the record and the request):

* the consumers changed so that someone new can reach the memory (another uid or gid, mode
  bits or namespaces added: who may open the files or get the mount; bits or namespaces only
  removed hand it to no one new), or the pool was re-created over a retained region (another
  OffloadPool uid) — whatever the policy says, ``Never`` included (``Never`` only keeps the
  memory for the same consumer coming back); such a scrub is *owed*: the pool is not handed out
  until it is done, however long its holders stay;
* policy ``Always``: the region is handed out again after its holders left (every provision
  that reuses it with nothing attached; the agent provisions again when its count of attached
  engines drops to 0). With holders attached the tenancy goes on and nothing is zeroed.
  A pool handed to pods through ``csi`` volumes is handed out at each publish: the CSI plugin
  asks ``before_new_holder`` whether the pod is another than the one the memory was last
  handed to (``HOLDER_KEY`` in the record's consumer, cleared when the memory is zeroed), and
  under ``Always`` zeroes it then, if nothing holds the pool: the agent's next pass may come
  after the next pod's publish.

How: never under a holder (``holders.exclusive_unused``). The record says "scrub pending"
*before* anything else happens, then the manifest (what engines attach by) is removed and the
segment files become root-only (stock vLLM opens them by name, without the manifest); only then
is the memory zeroed. Pending is cleared once the last byte is zero, after a manifest is back,
so a kill at any point leaves either a pending scrub (the next provision redoes it: zeroing is
idempotent) or zeroed memory. An owed scrub that finds holders leaves the pool withheld the
same way and raises ``ScrubPending`` (a ``PoolInUse``): the engines attached keep their
mappings, nothing new can attach, and the agent reports the pool in use as for a reshape.

Zeroing runs on the pre-fault's machinery (``region.memory.parallel``): W threads, each a contiguous
share of the logical region, so workers start in different files; calls through ctypes, so the
GIL is released; progress as it goes. The result is what a fresh pre-fault leaves: every byte zero,
every page present (no fault moved to the engine), the mount and files unchanged. Methods, per
file system (``METHOD_FOR``; ``docs/bench-populate.md`` has the measurement that chose them):

* ``memset``: write zeros through the mapping; pages stay where they are;
* ``punch``: ``fallocate(PUNCH_HOLE)`` each run, then ``MADV_POPULATE_WRITE`` it: the kernel
  hands out fresh zeroed pages (on hugetlbfs the freed pages go back to the kernel pool, but a
  ``min_size`` mount keeps them reserved for this mount: nobody else can take them meanwhile);
* ``remove``: the same through the mapping (``MADV_REMOVE``), then populate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from offloadpool.region.errors import RegionError, fmt_bytes
from offloadpool.region.files import layout_files, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import Pool, PoolHandle, given
from offloadpool.region.files.journal import Unit
from offloadpool.region.files.manifest import MANIFEST_NAME, MOUNT_NAME
from offloadpool.region.files.planner import Plan
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding.holders import PoolInUse, exclusive_unused
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.memory import mounts, numa, parallel, vm
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import NUMA_NONE, READY, SCRUB_ALWAYS, SCRUBBING

PhaseCallback = Callable[[str], None]
METHODS = ("memset", "punch", "remove")
#: The fastest method per file system, measured with ``offloadpool bench scrub`` (see
#: docs/bench-populate.md, section Scrubbing): writing zeros in user space beats freeing and
#: re-faulting pages on both.
METHOD_FOR = {"tmpfs": "memset", "hugetlbfs": "memset"}
#: What identifies a consumer: who may open the files (uid, gid, mode), who gets the mount
#: (namespaces), and which OffloadPool the memory belongs to (its uid).
IDENTITY_FIELDS = ("uid", "gid", "mode", "namespaces", "pool_uid")
#: The key of ``Record.consumer`` naming the pod the memory was last handed to through a
#: ``csi`` volume (its uid) since it was last zero; absent: to no pod since then.
HOLDER_KEY = "holder"


@dataclass(frozen=True)
class Due:
    """Why the memory must be zeroed before it is handed out.

    ``owed``: to a different consumer (or left by an interrupted scrub): withheld until done,
    however long holders stay. Not owed: ``Always`` between holders of one tenancy, done only
    when nothing holds the pool.
    """

    reason: str
    owed: bool = True


@dataclass(frozen=True)
class ScrubStats:
    total_bytes: int
    seconds: float
    workers: int
    method: str

    @property
    def gib_per_s(self) -> float:
        return self.total_bytes / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


class ScrubPending(LeaseHeld):
    """An owed scrub waits for the pool's holders to leave; the pool is withheld meanwhile.

    A LeaseHeld, as PoolInUse is: the CLI's exit code, the agent's "in use" report and
    provision's "nothing marked Failed" need no new case.
    """

    def __init__(self, due: Due, held: LeaseHeld) -> None:
        super().__init__(
            f"{due.reason}: the memory is zeroed before it is handed out again, once nothing "
            f"holds the pool; until then nothing new can attach ({held})"
        )
        self.holders = held.holders if isinstance(held, PoolInUse) else []
        self.due = due


def identity(req: PoolRequest) -> dict[str, Any]:
    """Who ``req`` hands the memory to; a pool uid that is not known (``""``) is left out."""
    found: dict[str, Any] = {
        "uid": req.uid,
        "gid": req.gid,
        "mode": req.mode,
        "namespaces": req.consumer_namespaces,
    }
    if req.pool_uid:
        found["pool_uid"] = req.pool_uid
    return found


def last_consumer(rec: records.Record) -> dict[str, Any] | None:
    """Who the memory was last handed to; None when it never was (fresh memory).

    A Ready record of an older release has no ``consumer``: its request still says the uid,
    gid and mode it was handed out with (namespaces and pool uid are then unknown).
    """
    if rec.consumer is not None:
        return rec.consumer
    if rec.phase == READY:
        return {k: rec.request[k] for k in ("uid", "gid", "mode") if k in rec.request}
    return None


def _show(field: str, value: Any) -> str:
    if field == "mode" and isinstance(value, int):
        return f"{value:04o}"
    if field == "namespaces":
        return "any" if value is None else f"[{value}]"
    return str(value)


def _widens(field: str, last: Any, now: Any) -> bool:
    """Whether ``now`` lets someone reach the memory whom ``last`` did not.

    Mode bits and namespaces only narrowing (0660 -> 0600; [a, b] -> [a]) hand the memory to
    no one new: the same consumers keep it, and a narrowing applies in place even while held.
    """
    if field == "mode" and isinstance(last, int) and isinstance(now, int):
        return bool(now & ~last & 0o066)  # group/other read or write bits it lacked
    if field == "namespaces":
        if now is None or last is None:
            return now is None and last is not None  # "any namespace" now, a list before
        return not set(str(now).split(",")) <= set(str(last).split(","))
    return bool(last != now)


def scrub_needed(rec: records.Record, req: PoolRequest) -> Due | None:
    """Whether the memory in ``rec`` must be zeroed before ``req`` gets it, and why.

    An interrupted scrub is always owed (whatever the policy says now: it was owed to someone
    else's data), and so is memory another pool (``metadata.uid``) or a wider set of consumers
    could reach, whatever the policy: ``Never`` only means "not when the same consumer comes
    back". Fields known on one side only (a pool uid from a pool file without one) are not
    compared.
    """
    if rec.scrub_pending:
        return Due(rec.scrub_pending)
    last = last_consumer(rec)
    if last is None:
        return None
    now = identity(req)
    changed = [f for f in IDENTITY_FIELDS if f in last and f in now and _widens(f, last[f], now[f])]
    if "pool_uid" in changed:
        return Due(
            f"the pool was re-created over a retained region (pool uid {now['pool_uid']}, "
            f"the memory belonged to {last['pool_uid']})"
        )
    if changed:
        what = ", ".join(f"{f} {_show(f, last[f])} -> {_show(f, now[f])}" for f in changed)
        return Due(f"consumers changed ({what})")
    if req.scrub == SCRUB_ALWAYS:
        return Due("scrub Always: the region is handed out again", owed=False)
    return None


# -- zeroing ----------------------------------------------------------------------------------


#: The most one zeroing call covers: 1 GiB, not the pre-fault's 64 MiB runs. glibc's ``memset``
#: picks its stores by the size of the call: on this project's EPYC VM (32 MiB L3), 4 GiB of
#: 2 MiB huge pages zeroed in 64 MiB calls ran at 0.75 of the same threads zeroing each share in
#: one call, in 256 MiB calls 0.94, in 1 GiB calls 1.03 (4 KiB tmpfs: the same either way, the
#: faults dominate). A run is also what progress and a stop wait for: a GiB is well under a
#: second of zeroing on any medium.
ZERO_CHUNK = 1 << 30


class _Zeroing:
    """One scrub in progress: the mappings its worker threads share and what each of them does
    with one run of its share."""

    def __init__(
        self, plan: Plan, fds: list[int], maps: list[parallel.Mapping], method: str, tally: parallel.Tally
    ) -> None:
        self.plan, self.fds, self.maps, self.method, self.tally = plan, fds, maps, method, tally

    def each(self, run: list[Unit]) -> None:
        first = run[0]
        length = sum(u.bytes for u in run)
        self.zero_run(first.segment, first.offset, length)
        self.tally.add(length)

    def zero_run(self, segment: int, offset: int, length: int) -> None:
        addr = self.maps[segment][0] + offset
        if self.method == "memset":
            vm.memset(addr, 0, length)
            return
        if self.method == "punch":
            vm.punch_hole(self.fds[segment], offset, length)
        else:
            vm.remove(addr, length)
        parallel.fault_in(
            addr,
            length,
            self.plan.page_size,
            f"scrub could not take back the pages of a {fmt_bytes(length)} run of the "
            f"{self.plan.medium.name} pool",
        )


def zero(
    pool: Pool,
    plan: Plan,
    *,
    workers: int = 0,
    progress: parallel.Progress | None = None,
    method: str = "auto",
    numa_policy: str = NUMA_NONE,
    chunk_bytes: int = ZERO_CHUNK,
) -> ScrubStats:
    """Zero every byte of every segment of ``plan`` in ``pool``, leaving every page
    present. The caller makes sure nothing holds the pool (the exclusive lease)."""
    if method == "auto":
        method = METHOD_FOR[plan.medium.fstype]
    if method not in METHODS:
        raise RegionError(f"scrub method {method!r} is not one of {METHODS}")
    pages = plan.total_bytes // plan.page_size
    workers = max(1, min(workers or parallel.default_workers(plan), pages))
    t0 = time.perf_counter()
    with given(pool) as handle, parallel.mapped(handle, plan, numa.parse_policy(numa_policy)) as (fds, maps):
        job = _Zeroing(plan, fds, maps, method, parallel.Tally(plan.total_bytes, progress))
        # every byte, so no journal units: each share is cut straight into its runs
        parallel.run_shares(
            parallel.byte_shares(plan.segments, plan.page_size, workers, chunk_bytes),
            lambda share: [[run] for run in share],
            job.each,
            "scrub",
        )
        seconds = time.perf_counter() - t0
    return ScrubStats(plan.total_bytes, seconds, workers, method)


# -- the hooks provision calls ----------------------------------------------------------------


def _restrict(pool: PoolHandle, plan: Plan, req: PoolRequest) -> None:
    """Make every segment file root's alone (0600): nothing new opens it until it is handed
    out again (``layout_files.own``). Mappings made earlier are not affected. Opened beneath
    the pool directory, never through a link a pod put there."""
    for seg in plan.segments:
        with layout_files.opened(pool, seg.file, links=layout_files.segment_links(req)) as fd:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o600)


def _segments_ok(pool: PoolHandle, plan: Plan, req: PoolRequest) -> bool:
    """Every planned segment is there, a plain file of its planned size (the manifest may be
    withheld by an earlier scrub). Raises ``places.UnsafeEntry`` for a name of the wrong kind."""
    for seg in plan.segments:
        try:
            with layout_files.opened(pool, seg.file, links=layout_files.segment_links(req)) as fd:
                if os.fstat(fd).st_size != seg.bytes:
                    return False
        except FileNotFoundError:
            return False
    return True


def _withhold(pool: PoolHandle, plan: Plan, req: PoolRequest, rec: records.Record, due: Due) -> None:
    """Record the scrub as pending, then take the pool away from engines: in this order, so a
    kill in between leaves a pending scrub, never a pool handed out with another's bytes."""
    if rec.scrub_pending != due.reason:
        rec.scrub_pending = due.reason
        records.save(pool, rec)
    why = places.remove_entry(pool.fd, MANIFEST_NAME)
    if why is not None:
        raise RegionError(f"cannot withhold {pool.path}: {why}")
    _restrict(pool, plan, req)


def _zero_withheld(
    pool: PoolHandle,
    plan: Plan,
    req: PoolRequest,
    rec: records.Record,
    due: Due,
    progress: parallel.Progress | None,
    say: PhaseCallback,
) -> None:
    """Withhold, zero, note the figures; the caller holds the exclusive lease."""
    _withhold(pool, plan, req, rec, due)
    say(SCRUBBING)
    try:
        stats = zero(pool, plan, workers=req.workers, progress=progress, numa_policy=req.numa)
    except OSError as exc:
        raise RegionError(f"scrubbing pool {req.name} failed ({due.reason}): {exc}") from exc
    if rec.consumer is not None:
        rec.consumer.pop(HOLDER_KEY, None)  # zero memory: no pod's bytes in it any more
    from offloadpool.region.lifecycle import share_scrub  # it builds on this module

    rec.shares = share_scrub.baseline(pool, plan.shares)  # every share zero: no holder since
    rec.scrub = {
        "reason": due.reason,
        "seconds": stats.seconds,
        "gib_per_s": stats.gib_per_s,
        "workers": stats.workers,
        "method": stats.method,
        "at": time.time(),
    }


def _handed_to(rec: records.Record, req: PoolRequest) -> None:
    """Note who gets the memory now (fields the request does not know are kept)."""
    rec.consumer = {**(last_consumer(rec) or {}), **identity(req)}


def before_reuse(
    pool: PoolHandle,
    plan: Plan,
    req: PoolRequest,
    rec: records.Record,
    *,
    restore_manifest: Callable[[], object],
    progress: parallel.Progress | None = None,
    say: PhaseCallback = lambda phase: None,
    lease_held: bool = False,
) -> None:
    """Provision's reuse path, before the pool is validated and handed out again: zero the
    memory when ``scrub_needed`` says so. ``rec`` is updated in place (the caller saves it).

    A pool that would not validate (mount gone, segments wrong) is left alone: provision
    rebuilds it, which gives fresh memory. Raises ScrubPending when an owed scrub finds the
    pool held (withheld meanwhile). ``lease_held``: the caller holds the exclusive lease.
    """
    due = scrub_needed(rec, req)
    if due is None:
        _handed_to(rec, req)
        return
    if mounts.mount_at(pool.rel(MOUNT_NAME)) is None or not _segments_ok(pool, plan, req):
        return
    lease = None
    try:
        if not lease_held:
            lease = exclusive_unused(pool)
    except LeaseHeld as exc:
        if not due.owed:
            return  # Always: an engine of this tenancy is attached; its data stays
        _withhold(pool, plan, req, rec, due)
        raise ScrubPending(due, exc) from None
    try:
        _zero_withheld(pool, plan, req, rec, due, progress, say)
        restore_manifest()  # before pending is cleared: a kill between redoes the scrub
        rec.scrub_pending = ""
        _handed_to(rec, req)
        records.save(pool, rec)
    finally:
        if lease is not None:
            lease.close()


def before_hand_out(
    pool: PoolHandle,
    plan: Plan,
    req: PoolRequest,
    rec: records.Record,
    *,
    progress: parallel.Progress | None = None,
    say: PhaseCallback = lambda phase: None,
) -> None:
    """Provision's build path, before the manifest is written: the caller holds the exclusive
    lease. Fresh memory needs nothing; a build finishing memory that was handed out already
    (killed after its manifest, or during an owed scrub, or a share's) is zeroed first when due."""
    due = scrub_needed(rec, req) or _share_pending(rec)
    if due is not None:
        _zero_withheld(pool, plan, req, rec, due, progress, say)
    rec.scrub_pending = ""
    _handed_to(rec, req)


def _share_pending(rec: records.Record) -> Due | None:
    """A share's zeroing left pending (``share_scrub``): nothing holds a pool being built, so
    the whole pool is zeroed (which takes every share's note with it)."""
    for note in rec.shares.values():
        if isinstance(note, dict) and note.get("pending"):
            return Due(str(note["pending"]))
    return None


def holder_due(rec: records.Record, req: PoolRequest, holder: str) -> Due | None:
    """Whether handing the memory to the pod ``holder`` (its uid) needs it zeroed first.

    ``Always`` only, and only when another pod had it since it was last zero: the same pod
    published again (the kubelet's retry, a kubelet restart) is the same holder.
    ``OnConsumerChange`` zeroes when the pool's consumers change (``scrub_needed``, at the
    agent's provision): the pods of the namespaces a pool names are its one consumer, as
    engines sharing a hostPath are. ``Never`` keeps the bytes (for the same consumer only:
    ``scrub_needed`` zeroes for another pool or wider consumers whatever the policy)."""
    if req.scrub != SCRUB_ALWAYS:
        return None
    last = (rec.consumer or {}).get(HOLDER_KEY)
    if last is None or last == holder:
        return None
    return Due(f"scrub Always: the pool is handed to pod {holder}, pod {last} had it before", owed=False)


def before_new_holder(
    pool: PoolHandle, holder: str, say: PhaseCallback = lambda phase: None
) -> ScrubStats | None:
    """Publish's hook, before the pod ``holder`` gets the pool (the caller holds the pool's
    lock and has checked it Ready): zero the memory when ``holder_due`` says so and nothing
    holds the pool (with holders the tenancy goes on, as ``Always`` says), then note the pod
    as the memory's holder. The figures of a scrub done, else None.

    The same withholding as the agent's scrub, so a kill in the middle leaves the scrub
    pending (the pool not Ready, no manifest, root-only files) for the agent's next provision
    to finish; the manifest read before is written back once every byte is zero."""
    rec = records.load(pool)
    if rec is None:
        raise RegionError(f"{pool.path} has no provisioning record")
    req = rec.pool_request()
    due = holder_due(rec, req, holder)
    done = None
    if due is not None:
        try:
            lease = exclusive_unused(pool)
        except LeaseHeld:
            lease = None  # another holder: one tenancy, nothing is zeroed under it
        if lease is not None:
            try:
                plan = make_plan(req)
                manifest = pool.read_manifest()
                _zero_withheld(pool, plan, req, rec, due, None, say)
                layout_files.own_segments(pool, plan, req)
                pool.write_manifest(manifest)  # before pending is cleared: a kill between redoes it
                rec.scrub_pending = ""
                done = ScrubStats(
                    plan.total_bytes, rec.scrub["seconds"], rec.scrub["workers"], rec.scrub["method"]
                )
            finally:
                lease.close()
    if (rec.consumer or {}).get(HOLDER_KEY) != holder or done is not None:
        rec.consumer = {**(rec.consumer or {}), HOLDER_KEY: holder}
        records.save(pool, rec)
    return done
