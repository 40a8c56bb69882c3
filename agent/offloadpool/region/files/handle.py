"""One open pool: what an operation on a pool resolves once and hands down.

Why: an operation on a pool (a provision, a scrub, a release, a status read, a publish) touches
a dozen names of it. Resolving ``<root>/<pool>`` by name at each step let the pool change under
the operation between two steps (a release removing it and a provision making it again, a name
swapped meanwhile: a pod can replace names in its pool directory, and anything that can write the
root can swap the pool's own name) and cost an open per step. So an operation opens the pool
once (``open_pool``): the host root, the pool directory and its state directory as descriptors,
and, when asked, the pool's lock; it hands that object down, and everything below goes through
the descriptors (``beneath``). The path is kept for messages and for the kernel's mount table,
which names mounts by path.

The lock is the one step that looks at the names again, by design: a release removes the state
directory it locked, so a waiter that gets the lock checks that its descriptor is still the one
at the name, and when it is not (the pool was released, and perhaps made again, meanwhile) takes
the pool anew, both directories, before anything is done under the lock.

Entry points that callers outside an operation use with a path (``records.load(pool_dir)``, the
tests, the engine's tools) take ``Pool``, a handle or a path, and open a path once (``given``).
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeAlias

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, places
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME, Manifest, load_at

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: how a line of ``left`` begins when the pool directory was moved, not left in place
SET_ASIDE = "set aside: "


class PoolHandle:
    """One pool, resolved once: the host root, the pool directory and the state directory as
    descriptors (either directory None while it does not exist), and whether this operation
    holds the pool's lock. Closed by ``open_pool``; never shared between operations."""

    def __init__(self, path: Path) -> None:
        #: ``<root>/<pool>``: for messages and the mount table only, never opened again
        self.path = path
        self.name = path.name
        self.root = path.parent
        self._root: int | None = None
        self._fd: int | None = None
        self._fd_error: beneath.WrongEntry | None = None
        self._state: int | None = None
        self._state_error: beneath.WrongEntry | None = None
        self._locked = False

    def __repr__(self) -> str:
        return f"<PoolHandle {self.path} fd={self._fd} state={self._state} locked={self._locked}>"

    # -- resolving, once ---------------------------------------------------------------------

    def _open(self) -> None:
        """Resolve the pool: the host root as a path (the administrator's), the pool's names
        beneath it without following a link. A directory of the wrong kind is remembered and
        raised (``UnsafeEntry``) by whatever needs that directory."""
        try:
            self._root = os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            return
        self._fd, self._fd_error = self._lookup(self.name)
        self._state, self._state_error = self._lookup(self._state_rel)

    def _lookup(self, rel: str) -> tuple[int | None, beneath.WrongEntry | None]:
        """``rel`` beneath the root: its descriptor, or None and why (None: it is not there)."""
        assert self._root is not None
        try:
            return beneath.open_dir(self._root, rel), None
        except FileNotFoundError:
            return None, None
        except beneath.WrongEntry as exc:
            return None, exc

    def _reopen(self) -> None:
        """Take the pool anew (the lock found it released meanwhile)."""
        self._close_dirs()
        self._fd_error = self._state_error = None
        if self._root is not None:
            os.close(self._root)
            self._root = None
        self._open()

    def _close_dirs(self) -> None:
        for fd in (self._fd, self._state):
            if fd is not None:
                os.close(fd)
        self._fd = self._state = None

    def close(self) -> None:
        self._close_dirs()
        if self._root is not None:
            os.close(self._root)
            self._root = None

    @property
    def _state_rel(self) -> str:
        return f"{places.STATE_DIR_NAME}/{self.name}"

    # -- what an operation reads ---------------------------------------------------------------

    @property
    def fd(self) -> int:
        """The pool directory's descriptor. FileNotFoundError when there is none, UnsafeEntry
        when its name is of the wrong kind (a link, a file)."""
        if self._fd_error is not None:
            raise places.UnsafeEntry(self.root, self._fd_error)
        if self._fd is None:
            raise FileNotFoundError(errno.ENOENT, "no pool directory", str(self.path))
        return self._fd

    def state(self, *, create: bool = False) -> int | None:
        """The state directory's descriptor; None when there is none and ``create`` is false.
        Made root-only (``.state`` with it) when it is made here. UnsafeEntry when its name
        is of the wrong kind."""
        if self._state_error is not None:
            raise places.UnsafeEntry(self.root, self._state_error)
        if self._state is None and create:
            root = self._root_fd(create=True)
            while self._state is None:
                places.make_root_dir(root, places.STATE_DIR_NAME, places.STATE_DIR_MODE)
                try:
                    self._state = _made_dir(root, self._state_rel, places.STATE_DIR_MODE)
                except FileNotFoundError:  # removed between its making and its opening
                    continue
                except beneath.WrongEntry as exc:
                    raise places.UnsafeEntry(self.root, exc) from None
        return self._state

    def state_fd(self) -> int:
        """The state directory's descriptor, made when missing (a writer's)."""
        fd = self.state(create=True)
        assert fd is not None
        return fd

    @property
    def locked(self) -> bool:
        """Whether this operation holds the pool's lock now."""
        return self._locked

    def has_dir(self) -> bool:
        """Whether the pool directory is there (one of the wrong kind is not): the descriptor
        held, still linked (a removed directory has no links)."""
        return self._fd is not None and _linked(self._fd)

    def exists(self) -> bool:
        """Whether the pool has a directory or a state directory (still linked), or a name of
        the wrong kind where one belongs (taken apart, or refused, by whoever finds it)."""
        if self._fd_error is not None or self._state_error is not None:
            return True
        return self.has_dir() or (self._state is not None and _linked(self._state))

    def read_manifest(self) -> Manifest:
        """The pool's manifest (``manifest.load``, beneath the pool directory)."""
        try:
            fd: int | None = self.fd
        except (FileNotFoundError, places.UnsafeEntry):
            fd = None
        return load_at(fd, self.path)

    def write_manifest(self, manifest: Manifest) -> Path:
        """Write ``manifest`` atomically in the pool directory (``Manifest.write``)."""
        data = manifest.encode()  # validated before anything is written
        beneath.write_file(self.fd, MANIFEST_NAME, data, 0o644)
        return self.path / MANIFEST_NAME

    def rel(self, name: str) -> Path:
        """``<pool>/<name>`` as a path, for a message or the mount table."""
        return self.path / name

    # -- making and removing the directories ---------------------------------------------------

    def _root_fd(self, *, create: bool = False) -> int:
        if self._root is None:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            self._root = os.open(self.root, _ROOT_FLAGS)
        return self._root

    def make_dirs(self) -> None:
        """Create (or re-own) the pool's directory and its state directory.

        The pool directory is root's, 0755, whatever a pod did to it: a consumer that is not
        root can then neither create nor replace a name in it. A directory this handle holds is
        re-owned through its descriptor; one it does not is made and opened, once."""
        root = self._root_fd(create=True)
        if self._fd is None or self._fd_error is not None:
            try:
                fd = _made_dir(root, self.name, places.POOL_DIR_MODE)
            except beneath.WrongEntry as exc:
                raise places.UnsafeEntry(self.root, exc) from None
            if self._fd is not None:
                os.close(self._fd)
            self._fd, self._fd_error = fd, None
        else:
            _own(self._fd, places.POOL_DIR_MODE)
        if self._state is None:
            self.state(create=True)
        else:
            places.make_root_dir(root, places.STATE_DIR_NAME, places.STATE_DIR_MODE)
            _own(self._state, places.STATE_DIR_MODE)

    def remove_dirs(self, left: list[str] | None) -> None:
        """rmdir the pool directory, its state directory and (when no other pool's is in it)
        ``.state``, by name beneath the host root: a directory cannot be removed through its
        descriptor. A pool directory that is not empty is set aside (``retire_dir``); a state
        directory that is not empty is left. Both are said in ``left``. Set-aside directories
        of this pool that are empty by now are removed; the others are named in ``left``."""
        if self._root is None:
            return
        if self._fd is None:
            _rmdir(self._root, self.root, self.name, left)  # made since this handle looked
        else:
            self._sweep_set_aside(left)  # those of earlier pools of this name
            if _linked(self._fd):
                try:
                    self.retire_dir(left)
                except RegionError as exc:  # the memory is freed all the same: said, not raised
                    if left is not None:
                        left.append(str(exc))
        _rmdir(self._root, self.root, self._state_rel, left)
        for rel in (places.LEFT_DIR, places.STATE_DIR_NAME):  # shared by every pool
            try:
                _rmdir(self._root, self.root, rel, None)
            except OSError:
                pass

    def retire_dir(self, left: list[str] | None) -> None:
        """Remove the pool directory, or, when it is not empty, set it aside
        (``places.set_aside``): the pool's name is free afterwards either way, so whatever is
        made under it next is a new directory, which no mount of the old one shows. Raises
        RegionError when a directory that is not empty cannot be set aside: used again, it
        would hand the next pool to whoever kept a mount of it."""
        assert self._root is not None
        held = os.fstat(self.fd)
        try:
            beneath.rmdir(self._root, self.name)
            return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
        names = sorted(beneath.listdir(self.fd))
        shown = f"{names[:8]}{' ...' if len(names) > 8 else ''}"
        try:
            new = places.set_aside(self._root, self.root, self.name, held)
        except OSError as exc:
            raise RegionError(
                f"{self.path} still holds {shown} (not made by offloadpool) and cannot be set "
                f"aside ({exc}): it is never used for a pool again; remove it by hand"
            ) from None
        if left is not None:
            left.append(
                f"{SET_ASIDE}{self.path} still held {shown} (not made by offloadpool): moved to "
                f"{new}, out of every pod's reach; a pool made under this name gets a new directory"
            )

    def renew_dir(self, left: list[str] | None = None) -> None:
        """Replace the pool directory with a new, empty one (``retire_dir``, then made again);
        the lease name goes first (a caller holding the lease keeps its descriptor)."""
        places.remove_entry(self.fd, LEASE_NAME)
        self.retire_dir(left)
        assert self._fd is not None and self._root is not None
        os.close(self._fd)
        self._fd = None
        self._fd = _made_dir(self._root, self.name, places.POOL_DIR_MODE)

    def _sweep_set_aside(self, left: list[str] | None) -> None:
        """Remove this pool's set-aside directories that are empty now; name the others."""
        assert self._root is not None
        kept = []
        for name in places.set_aside_of(self._root, self.name):
            try:
                beneath.rmdir(self._root, f"{places.LEFT_DIR}/{name}")
            except OSError:  # a pod's files are still in it (never removed recursively)
                kept.append(str(self.root / places.LEFT_DIR / name))
        if kept and left is not None:
            left.append(
                f"{len(kept)} director{'ies' if len(kept) > 1 else 'y'} set aside from earlier pools "
                f"named {self.name} still hold a pod's files: {', '.join(kept)}; remove them once no "
                "pod uses them"
            )

    # -- the pool's lock -----------------------------------------------------------------------

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Serialise the provisions and releases of one pool: an flock on its state directory.

        The state directory, not the pool directory: a pod can open its pool directory and
        flock it, which would stop the node side. A release removes the directory it locked:
        a waiter that then gets the lock finds its descriptor no longer linked at the name and
        takes the pool anew (``_reopen``). Held already by this operation: nothing more."""
        if self._locked:
            yield
            return
        while True:
            fd = self.state_fd()
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self._still_named(fd):
                break
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._reopen()
        self._locked = True
        try:
            yield
        finally:
            self._locked = False
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _still_named(self, fd: int) -> bool:
        assert self._root is not None
        try:
            now = os.stat(self._state_rel, dir_fd=self._root, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def busy(self) -> bool:
        """True while a provision or release holds the pool's lock (another operation's: the
        test takes a description of its own of the state directory, never this handle's)."""
        if self._state is None:
            return False
        probe = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._state)
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(probe)


