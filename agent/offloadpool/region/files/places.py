"""Where a pool lives on the node, and which of it the node side may trust.

Two directories per pool under the host root::

    <root>/<pool>/          given to pods (hostPath): manifest.json, lease, mnt/ and its files.
                            root-owned 0755, so a consumer that is not root cannot replace a name
                            in it; one that is root can, so every name in it is hostile input.
    <root>/.state/<pool>/   root-only (0700, in a 0700 ``.state``): what the node side must
                            trust: the provisioning record and the populate journal (and their
                            temp files). No pod is ever given it: ``.state`` is no pool name.

The host root itself is the administrator's and is trusted as a path; a pool's name is checked
(``names.pool_name_error``) before any path is made of it; everything below the pool's two
directories is reached through ``beneath`` (directory descriptors, no link ever followed),
from the descriptors one operation holds (``handle.PoolHandle``: the pool resolved once, its
lock with it).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from offloadpool.region.errors import RegionError, RequestError
from offloadpool.region.files import beneath
from offloadpool.region.files.names import pool_name_error

STATE_DIR_NAME = ".state"
POOL_DIR_MODE = 0o755
STATE_DIR_MODE = 0o700
#: Names an older offloadpool kept in the pool directory, where pods can write them: never read
#: as the node's own (``migrate`` re-validates an old record against the mount), then removed.
OLD_RECORD_NAME = "state.json"
OLD_JOURNAL_NAME = "populate.journal"


class UnsafeEntry(RegionError):
    """A name in a pool's directory is of the wrong type (a link, a fifo, a device, a file with
    other links, ...): never followed; the pool is rebuilt when nothing holds it, else Failed."""

    def __init__(self, pool_dir: str | os.PathLike[str], wrong: beneath.WrongEntry, more: str = "") -> None:
        self.entry = wrong.name
        self.reason = wrong.reason
        super().__init__(f"{Path(pool_dir) / wrong.name} {wrong.reason}: not followed{more}")


def checked_name(name: object) -> str:
    """``name`` if it can name a pool; RequestError (a ValueError) naming the rule otherwise."""
    error = pool_name_error(name)
    if error is not None:
        raise RequestError(error)
    assert isinstance(name, str)
    return name


def pool_dir(root: str | os.PathLike[str], name: object) -> Path:
    """``<root>/<name>``, only once ``name`` is a pool name: nothing else becomes a path."""
    return Path(root) / checked_name(name)


def state_dir(pool: str | os.PathLike[str]) -> Path:
    """``<root>/.state/<pool>`` for the pool directory ``<root>/<pool>``."""
    pool = Path(pool)
    return pool.parent / STATE_DIR_NAME / pool.name


def make_root_dir(dirfd: int, rel: str, mode: int) -> None:
    """Make ``rel`` (or keep it) a directory owned by root with exactly ``mode``, by descriptor."""
    beneath.mkdir(dirfd, rel, mode)
    fd = beneath.open_dir(dirfd, rel)
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def remove_entry(dirfd: int, rel: str) -> str | None:
    """Remove the name ``rel`` whatever it is (a link as a link); an empty directory too.

    None when it is gone (or was never there); otherwise why it was left (a non-empty
    directory is not emptied: what is in it was not made by the node side)."""
    try:
        beneath.unlink(dirfd, rel)
        return None
    except IsADirectoryError:
        pass
    except beneath.WrongEntry as exc:
        return str(exc)
    try:
        beneath.rmdir(dirfd, rel)
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            names = sorted(beneath.listdir(dirfd, rel))
            return f"{rel} is a directory holding {names[:8]}{' ...' if len(names) > 8 else ''}: left"
        return f"{rel}: {exc.strerror or exc}: left"
    return None
