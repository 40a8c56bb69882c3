"""What a published volume shows at its target: the engine's files, each as writable as the
engine needs and no more, ``nosuid,nodev``; made and undone through descriptors.

The mount tree at ``<target>``::

    <target>          the pool directory, bound alone and read-only: manifest.json (read live,
                      so a withheld or rewritten manifest shows), lease (an engine flocks it
                      read-only), mnt
    <target>/mnt      the pool's own mount, bound alone and read-only: no name can be made,
                      renamed or removed in it (EROFS), nothing written to the node's disk
    <target>/mnt/<f>  each segment file, and each of stock vLLM's names of one, bound
                      read-write by itself: the engine opens and maps it read-write

A share of a partitioned pool (``region.holding.shares``) is published as a pool of its own: the top
is a small tmpfs the plugin makes, holding the share's manifest as a plain pool's (written at
publish: a share cannot be reshaped or withdrawn while a volume holds it), the pool's lease
(bound read-only, so the engine's flock is on the pool's lease) and ``mnt`` holding that
share's segments alone, each bound read-write; the whole tmpfs read-only::

    <target>          tmpfs, read-only: manifest.json (the share, as a plain pool), lease, mnt
    <target>/lease    the pool's lease, bound read-only
    <target>/mnt/<f>  each segment of the share, bound read-write (no other share's name is there)

So a pod, even one running as root, can write only the memory of its pool; the pool's
record, journal and holder records (``<root>/.state``) are never in it. The names bound are
the record's plan (what the node made), never the pool directory's listing (what a pod may
have written through a hostPath delivery). mount(2) takes paths; every path given to it here
is a ``/proc/self/fd`` path of something opened without following links, so neither the
pool's name nor the target can be swapped for a link between the check and the mount.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from offloadpool.csi import faults
from offloadpool.csi.target import MOUNT_NAME, as_path, file_id
from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME
from offloadpool.region.files.manifest import MOUNT_NAME as MOUNT_DIR
from offloadpool.region.memory.mounts import MNT_DETACH, MS_NODEV, MS_NOSUID, MS_REC, UMOUNT_NOFOLLOW

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_PRIVATE = 1 << 18
#: what ``state`` finds at a target
NONE, PARTIAL, COMPLETE = "none", "partial", "complete"
#: the target directory the plugin makes, if the kubelet has not
TARGET_MODE = 0o750
#: the tmpfs a share's view is made on: a manifest and empty names to bind over
SHARE_TREE_OPTIONS = b"size=4m,mode=0755"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise RegionError(f"mount {source or ''} {target} (flags {flags:#x}) failed: {os.strerror(err)}")


def _opened(dirfd: int, name: str) -> int:
    """An ``O_PATH`` descriptor of the regular file ``name`` itself in ``dirfd`` (no link)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RegionError(f"{name} is not a regular file: not bound")
    return fd


def _id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def _read_only(fd: int) -> bool:
    return bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)


