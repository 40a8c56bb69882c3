"""Blocking host-wide locks between offloadpool processes (agents, the CLI, benchmarks).

flock, because the kernel drops it when its holder dies: a provision killed with -9 never
leaves the host locked, so no stale-lock recovery is needed.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def exclusive(path: str | os.PathLike[str], *, directory: bool = False) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` for the block, waiting for other holders.

    ``directory=True`` locks an existing directory (opened read-only); otherwise the lock file
    is created if missing.
    """
    if directory:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
