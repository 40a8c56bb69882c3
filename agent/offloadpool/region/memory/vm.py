"""Raw mmap/munmap/madvise through ctypes.

Why not the ``mmap`` module: CPython's ``mmap.madvise`` holds the GIL (so threads cannot
populate in parallel) and Python 3.11 lacks ``MADV_POPULATE_WRITE``; a ctypes call releases
the GIL for its whole duration, so W threads fault pages on W cores.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

from offloadpool.region.memory.libc import LIBC, MAP_FAILED

PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_SHARED = 0x01
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
MADV_REMOVE = 9  # free the range's pages of a shared file mapping (tmpfs, hugetlbfs)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


#: ``ioctl(/proc/self/pagemap, PAGEMAP_SCAN)`` (Linux >= 6.7): ``_IOWR('f', 16, pm_scan_arg)``.
PAGEMAP_SCAN = 0xC0606610
#: A page_region's category: mapped by a PMD-sized entry (a transparent huge page, or hugetlb).
PAGE_IS_HUGE = 1 << 6


class VMError(OSError):
    pass


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


def pmd_mapped_bytes(addr: int, length: int) -> int | None:
    """Bytes of [addr, addr+length) this process maps with PMD-sized entries; None where the
    kernel lacks ``PAGEMAP_SCAN`` (< 6.7).

    The same figure as the mapping's ``ShmemPmdMapped`` in ``/proc/self/smaps``, but the kernel
    walks the range a page table entry at a time (one per 2 MiB here) instead of visiting every
    4 KiB subpage of each huge page, as smaps does for a shared one: 1.5 ms against 22 ms for a
    4 GiB MemoryTHP mapping (10 ms when all of it is huge), which was 2-3 % of that pool's
    whole provision, at any size.
    """
    regions = (_PageRegion * 64)()
    total, start, end = 0, addr, addr + length
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        while start < end:
            arg = _ScanArg(
                size=ctypes.sizeof(_ScanArg),
                start=start,
                end=end,
                vec=ctypes.addressof(regions),
                vec_len=len(regions),
                category_mask=PAGE_IS_HUGE,
                return_mask=PAGE_IS_HUGE,
            )
            try:
                found = fcntl.ioctl(pagemap.fileno(), PAGEMAP_SCAN, arg)
            except OSError as exc:
                if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                    return None
                raise
            total += sum(r.end - r.start for r in regions[:found])
            if arg.walk_end <= start:  # no progress: never loop forever on a kernel's whim
                return None
            start = arg.walk_end
    return total


def map_shared(fd: int, length: int, offset: int = 0) -> int:
    """Map ``length`` bytes of ``fd`` read-write and shared; return the address."""
    addr = LIBC.mmap(None, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset)
    if addr in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise VMError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return addr


def unmap(addr: int, length: int) -> None:
    if LIBC.munmap(addr, length) != 0:
        err = ctypes.get_errno()
        raise VMError(err, f"munmap failed: {os.strerror(err)}")


def populate_write(addr: int, length: int) -> None:
    """Fault [addr, addr+length) in writable, allocating missing pages, without writing data.

    Pages already present keep their contents: this is why a resumed pre-fault can run over
    memory an engine may already have written.
    """
    for _ in range(100):
        if LIBC.madvise(addr, length, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):  # those two: simply try again
            break
    raise VMError(err, f"madvise(MADV_POPULATE_WRITE) failed: {os.strerror(err)}")


def remove(addr: int, length: int) -> None:
    """MADV_REMOVE: free the pages of [addr, addr+length) from the file (a punched hole);
    the next fault, or ``populate_write``, gets fresh pages the kernel has zeroed."""
    if LIBC.madvise(addr, length, MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        raise VMError(err, f"madvise(MADV_REMOVE) failed: {os.strerror(err)}")


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE): free a file range's pages, keep its size (the GIL is
    released for the call, unlike ``os.posix_fallocate``, which cannot punch at all)."""
    while LIBC.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise VMError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)}")


def allocate(fd: int, offset: int, length: int) -> None:
    """fallocate(KEEP_SIZE): give a file range its pages (the GIL is released for the call).

    On hugetlbfs the kernel takes each page from the huge page pool and clears it (the same
    work a write fault does, without a page table entry to set up or tear down); on tmpfs it
    only allocates, and the page is cleared at its first fault. Pages already there are
    left as they are, so this too never zeroes data.
    """
    while LIBC.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise VMError(err, f"fallocate failed: {os.strerror(err)}")


def touch_pages(addr: int, length: int, page: int) -> None:
    """Fallback for kernels without MADV_POPULATE_WRITE: write-fault every page by writing
    back the byte just read from it (one strided copy per call, in C).

    Rewriting the value read keeps whatever the page holds, so this too never zeroes data;
    it is only safe while nobody else writes the region, which the exclusive lease held by
    the pre-fault guarantees.
    """
    view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
    view[::page] = view[::page].tobytes()


def memset(addr: int, value: int, length: int) -> None:
    """libc memset (releases the GIL): the benchmark's zeroing limit, and one way to scrub."""
    LIBC.memset(addr, value, length)


def view(addr: int, length: int) -> memoryview:
    """A writable memoryview over raw mapped memory (valid until it is unmapped)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
