"""Scrub per share: ``scrub: Always`` for each share of a partitioned pool on its own.

A partitioned pool (``spec.partitions`` N > 1) is N pools side by side in one mount, each given
to one pod at a time (a csi volume, a DRA claim) or claimed by one engine over hostPath
(``region.holding.shares``). The pool as a whole is nearly never free — some share is usually
held — so the pool-level ``Always`` (zero when the pool is handed out again with nothing
attached) would almost never run, and a new pod would be given a share still holding the
previous pod's bytes. So the node keeps, per share, who it was last given to since it was
zero (``Record.shares``, in the root-only record) and zeroes that share alone before it is
given to anyone else:

* a csi volume's pod (its uid) and a DRA claim (``claim/<uid>``) are noted when the CSI or DRA
  plugin gives them the share (``before_share_holder``, under the pool's lock, after the
  share is reserved for them);
* an engine claiming a share over hostPath writes its claim into the share's lease file,
  which no node-side step writes: the note keeps a print of that file (``lease``), so a print
  that changed since says an engine held the share meanwhile (its owner is hostile text: only
  the change is trusted) and the share is zeroed before a pod is given it.

The zeroing is the pool scrub's, on that share's segments alone, never under a holder: the
share's lease held exclusively (no engine holds it) and no process mapping or holding open a
segment of it (``holders.holders_of``); otherwise the publish is refused ``ShareBusy`` and the
kubelet retries. Withheld first, as the pool's scrub withholds: the note says ``pending``
(saved before anything else), the share's manifest is removed and its segment files become
root's alone (0600); then zero; then the files are the consumers' again, the manifest back, and
pending cleared last. A kill in the middle leaves the share pending: every later publish of
that share zeroes it first, and the agent's provision (``settle``) finishes it or keeps it
withheld while something holds it; the other shares are not touched.

Over hostPath shares are not a boundary between pods (every pod given the pool can open every
share's files, docs/user-guide.md §11), so an engine's claim is not preceded by a zeroing: the
node is not asked. What is guaranteed is that a pod given a share through the node (csi, DRA)
never reads the bytes of whoever had that share before.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from dataclasses import replace
from typing import Any

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, layout_files, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME
from offloadpool.region.files.planner import Plan
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import holders, shares
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle import scrub
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import NUMA_NONE, SCRUB_ALWAYS, SCRUBBING

#: the keys of one share's note in ``Record.shares``
HOLDER = "holder"
LEASE = "lease"
PENDING = "pending"
#: most bytes of a share's lease read for its print (an engine writes it: hostile)
LEASE_READ_LIMIT = 4096


class ShareBusy(LeaseHeld):
    """A share due to be zeroed is held by a process (or its lease by an engine): not zeroed,
    not given; the caller refuses and is asked again (the kubelet retries)."""


def share_plan(plan: Plan, index: int) -> Plan:
    """Share ``index``'s regions of ``plan`` alone (its segment files, nothing of the others)."""
    per = len(plan.regions) // plan.shares
    return replace(plan, regions=plan.regions[index * per : (index + 1) * per], shares=1)


def lease_print(pool: PoolHandle, index: int) -> str:
    """A print of share ``index``'s lease file: "" while empty (nothing ever claimed it); an
    engine's claim rewrites it, nothing of the node's does. A name a pod replaced by something
    that is not a plain file prints as such (a change, so the share is zeroed)."""
    try:
        data = beneath.read_file(pool.fd, f"{shares.share_rel(index)}/{LEASE_NAME}", LEASE_READ_LIMIT)
    except FileNotFoundError:
        return ""
    except (OSError, beneath.WrongEntry, places.UnsafeEntry) as exc:
        return f"unreadable: {type(exc).__name__}"
    return hashlib.sha256(data).hexdigest()[:32] if data else ""


def baseline(pool: PoolHandle, count: int) -> dict[str, Any]:
    """The notes of a pool whose memory was just zeroed whole: no holder since, each lease's
    print as it stands (a claim record an engine left before the zeroing is no holder since)."""
    if count < 2:
        return {}
    return {str(i): {HOLDER: "", LEASE: lease_print(pool, i)} for i in range(count)}


def due(rec: records.Record, index: int, holder: str, printed: str) -> scrub.Due | None:
    """Whether share ``index`` must be zeroed before ``holder`` is given it, and why: a zeroing
    left pending (whatever the policy now); under ``Always``, another holder noted since it
    was zero, or an engine's claim since the note (the lease's print changed). No note: nobody
    since the memory was zero, unless an engine claimed it (a non-empty lease) or an older
    release noted a pod for the whole pool (``scrub.HOLDER_KEY``)."""
    note = rec.shares.get(str(index))
    note = note if isinstance(note, dict) else None
    if note is not None and note.get(PENDING):
        return scrub.Due(str(note[PENDING]))
    if rec.pool_request().scrub != SCRUB_ALWAYS:
        return None
    head = f"scrub Always: share {index} is handed to {holder}"
    if note is not None:
        last = note.get(HOLDER) or ""
        if note.get(LEASE, "") != printed:
            return scrub.Due(
                f"{head}; an engine claimed it over hostPath since it was last given", owed=False
            )
        if last and last != holder:
            return scrub.Due(f"{head}, {last} had it before", owed=False)
        return None
    if printed:
        return scrub.Due(f"{head}; an engine claimed it over hostPath since it was zero", owed=False)
    pool_holder = (rec.consumer or {}).get(scrub.HOLDER_KEY)
    if pool_holder is not None and pool_holder != holder:
        return scrub.Due(f"{head}, {pool_holder} had the pool before", owed=False)
    return None


