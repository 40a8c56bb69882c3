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
directories is reached through ``beneath`` (directory descriptors, no link ever followed).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
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


def _open_root(pool: Path) -> int:
    return os.open(pool.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


@contextmanager
def pool_fd(pool: str | os.PathLike[str]) -> Iterator[int]:
    """A descriptor of the pool directory (FileNotFoundError when there is none).

    The host root is followed as a path (the administrator's); the pool's own name never is.
    """
    pool = Path(pool)
    root = _open_root(pool)
    try:
        fd = beneath.open_dir(root, pool.name)
    except beneath.WrongEntry as exc:
        raise UnsafeEntry(pool.parent, exc) from None
    finally:
        os.close(root)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def state_fd(pool: str | os.PathLike[str], *, create: bool = False) -> Iterator[int | None]:
    """A descriptor of the pool's state directory; None when it does not exist and ``create``
    is false (the root itself missing included). Made root-only when created or opened to write."""
    pool = Path(pool)
    try:
        root = _open_root(pool)
    except FileNotFoundError:
        if not create:
            yield None
            return
        raise
    try:
        try:
            if create:
                for rel in (STATE_DIR_NAME, f"{STATE_DIR_NAME}/{pool.name}"):
                    make_root_dir(root, rel, STATE_DIR_MODE)
            fd = beneath.open_dir(root, f"{STATE_DIR_NAME}/{pool.name}")
        except FileNotFoundError:
            fd = -1
        except beneath.WrongEntry as exc:
            raise UnsafeEntry(pool.parent, exc) from None
    finally:
        os.close(root)
    if fd < 0:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def make_root_dir(dirfd: int, rel: str, mode: int) -> None:
    """Make ``rel`` (or keep it) a directory owned by root with exactly ``mode``, by descriptor."""
    beneath.mkdir(dirfd, rel, mode)
    fd = beneath.open_dir(dirfd, rel)
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs(pool: str | os.PathLike[str]) -> None:
    """Create (or re-own) the pool's directory and its state directory.

    The pool directory is root's, 0755, whatever a pod did to it: a consumer that is not root
    can then neither create nor replace a name in it."""
    pool = Path(pool)
    pool.parent.mkdir(parents=True, exist_ok=True)
    root = _open_root(pool)
    try:
        try:
            make_root_dir(root, pool.name, POOL_DIR_MODE)
        except beneath.WrongEntry as exc:
            raise UnsafeEntry(pool.parent, exc) from None
    finally:
        os.close(root)
    with state_fd(pool, create=True):
        pass


def exists(pool: str | os.PathLike[str]) -> bool:
    """Whether the pool has a directory or a state directory (a link there is neither)."""
    pool = Path(pool)
    try:
        root = _open_root(pool)
    except FileNotFoundError:
        return False
    try:
        for rel in (pool.name, f"{STATE_DIR_NAME}/{pool.name}"):
            try:
                st = beneath.lstat(root, rel)
            except (beneath.WrongEntry, FileNotFoundError):
                continue
            if st is not None:
                return True
        return False
    finally:
        os.close(root)


@contextmanager
def lock(pool: str | os.PathLike[str]) -> Iterator[None]:
    """Serialise the provisions and releases of one pool: an flock on its state directory.

    The state directory, not the pool directory: a pod can open its pool directory and flock
    it, which would stop the node side. A release removes the directory it locked: a waiter that
    then gets the lock finds its descriptor no longer linked at the path and locks anew.
    """
    pool = Path(pool)
    while True:
        with state_fd(pool, create=True) as fd:
            if fd is None:  # removed between its making and its opening: make it again
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                now = os.stat(state_dir(pool), follow_symlinks=False)
            except FileNotFoundError:
                continue
            mine = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                continue
            yield
            return


def busy(pool: str | os.PathLike[str]) -> bool:
    """True while a provision or release holds the pool's lock."""
    with state_fd(pool) as fd:
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True


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


def exists_pool_dir(pool: str | os.PathLike[str]) -> bool:
    """Whether the pool directory itself is there (a link there is not)."""
    pool = Path(pool)
    try:
        st = os.stat(pool, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode)