def _remount(parent: int, name: str, flags: int) -> None:
    """Set a bind's flags (a bind takes none of its own) on the mount now at ``name`` in
    ``parent``, reached again through its name: the new mount, not the one under it."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        _mount(None, str(as_path(fd)), MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | flags)
    finally:
        os.close(fd)


def state(pool: PoolHandle, parent: int, files: list[str]) -> str:
    """``NONE`` when the pool directory is not bound at ``MOUNT_NAME`` in ``parent``,
    ``COMPLETE`` when the whole tree is (read-only where it should be, each file read-write),
    ``PARTIAL`` otherwise (a plugin killed while binding)."""
    if file_id(parent) != _id(pool.fd):
        return NONE
    try:
        with _dir(pool.fd, MOUNT_DIR) as pool_mnt:
            top = beneath.open_dir(parent, MOUNT_NAME)
            try:
                if not _read_only(top):
                    return PARTIAL
                with _dir(top, MOUNT_DIR) as mnt:
                    if _id(mnt) != _id(pool_mnt) or not _read_only(mnt):
                        return PARTIAL
                    for name in files:
                        fd, want = _opened(mnt, name), _opened(pool_mnt, name)
                        try:
                            if _id(fd) != _id(want) or _read_only(fd):
                                return PARTIAL
                        finally:
                            os.close(fd)
                            os.close(want)
            finally:
                os.close(top)
    except (OSError, RegionError, beneath.WrongEntry):
        return PARTIAL
    return COMPLETE


@contextmanager
def _dir(dirfd: int, name: str) -> Iterator[int]:
    fd = beneath.open_dir(dirfd, name)
    try:
        yield fd
    finally:
        os.close(fd)


def prepare_stage(stage: str) -> None:
    """Make ``stage`` a fresh private tmpfs (what a plugin killed before left there detached,
    with the pool mounts it held): a tree is built there, out of every peer group, before it is
    bound at a target. At the plugin's start."""
    os.makedirs(stage, mode=0o700, exist_ok=True)
    path = os.fsencode(stage)
    while _libc.umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW) == 0:
        pass
    if _libc.mount(b"offloadpool-csi-stage", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0700") != 0:
        err = ctypes.get_errno()
        raise RegionError(f"mounting the plugin's staging tmpfs at {stage} failed: {os.strerror(err)}")
    _mount(None, stage, MS_PRIVATE)


def _bind_private(source: int, parent: int, name: str, flags: int) -> None:
    """Bind ``source`` at ``name`` in ``parent``, take the new mount out of the source's peer
    group (a pool's mount is shared: what is mounted beneath a peer would appear in the pool's
    own mount), then set its flags (a bind takes none of its own)."""
    target = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        _mount(str(as_path(source)), str(as_path(target)), MS_BIND)
    finally:
        os.close(target)
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        _mount(None, str(as_path(fd)), MS_PRIVATE)
    finally:
        os.close(fd)
    _remount(parent, name, flags)


@contextmanager
def _staged(stage: str, name: str, parent: int) -> Iterator[int]:
    """The private ``stage`` (its descriptor) with the directory ``name`` made in it, for the
    caller to build a tree at; once built, bound whole (``MS_REC``) at ``MOUNT_NAME`` in
    ``parent`` in one mount(2), so the target never holds half a tree and, the kubelet's
    directory being shared with the host, the host gets the whole tree at once. The target is
    undone on any failure; the staged tree is always detached and removed."""
    stage_fd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        beneath.mkdir(stage_fd, name, 0o700)
        try:
            yield stage_fd
            beneath.mkdir(parent, MOUNT_NAME, TARGET_MODE)
            with _dir(stage_fd, name) as tree, _dir(parent, MOUNT_NAME) as target:
                _mount(str(as_path(tree)), str(as_path(target)), MS_BIND | MS_REC)
            faults.reached(faults.BOUND)
        except BaseException:
            unbind(parent)
            raise
        finally:
            _libc.umount2(os.fsencode(as_path(stage_fd, name)), MNT_DETACH | UMOUNT_NOFOLLOW)
            beneath.rmdir(stage_fd, name)
    finally:
        os.close(stage_fd)


def bind(pool: PoolHandle, parent: int, files: list[str], stage: str, name: str) -> None:
    """Make the tree the module docstring shows at ``MOUNT_NAME`` in the directory ``parent``,
    ``files`` the names in the pool's mount to bind read-write. Built at ``name`` in the private
    ``stage`` and bound whole at the target (``_staged``)."""
    with _staged(stage, name, parent) as stage_fd:
        with _dir(pool.fd, MOUNT_DIR) as pool_mnt:
            _bind_private(pool.fd, stage_fd, name, MS_RDONLY)
            faults.reached(faults.STAGED)
            with _dir(stage_fd, name) as top:
                _bind_private(pool_mnt, top, MOUNT_DIR, MS_RDONLY)
                with _dir(top, MOUNT_DIR) as mnt:
                    for file in files:
                        source = _opened(pool_mnt, file)
                        try:
                            os.close(_opened(mnt, file))  # a regular file there too
                            _bind_private(source, mnt, file, 0)
                        finally:
                            os.close(source)


def unbind(parent: int) -> bool:
    """Detach the bind at ``MOUNT_NAME`` in ``parent`` with everything under it; False when
    nothing is mounted there, or there is no ``MOUNT_NAME`` (a DRA claim's directory made by a
    plugin killed before it bound anything). Detached (``MNT_DETACH``): the tree's binds go with
    its top (a plain unmount of the top refuses while it has a child); the last component is
    never followed (``UMOUNT_NOFOLLOW``)."""
    path = os.fsencode(as_path(parent, MOUNT_NAME))
    if _libc.umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):  # not a mount point; not there at all
            return False
        raise RegionError(f"umount of a published volume failed: {os.strerror(err)}")
    return True


