"""Register a plan of ranges all-or-nothing, one segment file at a time under its lock.

The rules this encodes, each paid for by engines that did without:

* all-or-nothing: a failure unregisters, in reverse, everything this call registered, and
  the error names the failing chunk (offset, length, file) and the driver's own message;
* per-file lock: several processes registering the same file at once can fail with ENOMEM
  (long-term pins block each other's page migration), so registration of a file is
  serialised across processes by an exclusive ``flock`` on the segment file itself, held only
  while that file's ranges are being registered, never during transfers;
* ranks start in different files (the first file is ``rank mod files``) so that they pipeline
  through the files instead of queueing on the first one.
"""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import BackendError, PinError


@dataclass(frozen=True)
class PinRange:
    """One registration call: ``length`` bytes at ``offset`` in the attachment, in one file."""

    offset: int
    length: int
    segment: int


@dataclass(frozen=True)
class PinStats:
    """What pinning cost: bytes registered, planned ranges, calls made, wall seconds, backend."""

    bytes_registered: int
    ranges: int
    calls: int
    seconds: float
    backend: str

    @property
    def gib_per_s(self) -> float:
        return self.bytes_registered / (1 << 30) / self.seconds if self.seconds > 0 else float("inf")


class PinCancelled(PinError):
    """The attachment was closed while a background pin was still running; it was rolled back."""


def register_plan(
    backend: PinBackend,
    base: int,
    plan: Sequence[PinRange],
    lock_fds: Sequence[int],
    segment_names: Sequence[str],
    first_segment: int = 0,
    cancel: threading.Event | None = None,
) -> tuple[list[tuple[int, int]], PinStats]:
    """Register every range; return the registered ``(addr, length)`` list and the stats.

    On any failure (or cancellation) everything registered here is unregistered in reverse
    before the error propagates.
    """
    t0 = time.perf_counter()
    by_segment: dict[int, list[PinRange]] = {}
    for r in plan:
        by_segment.setdefault(r.segment, []).append(r)
    order = sorted(by_segment)
    if order:
        k = next((i for i, s in enumerate(order) if s >= first_segment), 0)
        order = order[k:] + order[:k]
    done: list[tuple[int, int]] = []
    current: PinRange | None = None
    active = False
    try:
        backend.activate()
        active = True
        for seg in order:
            fd = lock_fds[seg]
            current = None
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                for current in by_segment[seg]:
                    if cancel is not None and cancel.is_set():
                        raise PinCancelled(
                            f"pinning cancelled (attachment closing) after {len(done)} of "
                            f"{len(plan)} ranges; rolled back",
                            backend=backend.name,
                        )
                    addr = base + current.offset
                    backend.register(addr, current.length)
                    done.append((addr, current.length))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
    except BaseException as exc:
        n_done = len(done)
        rollback_errors = _unregister(backend, done)
        if isinstance(exc, PinCancelled):
            raise
        if isinstance(exc, (BackendError, OSError)) and current is None:
            raise PinError(
                f"pinning with backend {backend.name!r} failed outside a "
                f"registration call: {exc}; rolled back {n_done} registered ranges",
                backend=backend.name,
            ) from exc
        if isinstance(exc, (BackendError, OSError)) and current is not None:
            msg = (
                f"pinning with backend {backend.name!r} failed at chunk offset {current.offset} "
                f"(0x{current.offset:x}), length {current.length} bytes, in segment "
                f"{segment_names[current.segment]}: {exc}; rolled back {n_done} registered "
                f"range{'s' if n_done != 1 else ''} in reverse"
            )
            if rollback_errors:
                msg += "; rollback errors: " + "; ".join(rollback_errors)
            raise PinError(
                msg,
                offset=current.offset,
                length=current.length,
                segment=segment_names[current.segment],
                backend=backend.name,
            ) from exc
        raise
    finally:
        if active:
            backend.deactivate()
    stats = PinStats(
        bytes_registered=sum(length for _, length in done),
        ranges=len(plan),
        calls=len(done),
        seconds=time.perf_counter() - t0,
        backend=backend.name,
    )
    return done, stats


def unregister_all(backend: PinBackend, registered: list[tuple[int, int]]) -> list[str]:
    """Unregister in reverse order; return the errors (it keeps going past failures)."""
    if not registered:
        return []
    try:
        backend.activate()
    except BackendError as exc:
        return [f"cannot unregister {len(registered)} ranges: {exc}"]
    try:
        return _unregister(backend, registered)
    finally:
        backend.deactivate()


def _unregister(backend: PinBackend, registered: list[tuple[int, int]]) -> list[str]:
    errors = []
    while registered:
        addr, length = registered.pop()
        try:
            backend.unregister(addr, length)
        except BackendError as exc:
            errors.append(f"0x{addr:x}+{length}: {exc}")
    return errors
