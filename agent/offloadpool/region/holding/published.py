"""Volumes the CSI node plugin published from a pool, and DRA claims the DRA plugin prepared
from it: ``<root>/.state/<pool>/csi/<volume>.json``, one record for both deliveries.

A pod given a pool through a ``csi`` volume holds it from the kubelet's ``NodePublishVolume``
until its ``NodeUnpublishVolume``, whether or not its engine maps the memory yet. The plugin
writes a record here before it bind-mounts the pool and drops it after the unmount, so a record
exists whenever a mount may; ``holders`` counts each record as a holder, and release, reshaping
and deletion wait for it as for a process. Root-only like the rest of the state directory (a pod
that could write it could free the pool under another pod, or keep it forever).

A DRA claim's record (``offloadpool.dra``) is the same record: ``volume_id`` ``dra-<claim uid>``
(``dra_volume_id``; the kubelet names an inline volume ``csi-<hash>``), ``pod_uid`` the owner
its share is reserved under (``shares.claim_owner``), ``pod_namespace`` and ``pod_name`` the
claim's, ``target_path`` the directory its tree is bound in. Each plugin's restart settles its
own records (``is_dra``) and keeps the other's.

Standard library only: the engine's ``holders`` reads it. Every record is parsed strictly; one
that is not a record is still a holder (``UNREADABLE``): the node side never frees memory on the
word of a file it cannot read.
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import asdict, dataclass, fields

from offloadpool.region.files import beneath, bounded, places
from offloadpool.region.files.handle import Pool, given
from offloadpool.region.request import MAX_PARTITIONS

DIR_NAME = "csi"
DIR_MODE = 0o700
SUFFIX = ".json"
#: the kubelet names an inline volume ``csi-<sha256>``; anything a file name can hold safely
VOLUME_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: the volume id of a DRA claim's record: ``dra-<claim uid>``
DRA_PREFIX = "dra-"


def dra_volume_id(claim_uid: str) -> str:
    """The record's name for the DRA claim ``claim_uid``."""
    return f"{DRA_PREFIX}{claim_uid}"


@dataclass(frozen=True)
class Published:
    """One volume of the pool, bind-mounted at ``target_path`` for the pod ``pod_uid``."""

    volume_id: str
    pod_uid: str
    pod_namespace: str
    target_path: str
    #: the pod's name as the kubelet gave it (``podInfoOnMount``); "" in a record written
    #: without it, which still parses
    pod_name: str = ""
    #: the share of a partitioned pool the pod was given (``region.holding.shares``); None: the pool
    share: int | None = None

    @property
    def is_dra(self) -> bool:
        """A DRA claim's record (the DRA plugin's), not a csi volume's."""
        return self.volume_id.startswith(DRA_PREFIX)

    def describe(self) -> str:
        """``csi volume csi-1a2b of pod team-a/engine-0 (uid 5f0c…)``: the pod by name, as
        ``kubectl`` shows it, and by uid, which the name may be reused after; and its share."""
        share = "" if self.share is None else f" (share {self.share})"
        if self.is_dra:
            uid = self.volume_id.removeprefix(DRA_PREFIX)
            return f"DRA claim {self.pod_namespace}/{self.pod_name} (uid {uid}){share}"
        if self.pod_name:
            pod = f"{self.pod_namespace}/{self.pod_name} (uid {self.pod_uid})"
            return f"csi volume {self.volume_id} of pod {pod}{share}"
        return f"csi volume {self.volume_id} of pod {self.pod_namespace}/{self.pod_uid}{share}"


def volume_id_error(volume_id: object) -> str | None:
    """Why ``volume_id`` cannot name a record (it becomes a file name), or None."""
    if not isinstance(volume_id, str) or not VOLUME_ID_PATTERN.fullmatch(volume_id):
        return f"volume_id {volume_id!r} must be 1-128 letters, digits, '.', '_', '-', from a letter or digit"
    if volume_id.endswith(".tmp"):
        return f"volume_id {volume_id!r} must not end in .tmp"
    return None


def _parse(data: bytes) -> Published | None:
    try:
        doc = bounded.loads(data)
    except bounded.Malformed:
        return None
    optional = {"pod_name", "share"}
    names = [f.name for f in fields(Published)]
    required = [n for n in names if n not in optional]
    if not isinstance(doc, dict) or not set(required) <= set(doc) <= set(names):
        return None
    strings = [v for k, v in doc.items() if k != "share"]
    if not all(isinstance(v, str) for v in strings) or volume_id_error(doc["volume_id"]):
        return None
    share = doc.get("share")
    if share is not None and (type(share) is not int or not 0 <= share < MAX_PARTITIONS):
        return None
    return Published(**doc)


def _record_name(volume_id: str) -> str:
    error = volume_id_error(volume_id)
    if error:
        raise ValueError(error)
    return f"{DIR_NAME}/{volume_id}{SUFFIX}"


def save(pool: Pool, pub: Published) -> None:
    """Write the record atomically (made root-only with its directory)."""
    name = _record_name(pub.volume_id)
    with given(pool) as handle:
        fd = handle.state_fd()
        places.make_root_dir(fd, DIR_NAME, DIR_MODE)
        doc = asdict(pub)
        if pub.share is None:
            del doc["share"]  # a pool without shares: the record as it always was
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        beneath.write_file(fd, name, data, 0o600)


def drop(pool: Pool, volume_id: str) -> bool:
    """Remove the record (and the directory once empty); False when there was none."""
    name = _record_name(volume_id)
    with given(pool) as handle:
        fd = handle.state()
        if fd is None:
            return False
        try:
            gone = beneath.unlink(fd, name)
        except FileNotFoundError:  # no csi directory
            return False
        try:
            beneath.rmdir(fd, DIR_NAME)
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
        return gone


#: what a record that cannot be parsed reads as: still a holder, naming the file
UNREADABLE = "unreadable"


def load_all(pool: Pool) -> list[Published]:
    """Every volume published from the pool, by volume id; a file that is no record (or a name
    that is no regular file) is a holder all the same, with ``pod_uid`` ``UNREADABLE``."""
    out = []
    with given(pool) as handle:
        fd = handle.state()
        if fd is None:
            return []
        try:
            names = beneath.listdir(fd, DIR_NAME)
        except FileNotFoundError:
            return []
        for name in sorted(names):
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue  # a temp file of an atomic write in progress or left by a crash
            pub = None
            try:
                pub = _parse(beneath.read_file(fd, f"{DIR_NAME}/{name}"))
            except OSError:
                pass
            vid = name[: -len(SUFFIX)]
            if pub is None or pub.volume_id != vid:
                pub = Published(vid, UNREADABLE, UNREADABLE, "")
            out.append(pub)
    return out


def find(root: str | os.PathLike[str], volume_id: str) -> tuple[str, Published] | None:
    """(pool name, record) of the volume ``volume_id`` under ``root``, or None."""
    _record_name(volume_id)
    state = os.path.join(os.fspath(root), places.STATE_DIR_NAME)
    try:
        pools = sorted(os.listdir(state))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for pool in pools:
        try:
            pool_dir = places.pool_dir(root, pool)
        except ValueError:
            continue  # not a pool's state (the huge page intent, a temp file)
        for pub in load_all(pool_dir):
            if pub.volume_id == volume_id:
                return pool, pub
    return None