def remove_target(parent: int) -> None:
    """Remove the (empty, unmounted) target directory, as the kubelet expects of the plugin."""
    try:
        beneath.rmdir(parent, MOUNT_NAME)
    except OSError:
        pass  # not empty or not a directory: not the plugin's to remove


def share_state(pool: PoolHandle, parent: int, files: list[str]) -> str:
    """As ``state``, for a share's tree (``bind_share``): ``NONE`` when nothing is mounted at
    ``MOUNT_NAME`` in ``parent``, ``COMPLETE`` when the share's tree is, whole (read-only,
    the pool's lease, exactly ``files`` in ``mnt``, each the pool's file, read-write)."""
    try:
        here = os.stat(MOUNT_NAME, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return NONE
    if here.st_dev == os.fstat(parent).st_dev:
        return NONE  # a directory, not a mount point
    try:
        with _dir(pool.fd, MOUNT_DIR) as pool_mnt:
            with _dir(parent, MOUNT_NAME) as top, _dir(top, MOUNT_DIR) as mnt:
                if not _read_only(top) or sorted(beneath.listdir(mnt)) != sorted(files):
                    return PARTIAL
                pairs = [(_opened(top, LEASE_NAME), _opened(pool.fd, LEASE_NAME), True)]
                pairs += [(_opened(mnt, n), _opened(pool_mnt, n), False) for n in files]
                try:
                    for fd, want, ro in pairs:
                        if _id(fd) != _id(want) or _read_only(fd) != ro:
                            return PARTIAL
                finally:
                    for fd, want, _ in pairs:
                        os.close(fd)
                        os.close(want)
                os.close(_opened(top, MANIFEST_NAME))
    except (OSError, RegionError, beneath.WrongEntry):
        return PARTIAL
    return COMPLETE


def bind_share(
    pool: PoolHandle, parent: int, files: list[str], manifest: bytes, stage: str, name: str
) -> None:
    """Make the share's tree the module docstring shows at ``MOUNT_NAME`` in ``parent``:
    ``manifest`` its manifest, ``files`` the names in the pool's mount of its segments. Built
    in the private ``stage`` on a tmpfs of its own and bound whole, as ``bind`` does."""
    with _staged(stage, name, parent) as stage_fd:
        where = os.fsencode(as_path(stage_fd, name))
        if _libc.mount(b"offloadpool-csi-share", where, b"tmpfs", MS_NOSUID | MS_NODEV, SHARE_TREE_OPTIONS):
            err = ctypes.get_errno()
            raise RegionError(f"mounting a share's tree in {stage} failed: {os.strerror(err)}")
        with _dir(pool.fd, MOUNT_DIR) as pool_mnt:
            with _dir(stage_fd, name) as top:
                beneath.write_file(top, MANIFEST_NAME, manifest, 0o644)
                _place(top, LEASE_NAME)
                lease = _opened(pool.fd, LEASE_NAME)
                try:
                    _bind_private(lease, top, LEASE_NAME, MS_RDONLY)
                finally:
                    os.close(lease)
                faults.reached(faults.STAGED)
                beneath.mkdir(top, MOUNT_DIR, 0o755)
                with _dir(top, MOUNT_DIR) as mnt:
                    for file in files:
                        source = _opened(pool_mnt, file)
                        try:
                            _place(mnt, file)
                            _bind_private(source, mnt, file, 0)
                        finally:
                            os.close(source)
            _remount(stage_fd, name, MS_RDONLY)


def _place(dirfd: int, name: str) -> None:
    """An empty file ``name`` in ``dirfd`` (the share's own tmpfs) for a file to be bound over."""
    os.close(
        os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd
        )
    )
