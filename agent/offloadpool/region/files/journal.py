"""The populate journal: which parts of a pool are already pre-faulted.

One byte per *unit* (max(page size, 2 MiB) of one segment file; the last unit of a file may be
shorter), in logical order over every segment of every region, stored in the pool's root-only
state directory (``<root>/.state/<pool>/populate.journal``, see ``places``): a journal a pod
could write would let it mark memory populated that is not, or point the node's writes
elsewhere. Workers set their units' bytes with ``pwrite`` as each chunk completes. A pre-fault
killed with SIGKILL leaves the journal in the page cache, so the next provision skips what was
done and populates only the rest. The journal may lag behind the memory (a chunk finished but
not yet recorded); redoing such a chunk is harmless because ``MADV_POPULATE_WRITE`` never
rewrites present pages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offloadpool.region.files import beneath, places
from offloadpool.region.files.handle import Pool, given, path_of
from offloadpool.region.files.manifest import Segment

JOURNAL_NAME = "populate.journal"
MIN_UNIT = 2 << 20


@dataclass(frozen=True)
class Unit:
    index: int  # position in the journal
    segment: int  # index into the plan's flat segment list
    offset: int  # within the segment file
    bytes: int


def unit_size(page_size: int) -> int:
    return max(page_size, MIN_UNIT)


def units(segments: list[Segment], page_size: int) -> list[Unit]:
    size = unit_size(page_size)
    out: list[Unit] = []
    for s, seg in enumerate(segments):
        for off in range(0, seg.bytes, size):
            out.append(Unit(len(out), s, off, min(size, seg.bytes - off)))
    return out


class Journal:
    """An open journal file; thread-safe because each worker writes only its own bytes."""

    def __init__(self, pool: Pool, count: int) -> None:
        self.path = places.state_dir(path_of(pool)) / JOURNAL_NAME
        self.count = count
        with given(pool) as handle:
            self.fd = beneath.open_file(handle.state_fd(), JOURNAL_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self.fd).st_size != count:
                os.ftruncate(self.fd, count)  # new units read as 0 (not populated)
        except BaseException:
            os.close(self.fd)
            raise

    def done(self) -> bytearray:
        data = bytearray(os.pread(self.fd, self.count, 0))
        data.extend(b"\0" * (self.count - len(data)))
        return data

    def mark(self, first: int, n: int) -> None:
        os.pwrite(self.fd, b"\1" * n, first)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def populated_bytes(pool: Pool, all_units: list[Unit]) -> int:
    """Bytes recorded as populated (0 if there is no journal, or it is not a plain file)."""
    try:
        with given(pool) as handle:
            state = handle.state()
            if state is None:
                return 0
            data = beneath.read_file(state, JOURNAL_NAME, limit=max(len(all_units), 1))
    except (OSError, places.UnsafeEntry):
        return 0
    return sum(u.bytes for u in all_units if u.index < len(data) and data[u.index])
