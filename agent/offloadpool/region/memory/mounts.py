"""Mounting a pool's own tmpfs/hugetlbfs, through mount(2)/umount2(2) via ctypes.

A dedicated mount per pool gives the pool its own size limit (tmpfs ``size=``), its own huge
page reservation (hugetlbfs ``min_size=``), and makes release a single unmount that frees
every page, whatever files an engine may have left behind. The mount is made a shared peer
so that pods which see the host root with ``mountPropagation: HostToContainer`` see it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.errors import CapacityError, RegionError

MS_REC = 0x4000
MS_SHARED = 1 << 20
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@dataclass(frozen=True)
class MountInfo:
    target: str
    fstype: str
    source: str
    options: str  # per-superblock options (size=, pagesize=, huge=, ...)
    propagation: str  # e.g. "shared:42" or ""


def mountinfo_escape(path: str) -> str:
    """A path as mountinfo writes it: space, tab, newline and backslash as octal."""
    for char, code in (("\\", "\\134"), (" ", "\\040"), ("\t", "\\011"), ("\n", "\\012")):
        path = path.replace(char, code)
    return path


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _parse(lines: Iterable[str]) -> list[MountInfo]:
    out = []
    for line in lines:
        left, _, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if len(lf) < 5 or len(rf) < 3:
            continue
        out.append(MountInfo(_unescape(lf[4]), rf[0], _unescape(rf[1]), rf[2], " ".join(lf[6:])))
    return out


def mounts() -> list[MountInfo]:
    with open("/proc/self/mountinfo") as fh:
        return _parse(fh)


def mount_at(path: str | os.PathLike[str]) -> MountInfo | None:
    """The topmost mount whose target is exactly ``path`` (None if it is not a mount point).

    The table is searched for the path as mountinfo writes it before any line is parsed: a
    node's table holds a mount or more per container (and, in the scale test, a pool per
    simulated node), and the agent asks about its one mount point several times a step.
    """
    target = _resolved(path)
    with open("/proc/self/mountinfo") as fh:
        table = fh.read()
    escaped = mountinfo_escape(target)
    if f" {escaped} " not in table:
        return None
    found = None
    for m in _parse(line for line in table.splitlines() if f" {escaped} " in line):
        if m.target == target:
            found = m
    return found


def _resolved(path: str | os.PathLike[str]) -> str:
    """``path`` with its directory resolved and its last name kept as it is: a link a pod put
    at a pool's ``mnt`` names the link, never the mount it points at (``/dev/shm``, say)."""
    head, tail = os.path.split(os.path.normpath(os.fspath(path)))
    return os.path.join(os.path.realpath(head), tail) if tail else os.path.realpath(head)


def _open_target(target: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """The directory ``target`` (its last name never followed), for mount(2) through
    ``/proc/self/fd``: the pool's ``mnt`` may have been replaced by a link to anywhere. With
    ``dir_fd`` (the directory holding it, opened by the caller), only its last name is looked
    up, beneath that descriptor: ``target`` then names it in messages."""
    name: str | os.PathLike[str] = target if dir_fd is None else os.path.basename(os.fspath(target))
    try:
        return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise RegionError(
            f"mount point {target} is not a directory reached without a link: {exc.strerror}"
        ) from None


def mounts_under(path: str | os.PathLike[str]) -> list[MountInfo]:
    root = os.path.realpath(path).rstrip("/") + "/"
    return [m for m in mounts() if (m.target + "/").startswith(root)]


def mount(
    fstype: str,
    target: str | os.PathLike[str],
    options: str,
    source: str = "offloadpool",
    *,
    dir_fd: int | None = None,
) -> None:
    """mount(2) ``fstype`` at ``target`` with ``options``, then make it a shared peer.

    The mount is made on the directory opened without following its last name (by its
    ``/proc/self/fd`` path), so a link standing at ``target`` is refused, not mounted over.
    ``dir_fd``: the directory holding ``target``, already open (``_open_target``)."""
    fd = _open_target(target, dir_fd)
    try:
        rc = _libc.mount(
            source.encode(),
            f"/proc/self/fd/{fd}".encode(),
            fstype.encode(),
            MS_NOSUID | MS_NODEV,
            options.encode(),
        )
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if rc != 0:
        if err == errno.ENOSPC:
            raise mount_limit_error(target)
        raise RegionError(f"mount -t {fstype} -o {options} {target} failed: {os.strerror(err)} (errno {err})")
    try:
        make_shared(target, dir_fd=dir_fd)
    except RegionError:
        umount(target)
        raise


def mount_limit_error(target: str | os.PathLike[str]) -> CapacityError:
    """mount(2)'s ENOSPC: the mount namespace holds ``fs.mount-max`` mounts already.

    The kernel counts a namespace's mounts as it adds one, so the refusal itself is the check:
    counting them first meant reading the whole mount table at every provision (a line per
    container mount on a node, a pool per simulated node in the scale test: 1 ms per thousand),
    and that count could be stale by the time of the mount. The table is read here only to
    put the numbers in the message."""
    try:
        limit = Path("/proc/sys/fs/mount-max").read_text().strip()
        used = str(Path("/proc/self/mountinfo").read_text().count("\n"))
    except OSError:
        limit = used = "?"
    return CapacityError(
        f"the pool needs its own mount at {target}, but this mount namespace already has {used} "
        f"mounts and fs.mount-max is {limit} (mount(2): ENOSPC); raise fs.mount-max or unmount "
        "what is no longer used"
    )


def make_shared(target: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Make the mount at ``target`` a shared peer (``mount --make-shared``).

    A separate step from mount(2): a process killed between the two leaves a private mount,
    which the next provision finds and makes shared here. ``dir_fd`` as for ``mount``.
    """
    fd = _open_target(target, dir_fd)
    try:
        rc = _libc.mount(None, f"/proc/self/fd/{fd}".encode(), None, MS_SHARED, None)
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if rc != 0:
        raise RegionError(f"making {target} a shared mount failed: {os.strerror(err)}")


def umount(target: str | os.PathLike[str], *, lazy: bool = False) -> None:
    """umount2(2); EINVAL (not mounted) is fine, anything else is an error naming the cause.

    ``UMOUNT_NOFOLLOW``: a link at ``target`` is not followed to unmount what it points at."""
    if _libc.umount2(os.fsencode(target), (MNT_DETACH if lazy else 0) | UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err == 22:  # EINVAL: not a mount point (already gone)
            return
        hint = " (a process still has files of this pool mapped or open)" if err == 16 else ""
        raise RegionError(f"umount {target} failed: {os.strerror(err)}{hint}")
