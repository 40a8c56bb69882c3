"""The pool lease: engines hold a shared ``flock`` on ``<pool_dir>/lease`` while attached.

The kernel drops an flock when its holder dies, so a crashed engine can never leave the pool
"held". The node side takes the lock exclusively (non-blocking) before it destroys, shrinks or
re-populates a region; failing to get it means an engine is attached and the region stays.
Engines that never take the lease (stock vLLM) are invisible here; the node side therefore
takes it through ``holders.exclusive_unused``, which also scans /proc for mappings and open files.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from offloadpool.region.files import beneath
from offloadpool.region.files.manifest import LEASE_NAME


class LeaseHeld(RuntimeError):
    """An engine holds the pool; the node side must not touch its memory."""


def lease_path(pool_dir: str | os.PathLike[str]) -> Path:
    return Path(pool_dir) / LEASE_NAME


class Lease:
    """A held flock on a pool's lease file. ``close()`` (or process death) releases it."""

    def __init__(self, fd: int, path: Path, exclusive: bool) -> None:
        self.fd = fd
        self.path = path
        self.held_exclusively = exclusive

    @classmethod
    def shared(cls, pool_dir: str | os.PathLike[str], blocking: bool = True) -> Lease:
        """What an engine takes on attach. Blocks only while the node side holds it exclusively."""
        return cls._take(pool_dir, fcntl.LOCK_SH, blocking)

    @classmethod
    def exclusive(cls, pool_dir: str | os.PathLike[str], *, dir_fd: int | None = None) -> Lease:
        """What the node side takes before changing memory; raises LeaseHeld if any engine holds it.
        ``dir_fd``: the pool directory, opened already by the caller (``pool_dir`` then names it)."""
        return cls._take(pool_dir, fcntl.LOCK_EX, blocking=False, dir_fd=dir_fd)

    @classmethod
    def _take(
        cls, pool_dir: str | os.PathLike[str], op: int, blocking: bool, dir_fd: int | None = None
    ) -> Lease:
        path = lease_path(pool_dir)
        # the pool directory may be written by pods: the lease is opened only if it is a plain,
        # singly linked file (beneath.WrongEntry otherwise), never through a link. An engine
        # opens it read-only (an flock needs no write access): a csi volume gives it read-only,
        # and the node made it; the node side makes it when missing.
        flags = os.O_RDWR | os.O_CREAT if op == fcntl.LOCK_EX else os.O_RDONLY
        if dir_fd is not None:
            fd = beneath.open_file(dir_fd, LEASE_NAME, flags, 0o666)
        else:
            opened = os.open(pool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fd = beneath.open_file(opened, LEASE_NAME, flags, 0o666)
            finally:
                os.close(opened)
        try:
            fcntl.flock(fd, op | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            holders = _count_holders(os.fstat(fd))
            os.close(fd)
            raise LeaseHeld(
                f"pool lease {path} is held by {holders or 'an'} attached engine{'s' if holders != 1 else ''}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, op == fcntl.LOCK_EX)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last fd of the open file drops the flock
            self.fd = -1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_holders(path: str | os.PathLike[str]) -> int:
    """Number of distinct processes holding a shared flock on ``path`` (from /proc/locks).

    This is how the node reports "engines attached" without any cooperation from engines.
    """
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    return _count_holders(st)


def _count_holders(st: os.stat_result) -> int:
    """``count_holders`` of the file ``st`` describes."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    try:
        with open("/proc/locks") as fh:
            for line in fh:
                parts = line.split()
                # "1: FLOCK  ADVISORY  READ 1234 00:1a:5678 0 EOF"; blocked waiters have "->"
                if len(parts) >= 6 and parts[1] == "FLOCK" and "->" not in parts[1:2]:
                    if parts[3] == "READ" and parts[5] == dev:
                        pids.add(parts[4])
    except OSError:
        return 0
    return len(pids)
