"""Target paths: where the kubelet asks for a pod's inline volume, and how it is reached.

The kubelet publishes an inline CSI volume of a pod at exactly
``<kubelet>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount``: it makes the
parent, the plugin makes ``mount``. Any other path is refused, and the pod uid in it must be
the pod the volume context names, so one pod's publish can never mount into another's
directory, nor anywhere else on the node.

What is assumed of the kubelet's directory: the kubelet and root write it; a pod sees its
volumes' contents, never the directories above them. It is still walked as if hostile
(``beneath``: no symbolic link followed at any component, the kubelet's directory itself being
the administrator's path), because a link there would turn a bind mount into a mount over any
directory of the node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.files import beneath

MOUNT_NAME = "mount"
CSI_PLUGIN_DIR = "kubernetes.io~csi"
#: a pod's uid (a UUID; a static pod's is a hash): what may be a directory name
POD_UID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")
#: a pod's volume name, like a namespace's, is a DNS-1123 label
DNS_LABEL_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class Target:
    kubelet_dir: str
    pod_uid: str
    volume_name: str

    @property
    def parent(self) -> str:
        """The directory the kubelet made, relative to its own directory."""
        return f"pods/{self.pod_uid}/volumes/{CSI_PLUGIN_DIR}/{self.volume_name}"

    @property
    def path(self) -> str:
        return f"{self.kubelet_dir}/{self.parent}/{MOUNT_NAME}"


def parse(kubelet_dir: str, target_path: object) -> Target:
    """The target ``target_path`` names; ValueError saying why it is none."""
    if not isinstance(target_path, str) or not target_path:
        raise ValueError("target_path is required")
    base = os.path.normpath(kubelet_dir)
    prefix = f"{base}/pods/"
    if not target_path.startswith(prefix):
        raise ValueError(f"target_path {target_path!r} is not under {prefix}")
    names = target_path[len(prefix) :].split("/")
    if len(names) != 5 or names[1:3] != ["volumes", CSI_PLUGIN_DIR] or names[4] != MOUNT_NAME:
        rule = f"{prefix}<pod uid>/volumes/{CSI_PLUGIN_DIR}/<volume>/{MOUNT_NAME}"
        raise ValueError(f"target_path {target_path!r} is not {rule}")
    if not POD_UID_PATTERN.fullmatch(names[0]):
        raise ValueError(f"target_path {target_path!r}: {names[0]!r} is not a pod uid")
    if not DNS_LABEL_PATTERN.fullmatch(names[3]):
        raise ValueError(f"target_path {target_path!r}: {names[3]!r} is not a volume name")
    return Target(base, names[0], names[3])


@contextmanager
def parent_fd(target: Target) -> Iterator[int]:
    """A descriptor of the target's parent, reached without following a link (``WrongEntry``
    names the component that is one; FileNotFoundError when the kubelet has not made it)."""
    kubelet = os.open(target.kubelet_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = beneath.open_dir(kubelet, target.parent)
    finally:
        os.close(kubelet)
    try:
        yield fd
    finally:
        os.close(fd)


def file_id(dirfd: int, name: str = MOUNT_NAME) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``name`` itself in ``dirfd`` (a link is not followed); None if absent."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def as_path(fd: int, name: str = "") -> Path:
    """The ``/proc/self/fd`` path of a descriptor (and a name in it) for calls that take paths."""
    return Path(f"/proc/self/fd/{fd}") / name if name else Path(f"/proc/self/fd/{fd}")
