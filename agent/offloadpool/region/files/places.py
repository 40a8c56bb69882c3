"""Where a pool lives on the node, and which of it the node side may trust.

Two directories per pool under the host root::

    <root>/<pool>/          given to pods (hostPath): manifest.json, lease, mnt/ and its files.
                            root-owned 0755, so a consumer that is not root cannot replace a name
                            in it; one that is root can, so every name in it is hostile input.
    <root>/.state/<pool>/   root-only (0700, in a 0700 ``.state``): what the node side must
                            trust: the provisioning record and the populate journal (and their
                            temp files). No pod is ever given it: ``.state`` is no pool name.

A pool directory that a release cannot remove (a pod left files in it) is moved aside, out of
every pod's reach, to ``<root>/.state/.left/<pool>.<time>.<random>`` (``set_aside``): a pod
that kept a mount of it sees only what it left there, never a pool made under the name later.
``.left`` is no pool name either.

The host root itself is the administrator's and is trusted as a path; a pool's name is checked
(``names.pool_name_error``) before any path is made of it; everything below the pool's two
directories is reached through ``beneath`` (directory descriptors, no link ever followed),
from the descriptors one operation holds (``handle.PoolHandle``: the pool resolved once, its
lock with it).
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from pathlib import Path

from offloadpool.region.errors import RegionError, RequestError
from offloadpool.region.files import beneath
from offloadpool.region.files.names import pool_name_error

STATE_DIR_NAME = ".state"
POOL_DIR_MODE = 0o755
STATE_DIR_MODE = 0o700
#: beneath ``.state``: pool directories set aside (``set_aside``), root-only like it
LEFT_DIR_NAME = ".left"
LEFT_DIR = f"{STATE_DIR_NAME}/{LEFT_DIR_NAME}"
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


def set_aside(root_fd: int, root: Path, name: str, expect: os.stat_result) -> Path:
    """Move the directory ``name`` beneath the host root (``root_fd``) to ``.state/.left``
    under a name of its own, ``<name>.<UTC time>.<random>``; return its new path.

    Why: a directory given to pods that release could not remove holds a pod's files, and a pod
    may keep a mount of it. Used again for the next pool of that name, it would show that pool's
    manifest, lease and memory to whoever kept the mount. Moved into the root-only ``.state``,
    it is out of reach of any path a pod can be given, and its mounts (which follow the
    directory, not its name) show only what was left in it. ``expect``: the directory as the
    caller holds it (``fstat`` of its descriptor); a name that no longer is that directory is
    refused (``beneath.WrongEntry``), never moved. Raises OSError when it cannot be moved (the
    name is a mount point, ``.state`` is on another file system).
    """
    make_root_dir(root_fd, STATE_DIR_NAME, STATE_DIR_MODE)
    make_root_dir(root_fd, LEFT_DIR, STATE_DIR_MODE)
    left_fd = beneath.open_dir(root_fd, LEFT_DIR)
    try:
        now = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (expect.st_dev, expect.st_ino):
            raise beneath.WrongEntry(name, "is no longer the directory being set aside")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        while True:
            new = f"{name}.{stamp}.{secrets.token_hex(4)}"
            if beneath.lstat(left_fd, new) is None:  # renameat would replace an empty directory
                break
        os.rename(name, new, src_dir_fd=root_fd, dst_dir_fd=left_fd)
    finally:
        os.close(left_fd)
    return root / LEFT_DIR / new


def set_aside_of(root_fd: int, name: str) -> list[str]:
    """The directories set aside for the pool ``name`` (names in ``.state/.left``)."""
    try:
        return sorted(n for n in beneath.listdir(root_fd, LEFT_DIR) if n.startswith(f"{name}."))
    except (FileNotFoundError, beneath.WrongEntry):
        return []