def _note(rec: records.Record, index: int, holder: str, printed: str) -> bool:
    """Note ``holder`` as share ``index``'s last; True when the note changed."""
    want = {HOLDER: holder, LEASE: printed}
    if rec.shares.get(str(index)) == want:
        return False
    rec.shares = {**rec.shares, str(index): want}
    return True


def before_share_holder(
    pool: PoolHandle, index: int, holder: str, say: scrub.PhaseCallback = lambda phase: None
) -> scrub.ScrubStats | None:
    """Publish's and prepare's hook for a partitioned pool, once share ``index`` is reserved for
    ``holder`` (a pod's uid, ``claim/<uid>``) and before it is given: zero that share when
    ``due`` says so (``ShareBusy`` when something holds it), then note ``holder`` as its last.
    The caller holds the pool's lock. The figures of a zeroing done, else None."""
    rec = records.load(pool)
    if rec is None:
        raise RegionError(f"{pool.path} has no provisioning record")
    printed = lease_print(pool, index)
    why = due(rec, index, holder, printed)
    if why is None:
        if _note(rec, index, holder, printed):
            records.save(pool, rec)
        return None
    stats = _zero_share(pool, rec, index, why, say)
    _note(rec, index, holder, lease_print(pool, index))
    records.save(pool, rec)
    return stats


def settle(pool: PoolHandle, plan: Plan, req: PoolRequest, rec: records.Record) -> None:
    """The agent's provision, after it re-owned every segment and wrote every share's manifest:
    finish each share's zeroing left pending (a plugin killed in the middle), or, while
    something holds that share, withhold it again (root-only, no manifest). ``rec`` is saved."""
    for key, note in sorted(rec.shares.items()):
        if not (isinstance(note, dict) and note.get(PENDING) and key.isdigit() and int(key) < plan.shares):
            continue
        index = int(key)
        try:
            _zero_share(pool, rec, index, scrub.Due(str(note[PENDING])), lambda phase: None)
        except ShareBusy:
            _withhold(pool, plan, req, index)
            continue
        _note(rec, index, "", lease_print(pool, index))
        records.save(pool, rec)


def _zero_share(
    pool: PoolHandle, rec: records.Record, index: int, why: scrub.Due, say: scrub.PhaseCallback
) -> scrub.ScrubStats:
    """Withhold share ``index``, zero it, hand it back; pending cleared only at the end."""
    req = rec.pool_request()
    plan = make_plan(req)
    head = pool.read_manifest()  # the pool's: share ``index``'s manifest is made from it again
    lease = _exclusive_share(pool, plan, index)
    try:
        rec.shares = {**rec.shares, str(index): {**rec.shares.get(str(index), {}), PENDING: why.reason}}
        records.save(pool, rec)  # first: a kill from here on leaves the share pending
        _withhold(pool, plan, req, index)
        say(SCRUBBING)
        part = share_plan(plan, index)
        try:
            stats = scrub.zero(pool, part, workers=req.workers, numa_policy=NUMA_NONE)
        except OSError as exc:
            raise RegionError(
                f"zeroing share {index} of pool {req.name} failed ({why.reason}): {exc}"
            ) from exc
        for seg in part.segments:
            with layout_files.opened(pool, seg.file, links=layout_files.segment_links(req)) as fd:
                layout_files.own(fd, req)
        manifest = shares.share_manifest(head, index).encode()
        beneath.write_file(pool.fd, f"{shares.share_rel(index)}/{MANIFEST_NAME}", manifest)
        rec.shares[str(index)] = {k: v for k, v in rec.shares[str(index)].items() if k != PENDING}
        rec.scrub = {
            "reason": why.reason,
            "share": index,
            "seconds": stats.seconds,
            "gib_per_s": stats.gib_per_s,
            "workers": stats.workers,
            "method": stats.method,
            "at": time.time(),
        }
        records.save(pool, rec)
        return stats
    finally:
        os.close(lease)


def _exclusive_share(pool: PoolHandle, plan: Plan, index: int) -> int:
    """Share ``index``'s lease held exclusively (its descriptor), once no engine holds the lease
    and no process maps or holds open one of its segments; ShareBusy naming them otherwise."""
    rel = f"{shares.share_rel(index)}/{LEASE_NAME}"
    try:
        fd = beneath.open_file(pool.fd, rel, os.O_RDONLY)
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ShareBusy(
            f"share {index} of pool {pool.path} is due to be zeroed and an engine holds its lease"
        ) from None
    try:
        files = set()
        for seg in share_plan(plan, index).segments:
            st = beneath.lstat(pool.fd, seg.file)
            if st is not None:
                files.add((st.st_dev, st.st_ino))
        found = holders.holders_of(files)
    except BaseException:
        os.close(fd)
        raise
    if found:
        os.close(fd)
        raise ShareBusy(
            f"share {index} of pool {pool.path} is due to be zeroed and is held: {holders.describe(found)}"
        )
    return fd


def _withhold(pool: PoolHandle, plan: Plan, req: PoolRequest, index: int) -> None:
    """Share ``index``'s manifest removed and its segments root's alone (0600): nothing new
    attaches to or opens it (mappings made earlier are not affected)."""
    why = places.remove_entry(pool.fd, f"{shares.share_rel(index)}/{MANIFEST_NAME}")
    if why is not None:
        raise RegionError(f"cannot withhold share {index} of {pool.path}: {why}")
    for seg in share_plan(plan, index).segments:
        with layout_files.opened(pool, seg.file, links=layout_files.segment_links(req)) as fd:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o600)
