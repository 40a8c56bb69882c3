"""The provisioning record: ``<pool>/state.json``, the node side's own notes about a pool.

The manifest is for engines and exists only once the pool is Ready; the record exists from the
first step and says what was asked for (the request and its fingerprint), which phase the
pool is in, what the node changed on the host (huge pages added to the kernel pool, so release
gives back exactly those), and the last populate figures. It is rewritten atomically at every
phase change, so a killed provision leaves a record the next run can finish from.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from offloadpool.region.request import PoolRequest

RECORD_NAME = "state.json"
PHASES = ("Provisioning", "Populating", "Ready", "Draining", "Failed")


@dataclass
class Record:
    request: dict[str, Any]
    fingerprint: str
    phase: str = "Provisioning"
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
    #: killed scrub is redone by the next provision (``offloadpool.region.scrub``).
    scrub_pending: str = ""
    #: the last scrub's figures (reason, seconds, GiB/s, method)
    scrub: dict[str, Any] = field(default_factory=dict)

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


def path(pool_dir: str | os.PathLike[str]) -> Path:
    return Path(pool_dir) / RECORD_NAME


def load(pool_dir: str | os.PathLike[str]) -> Record | None:
    """The record, or None if there is none (or it is unreadable: treated as absent)."""
    try:
        data = json.loads(path(pool_dir).read_text())
        known = {k: v for k, v in data.items() if k in Record.__dataclass_fields__}
        return Record(**known)
    except (OSError, ValueError, TypeError):
        return None


def save(pool_dir: str | os.PathLike[str], rec: Record) -> None:
    rec.updated = time.time()
    fd, tmp = tempfile.mkstemp(dir=pool_dir, prefix=".state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(rec), fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path(pool_dir))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