#: what an entry point takes: an operation's handle, or a pool's path (opened once for the call)
Pool: TypeAlias = "PoolHandle | str | os.PathLike[str]"


@contextmanager
def open_pool(
    pool: str | os.PathLike[str], *, create: bool = False, lock: bool = False
) -> Iterator[PoolHandle]:
    """The pool at ``pool`` (``<root>/<name>``, a checked name), resolved once for one
    operation; ``create`` makes its directories first (``make_dirs``), ``lock`` holds its lock
    for the whole block (which makes the state directory). Closed on the way out."""
    handle = PoolHandle(Path(pool))
    try:
        handle._open()
        if create:
            handle.make_dirs()
        if lock:
            with handle.lock():
                yield handle
        else:
            yield handle
    finally:
        handle.close()


@contextmanager
def given(pool: Pool) -> Iterator[PoolHandle]:
    """``pool`` itself when it is a handle (an operation hands it down), else the pool at that
    path opened once for the caller: an entry point's one resolution."""
    if isinstance(pool, PoolHandle):
        yield pool
        return
    with open_pool(pool) as handle:
        yield handle


def path_of(pool: Pool) -> Path:
    """The pool's path, for a message."""
    return pool.path if isinstance(pool, PoolHandle) else Path(pool)


def _linked(fd: int) -> bool:
    return os.fstat(fd).st_nlink > 0


def _own(fd: int, mode: int) -> None:
    os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)


def _made_dir(root: int, rel: str, mode: int) -> int:
    """``places.make_root_dir`` of ``rel`` beneath ``root``, returning its descriptor (opened
    once: the one the handle keeps)."""
    beneath.mkdir(root, rel, mode)
    fd = beneath.open_dir(root, rel)
    try:
        _own(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmdir(root_fd: int, root: Path, rel: str, left: list[str] | None) -> None:
    """rmdir ``rel`` under the host root; a directory that is not empty is left, and said."""
    try:
        beneath.rmdir(root_fd, rel)
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        if left is not None:
            names = sorted(beneath.listdir(root_fd, rel))
            left.append(f"{root / rel} still holds {names} (not made by offloadpool): left in place")
