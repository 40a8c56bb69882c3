"""Names under a directory, opened without ever following a symbolic link (standard library only).

Why this exists: a pod is given its pool's directory read-write, so every name in it (the lease,
the manifest, ``mnt`` and the files in it) may have been replaced by a symbolic link, a fifo, a
device node or a hard link to something else by the time the node side, running as root, opens
it. A path-based ``open``/``chown``/``chmod`` would then act on whatever the link points at,
anywhere on the node. Everything here starts from a directory file descriptor the caller trusts
and resolves the rest of the name beneath it:

* ``openat2(2)`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` where the
  kernel has it (Linux 5.6+; probed once, ``ENOSYS``/``EPERM`` from a seccomp filter mean "no"),
  through ctypes' ``syscall`` because Python has no binding;
* else a walk of one ``openat(O_NOFOLLOW | O_DIRECTORY)`` per directory component, which refuses
  a symbolic link at every step just the same.

The last component is then looked at (``fstatat`` without following) before it is opened, and
opened with ``O_NOFOLLOW | O_NONBLOCK`` (a fifo must not block the opener) and checked again on
the descriptor: a name of the wrong type, or a file with a link count other than expected, raises
:class:`WrongEntry` and is never opened for writing. Ownership and modes are then set on the
descriptor (``fchown``/``fchmod``), never by name. Removal and renames use ``unlinkat``/
``renameat``, which act on the name itself, never on what a link points at.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager

RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
#: openat2's number is the same on every architecture (new system calls share one table)
SYS_OPENAT2 = 437
#: what a caller may read back from a file it trusts only after checking (manifest, record)
MAX_READ = 1 << 20

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
#: None: not probed yet; tests set False to run the O_NOFOLLOW walk on a kernel that has openat2
_use_openat2: bool | None = None


class WrongEntry(OSError):
    """A name is not what the caller needs (a link, a fifo, a device, another file's hard link).

    ``name`` is relative to the directory the caller started from; ``reason`` says what it is.
    """

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(errno.ELOOP, f"{name} {reason}")
        self.name = name
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.name} {self.reason}"


def parts(rel: str) -> list[str]:
    """The components of ``rel``; anything that could leave the directory is refused."""
    out = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in out):
        raise ValueError(f"{rel!r} is not a plain relative name")
    return out


def kind(mode: int) -> str:
    """What a file of ``mode`` is, as a message says it."""
    for test, what in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a fifo"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return what
    return "of an unknown type"


def has_openat2() -> bool:
    """Whether this kernel (and any seccomp filter in front of it) serves openat2; probed once."""
    global _use_openat2
    if _use_openat2 is None:
        how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE)
        fd = _libc.syscall(SYS_OPENAT2, -100, b".", ctypes.byref(how), ctypes.sizeof(how))  # AT_FDCWD
        if fd >= 0:
            os.close(fd)
            _use_openat2 = True
        else:
            _use_openat2 = ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM)
    return _use_openat2


def _refusal(rel: str, err: int, dirfd: int | None = None) -> OSError:
    """The error for an open of ``rel`` that failed with ``err``: for a link or a non-directory
    on the way, a WrongEntry naming the first component that is not a directory, and what it is."""
    if err not in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
        return OSError(err, os.strerror(err), rel)
    names = rel.split("/")
    if dirfd is not None:
        for i in range(len(names)):
            here = "/".join(names[: i + 1])
            try:  # every component before this one is a directory, not a link: nothing followed
                mode = os.stat(here, dir_fd=dirfd, follow_symlinks=False).st_mode
            except OSError:
                break
            if not stat.S_ISDIR(mode):
                return WrongEntry(
                    here, f"is {kind(mode)}" + (f" (on the way to {rel})" if here != rel else "")
                )
    if err == errno.ENOTDIR:
        return WrongEntry(rel, "passes through something that is not a directory")
    return WrongEntry(rel, "is or passes through a symbolic link")


def _openat2(dirfd: int, rel: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE)
    fd = _libc.syscall(SYS_OPENAT2, dirfd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        raise _refusal(rel, ctypes.get_errno(), dirfd)
    return int(fd)


def open_dir(dirfd: int, rel: str) -> int:
    """A new descriptor of the directory ``rel`` beneath ``dirfd``; a link anywhere is refused."""
    names = parts(rel)
    if has_openat2():
        return _openat2(dirfd, rel, _DIR_FLAGS, 0)
    fd = os.dup(dirfd)
    try:
        for i, name in enumerate(names):
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal("/".join(names[: i + 1]), exc.errno or 0, dirfd) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def parent(dirfd: int, rel: str) -> Iterator[tuple[int, str]]:
    """The directory holding ``rel``'s last component (opened beneath ``dirfd``) and that name."""
    names = parts(rel)
    if len(names) == 1:
        yield dirfd, names[0]
        return
    fd = open_dir(dirfd, "/".join(names[:-1]))
    try:
        yield fd, names[-1]
    finally:
        os.close(fd)


def lstat(dirfd: int, rel: str) -> os.stat_result | None:
    """``rel`` itself (never what a link points at); None when it does not exist."""
    with parent(dirfd, rel) as (pfd, name):
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return None


def _check(rel: str, st: os.stat_result, links: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise WrongEntry(rel, f"is {kind(st.st_mode)}, not a regular file")
    if links is not None and st.st_nlink > links:
        raise WrongEntry(rel, f"has {st.st_nlink} hard links, at most {links} expected")


def open_file(
    dirfd: int, rel: str, flags: int = os.O_RDONLY, mode: int = 0o600, *, links: int | None = 1
) -> int:
    """Open the regular file ``rel`` beneath ``dirfd`` (``O_CREAT`` in ``flags`` creates it).

    Refuses (``WrongEntry``) a name that is anything but a regular file, or a regular file with
    more than ``links`` hard links (None: any count), before opening it and again on the open
    descriptor. A file created here gets ``mode`` as the umask leaves it: callers set the mode
    they want with ``fchmod`` on the descriptor.
    """
    with parent(dirfd, rel) as (pfd, name):
        try:
            before: os.stat_result | None = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            before = None
            if not flags & os.O_CREAT:
                raise
        if before is not None:
            _check(rel, before, links)
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=pfd)
        except OSError as exc:
            raise _refusal(rel, exc.errno or 0, dirfd) from None
    try:
        st = os.fstat(fd)
        _check(rel, st, links)
        if before is not None and (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise WrongEntry(rel, "was replaced while it was being opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(dirfd: int, rel: str, limit: int = MAX_READ) -> bytes:
    """The content of the regular, singly linked file ``rel``, refused beyond ``limit`` bytes."""
    fd = open_file(dirfd, rel)
    try:
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise WrongEntry(rel, f"holds more than {limit} bytes")
    return b"".join(chunks)


def write_file(dirfd: int, rel: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``rel`` atomically: a new temp file beside it (``O_EXCL``), fsync, ``renameat``.

    Whatever stood at ``rel`` (a link included) is replaced as a name, never written through;
    a reader sees the old file or the new one, never half of one.
    """
    with parent(dirfd, rel) as (pfd, name):
        while True:
            tmp = f".{name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=pfd)
                break
            except FileExistsError:
                continue
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException:
            unlink(pfd, tmp)
            raise
        os.fsync(pfd)


def mkdir(dirfd: int, rel: str, mode: int = 0o755) -> bool:
    """Make the directory ``rel`` (its parent must exist); False when the name exists already."""
    with parent(dirfd, rel) as (pfd, name):
        try:
            os.mkdir(name, mode, dir_fd=pfd)
        except FileExistsError:
            return False
    return True


def unlink(dirfd: int, rel: str) -> bool:
    """Remove the name ``rel`` (any type but a directory); False when there was none."""
    with parent(dirfd, rel) as (pfd, name):
        try:
            os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            return False
    return True


def rmdir(dirfd: int, rel: str) -> bool:
    """Remove the empty directory ``rel``; False when there was none (OSError ENOTEMPTY if full)."""
    with parent(dirfd, rel) as (pfd, name):
        try:
            os.rmdir(name, dir_fd=pfd)
        except FileNotFoundError:
            return False
    return True


def link(dirfd: int, src: str, dst: str) -> None:
    """Hard-link the file ``src`` as ``dst`` (both beneath ``dirfd``; ``src`` never followed)."""
    with parent(dirfd, src) as (sfd, sname), parent(dirfd, dst) as (dfd, dname):
        os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)


def listdir(dirfd: int, rel: str | None = None) -> list[str]:
    """The names in the directory ``rel`` beneath ``dirfd`` (``dirfd`` itself when None)."""
    if rel is None:
        return os.listdir(dirfd)
    fd = open_dir(dirfd, rel)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)
