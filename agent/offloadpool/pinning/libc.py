"""The few libc calls the helper needs that Python's ``mmap`` module does not offer.

``mmap.mmap`` cannot map at a chosen address (no ``MAP_FIXED``), so a region split over
several segment files could not be laid out back to back in one contiguous range; and it has
no ``mlock``. These thin ctypes wrappers raise ``OSError`` with the real errno.
"""

from __future__ import annotations

import ctypes
import mmap as _mmap
import os

from offloadpool.region.memory.libc import LIBC, MAP_FAILED

PROT_NONE = 0
PROT_READ = _mmap.PROT_READ
PROT_WRITE = _mmap.PROT_WRITE
MAP_SHARED = _mmap.MAP_SHARED
MAP_PRIVATE = _mmap.MAP_PRIVATE
MAP_ANONYMOUS = _mmap.MAP_ANONYMOUS
# Same values on x86_64 and aarch64 (asm-generic/mman-common.h, asm-generic/mman.h).
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MADV_POPULATE_WRITE = 23  # Linux 5.14; Python 3.11's mmap module lacks the constant

PAGE_SIZE = _mmap.PAGESIZE


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def mmap(addr: int, length: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """``mmap(2)``; returns the address."""
    res = LIBC.mmap(addr or None, length, prot, flags, fd, offset)
    if res is None or res == MAP_FAILED:
        _raise(f"mmap({addr:#x}, {length})")
    return int(res)


def munmap(addr: int, length: int) -> None:
    if LIBC.munmap(addr, length) != 0:
        _raise(f"munmap({addr:#x}, {length})")


def mlock(addr: int, length: int) -> None:
    if LIBC.mlock(addr, length) != 0:
        _raise(f"mlock({addr:#x}, {length})")


def munlock(addr: int, length: int) -> None:
    if LIBC.munlock(addr, length) != 0:
        _raise(f"munlock({addr:#x}, {length})")


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)`` through ctypes, which releases the GIL (``mmap.madvise`` holds it)."""
    if LIBC.madvise(addr, length, advice) != 0:
        _raise(f"madvise({addr:#x}, {length}, {advice})")
