"""The huge page intent: what an offloadpool process is about to do to ``nr_hugepages``.

Growing the kernel's huge page pool and recording the pages in the pool's record are two
writes; so are giving them back and recording that. A SIGKILL between the two would leak the
pages (grown, not recorded: nothing gives them back) or give them back twice (given back, not
recorded: the next release gives them back again). So, under the host's huge page lock
(``hugepages.reservation_lock``), the process first writes one intent durably — "pool P grows page
size S by N pages from total T" or "pool P gives back N pages of size S from total T" —
then writes ``nr_hugepages`` and the record, then removes the intent. Whoever takes the lock
next settles an intent it finds before doing anything else (``hugepages.reconcile``): the lock
serialises every offloadpool writer of ``nr_hugepages``, so the kernel's total differs from T
only by what the dead process did, and the record says whether that was recorded.

* **grow**: the dead process added ``g = clamp(total - T, 0, N)`` pages. If the record shows
  them (``hugepages_added`` is the value before plus g, same boot), nothing is owed; otherwise
  the g pages are given back (the pool never mounted them: the mount comes after the record).
* **shrink**: the record is written first ("0 added"), ``nr_hugepages`` second. If the record
  still shows the pages, the dead process had not touched the kernel: nothing to do (the pool
  still owns them and its next teardown gives them back). Otherwise (record updated, or gone)
  the give-back is completed: the total is brought down to at most ``T - N``.
* an intent of an earlier boot is void: a reboot resets the kernel's pools.

One intent at a time is enough: it is written and removed under the lock. It lives at
``<root>/.state/hugepages.intent`` (the directory root-only, 0700), where no pod's hostPath
reaches, so no tenant can forge one. Writes are atomic (a temporary file, fsync, rename, fsync of
the directory); every open is ``O_NOFOLLOW`` relative to the opened state directory.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from offloadpool.region.errors import RegionError
from offloadpool.region.files import bounded
from offloadpool.region.files.record import Record

STATE_DIR = ".state"
INTENT_NAME = "hugepages.intent"
_TEMP_NAME = INTENT_NAME + ".tmp"
OPS = ("grow", "shrink")
# the pool-name rule of offloadpool.region.request: the name becomes a directory under the root
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class IntentError(RegionError):
    """The intent file is unreadable or not an intent: nobody can tell what ``nr_hugepages``
    owes, so huge page changes stop until a person looks (the message says how)."""


@dataclass(frozen=True)
class Intent:
    """One change of ``nr_hugepages`` about to be made for one pool."""

    op: str  # "grow" or "shrink"
    pool: str
    page_size: int  # bytes
    pages: int  # asked to add (grow) or to give back (shrink); > 0
    before: int  # nr_hugepages before the change
    recorded: int  # the pool record's hugepages_added before the change
    boot_id: str  # the boot it was written in

    def __post_init__(self) -> None:
        ok = (
            self.op in OPS
            and isinstance(self.pool, str)
            and _POOL.match(self.pool) is not None
            and all(
                isinstance(v, int) and not isinstance(v, bool)
                for v in (self.page_size, self.pages, self.before, self.recorded)
            )
            and self.page_size > 0
            and self.page_size & (self.page_size - 1) == 0
            and self.pages > 0
            and self.before >= 0
            and self.recorded >= 0
            and isinstance(self.boot_id, str)
        )
        if not ok:
            raise ValueError(f"not a huge page intent: {asdict(self)}")

    def correction(self, total: int, rec: Record | None) -> int:
        """Pages to add to (positive) or take from (negative) ``nr_hugepages``, now ``total``,
        so the kernel agrees with what the pool's record ``rec`` (None: gone) says."""
        shows_before = (
            rec is not None
            and rec.boot_id == self.boot_id
            and rec.hugepage_size == self.page_size
            and rec.hugepages_added == self.recorded
        )
        if self.op == "grow":
            grown = min(self.pages, max(0, total - self.before))
            recorded = (
                rec is not None
                and rec.boot_id == self.boot_id
                and rec.hugepage_size == self.page_size
                and rec.hugepages_added == self.recorded + grown
            )
            return 0 if recorded else -grown
        if shows_before:  # the record is written before nr_hugepages: the kernel is untouched
            return 0
        return -min(self.pages, max(0, total - (self.before - self.pages)))

    def describe(self) -> str:
        verb = "grow by" if self.op == "grow" else "give back"
        return (
            f"pool {self.pool}: {verb} {self.pages} huge pages of {self.page_size >> 10} kB "
            f"from nr_hugepages {self.before}"
        )


def state_dir(root: str | os.PathLike[str]) -> Path:
    return Path(root) / STATE_DIR


def path(root: str | os.PathLike[str]) -> Path:
    return state_dir(root) / INTENT_NAME


@contextmanager
def _open_state_dir(root: str | os.PathLike[str], *, create: bool) -> Iterator[int | None]:
    """The state directory's descriptor (never through a symlink); None if absent and not
    ``create``. Created root-only (0700)."""
    d = state_dir(root)
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise IntentError(f"{d} is not a directory (a symlink or a file): refusing to use it") from None
        raise
    try:
        yield fd
    finally:
        os.close(fd)


def write(root: str | os.PathLike[str], intent: Intent) -> None:
    """Make ``intent`` the pending one, durably; the caller holds ``hugepages.reservation_lock``."""
    data = (json.dumps(asdict(intent), sort_keys=True) + "\n").encode()
    with _open_state_dir(root, create=True) as dfd:
        assert dfd is not None
        try:
            os.unlink(_TEMP_NAME, dir_fd=dfd)  # left by a process killed mid-write
        except FileNotFoundError:
            pass
        fd = os.open(
            _TEMP_NAME,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dfd,
        )
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(_TEMP_NAME, INTENT_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)


def load(root: str | os.PathLike[str]) -> Intent | None:
    """The pending intent, or None. Raises :class:`IntentError` for anything else there."""
    with _open_state_dir(root, create=False) as dfd:
        if dfd is None:
            return None
        try:
            fd = os.open(INTENT_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _unreadable(root, exc.strerror or str(exc)) from None
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(4096)
    try:
        fields = bounded.loads(raw)
        if not isinstance(fields, dict) or set(fields) != set(Intent.__dataclass_fields__):
            raise ValueError(f"fields {sorted(fields) if isinstance(fields, dict) else type(fields)}")
        return Intent(**fields)
    except (ValueError, TypeError) as exc:
        raise _unreadable(root, str(exc)) from None


def _unreadable(root: str | os.PathLike[str], why: str) -> IntentError:
    return IntentError(
        f"huge page intent {path(root)} cannot be read ({why}); an offloadpool process was killed "
        f"while changing nr_hugepages and what it did is unknown: compare "
        f"/sys/kernel/mm/hugepages/*/nr_hugepages with the pools' records, then remove the file"
    )


def clear(root: str | os.PathLike[str]) -> None:
    """Drop the pending intent (its effect is recorded, or was settled)."""
    with _open_state_dir(root, create=False) as dfd:
        if dfd is None:
            return
        for name in (INTENT_NAME, _TEMP_NAME):
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
        os.fsync(dfd)


def pending(root: str | os.PathLike[str]) -> bool:
    """Whether an intent waits to be settled (a hint, read without the lock)."""
    return os.path.lexists(path(root))
