"""The provisioning record: ``<root>/.state/<pool>/state.json``, the node side's own notes.

The manifest is for engines and exists only once the pool is Ready; the record exists from the
first step and says what was asked for (the request and its fingerprint), which phase the
pool is in, what the node changed on the host (huge pages added to the kernel pool, so release
gives back exactly those), and the last populate figures. It is rewritten atomically at every
phase change, so a killed provision leaves a record the next run can finish from.

It lives in the pool's root-only state directory (``places``), never where a pod can write:
release gives back the huge pages it names, so a record a pod could forge would let that pod
shrink the node's huge page pool. It is still parsed strictly (``parse``), as is the record an
older offloadpool left in the pool directory, which ``migrate`` reads only to re-validate.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from offloadpool.region.files import beneath, bounded, places
from offloadpool.region.files.handle import Pool, given, path_of
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import PROVISIONING, RECORD_PHASES

RECORD_NAME = "state.json"
#: what the agent notes as ``Record.deleting`` when it starts draining a deleted pool
DELETING_NOTE = "its OffloadPool was deleted; the node is draining it for release"


@dataclass
class Record:
    request: dict[str, Any]
    fingerprint: str
    phase: str = PROVISIONING
    message: str = ""
    hugepage_size: int = 0
    hugepages_added: int = 0
    boot_id: str = ""  # the boot the huge pages were added in; a reboot resets the kernel pool
    mounted: bool = False
    populate: dict[str, Any] = field(default_factory=dict)
    numa_nodes: list[list[int]] = field(default_factory=list)
    hugepage_coverage_percent: float = 0.0
    updated: float = 0.0
    #: who the memory was last handed to (``scrub.identity``); None: never handed out
    consumer: dict[str, Any] | None = None
    #: why the memory must be zeroed before it is handed out again; "" when it need not be.
    #: Set before the manifest is withdrawn and cleared only once every byte is zero, so a
    #: killed scrub is redone by the next provision (``offloadpool.region.lifecycle.scrub``).
    scrub_pending: str = ""
    #: the last scrub's figures (reason, seconds, GiB/s, method)
    scrub: dict[str, Any] = field(default_factory=dict)
    #: why no OffloadPool owns this memory any more ("" while one does): the agent saw its pool
    #: deleted with reclaimPolicy Retain and left the memory (``mark_orphaned``). Cleared by
    #: the next provision of the name, which adopts or rebuilds it.
    orphaned: str = ""
    #: per share of a partitioned pool (``"<index>"``), the node's note of who was last given
    #: it since it was zero (``holder``), the share lease's print then (``lease``: an engine's
    #: claim over hostPath rewrites it) and a zeroing under way (``pending``):
    #: ``offloadpool.region.lifecycle.share_scrub``. Empty: no share handed out since zero.
    shares: dict[str, Any] = field(default_factory=dict)
    #: why the pool is being deleted ("" while it is not): the agent writes it when it starts
    #: draining the pool for its deletion, and the CSI and DRA plugins (which have no API
    #: credentials) refuse a new volume or claim for the pool from then on (``mark_deleting``)
    deleting: str = ""

    @classmethod
    def new(cls, req: PoolRequest) -> Record:
        return cls(request=asdict(req), fingerprint=req.fingerprint())

    def pool_request(self) -> PoolRequest:
        return PoolRequest(**self.request)


def boot_id() -> str:
    """This boot's id: huge pages added before a reboot are not ours to give back after it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


#: each field's JSON type(s): a record of other types is unreadable (treated as absent)
_TYPES: dict[str, tuple[type, ...]] = {
    "request": (dict,),
    "fingerprint": (str,),
    "phase": (str,),
    "message": (str,),
    "hugepage_size": (int,),
    "hugepages_added": (int,),
    "boot_id": (str,),
    "mounted": (bool,),
    "populate": (dict,),
    "numa_nodes": (list,),
    "hugepage_coverage_percent": (float, int),
    "updated": (float, int),
    "consumer": (dict, type(None)),
    "scrub_pending": (str,),
    "orphaned": (str,),
    "scrub": (dict,),
    "shares": (dict,),
    "deleting": (str,),
}


def parse(data: bytes) -> Record | None:
    """The record in ``data``, or None when it is not one (bad JSON, a field of the wrong type,
    a phase or request that does not exist, a count below zero)."""
    try:
        doc = bounded.loads(data)
    except bounded.Malformed:
        return None
    if not isinstance(doc, dict):
        return None
    known: dict[str, Any] = {}
    for f in fields(Record):
        if f.name not in doc:
            continue
        value = doc[f.name]
        types = _TYPES[f.name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return None
        known[f.name] = value
    try:
        rec = Record(**known)
        req = rec.pool_request()
        req.validate()
    except (TypeError, ValueError):
        return None
    if rec.phase not in RECORD_PHASES or rec.hugepages_added < 0 or rec.hugepage_size < 0:
        return None
    return rec


def path(pool: Pool) -> Path:
    """Where the record is, for a message (never opened by this path)."""
    return places.state_dir(path_of(pool)) / RECORD_NAME


def load(pool: Pool) -> Record | None:
    """The record, or None if there is none (or it is unreadable: treated as absent)."""
    try:
        with given(pool) as handle:
            fd = handle.state()
            if fd is None:
                return None
            return parse(beneath.read_file(fd, RECORD_NAME))
    except (OSError, places.UnsafeEntry):
        return None


def save(pool: Pool, rec: Record) -> None:
    """Replace the record atomically (temp file, fsync, rename) in the pool's state directory."""
    rec.updated = time.time()
    data = (json.dumps(asdict(rec), indent=2, sort_keys=True) + "\n").encode()
    with given(pool) as handle:
        beneath.write_file(handle.state_fd(), RECORD_NAME, data, 0o600)


def mark_orphaned(pool: Pool, why: str) -> bool:
    """Note in the record that no OffloadPool owns the pool any more, and why; False when the
    node holds no record of it (nothing was built). Under the pool's lock, so a provision
    adopting it meanwhile is not undone."""
    with given(pool) as handle, handle.lock():
        rec = load(handle)
        if rec is None:
            return False
        rec.orphaned = why
        save(handle, rec)
        return True


def mark_deleting(pool: Pool, why: str) -> bool:
    """Note in the record that the pool is being deleted (``why``; "" clears it): from then on
    no new csi volume or DRA claim is given it, so no new holder keeps the deletion waiting.
    False when the node holds no record of it. Under the pool's lock, so a publish either
    finishes before the mark (and is a holder the deletion waits for) or sees it."""
    with given(pool) as handle, handle.lock():
        rec = load(handle)
        if rec is None:
            return False
        if rec.deleting != why:
            rec.deleting = why
            save(handle, rec)
        return True
