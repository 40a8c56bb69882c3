"""The bind mount of a pool at a target, ``nosuid,nodev``, made and undone through descriptors.

What is bound is the pool directory, recursively: the engine attaches through exactly what is
in it (``manifest.json`` to find the segments, ``lease`` to hold the pool, ``mnt/`` — the pool's
own mount, hence the recursive bind — with the segment files and any compat names), the same
directory a hostPath delivery gives. mount(2) takes paths; every path given to it here is a
``/proc/self/fd`` path of a directory opened without following links, so neither the pool's
name nor the target can be swapped for a link between the check and the mount.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from offloadpool.csi.target import MOUNT_NAME, as_path
from offloadpool.region import beneath, places
from offloadpool.region.errors import RegionError
from offloadpool.region.mounts import MNT_DETACH, MS_NODEV, MS_NOSUID, MS_REC, UMOUNT_NOFOLLOW

MS_REMOUNT = 0x20
MS_BIND = 0x1000
#: the target directory the plugin makes, if the kubelet has not
TARGET_MODE = 0o750

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str | None, target: str, flags: int) -> None:
    if _libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise RegionError(f"mount {source or ''} {target} (flags {flags:#x}) failed: {os.strerror(err)}")


def pool_id(pool_dir: str | os.PathLike[str]) -> tuple[int, int]:
    """(st_dev, st_ino) of the pool directory: what the target shows once bound."""
    with places.pool_fd(pool_dir) as fd:
        st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def bind(pool_dir: str | os.PathLike[str], parent: int) -> None:
    """Bind the pool directory at ``MOUNT_NAME`` in the directory ``parent``, then remount the
    bind ``nosuid,nodev`` (a bind takes no such flags of its own). Undone on failure."""
    beneath.mkdir(parent, MOUNT_NAME, TARGET_MODE)
    target = beneath.open_dir(parent, MOUNT_NAME)  # a link there is refused, not mounted over
    try:
        with places.pool_fd(pool_dir) as source:
            _mount(str(as_path(source)), str(as_path(target)), MS_BIND | MS_REC)
    finally:
        os.close(target)
    try:
        mounted = beneath.open_dir(parent, MOUNT_NAME)  # now the bind's root
        try:
            _mount(None, str(as_path(mounted)), MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV)
        finally:
            os.close(mounted)
    except BaseException:
        unbind(parent)
        raise


def unbind(parent: int) -> bool:
    """Detach the bind at ``MOUNT_NAME`` in ``parent`` with everything under it; False when
    nothing is mounted there. Detached (``MNT_DETACH``), because the bind carries the pool's
    own ``mnt`` mount beneath it and a plain unmount of the top refuses while it has a child;
    the last component is never followed (``UMOUNT_NOFOLLOW``)."""
    path = os.fsencode(as_path(parent, MOUNT_NAME))
    if _libc.umount2(path, MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        if err == 22:  # EINVAL: not a mount point
            return False
        raise RegionError(f"umount of a published volume failed: {os.strerror(err)}")
    return True


def remove_target(parent: int) -> None:
    """Remove the (empty, unmounted) target directory, as the kubelet expects of the plugin."""
    try:
        beneath.rmdir(parent, MOUNT_NAME)
    except OSError:
        pass  # not empty or not a directory: not the plugin's to remove
