"""Mounted views of a pool: mounts in other mount namespaces that show its directory or memory.

Why this exists: a pod given a pool (a hostPath of ``<root>/<pool>``, a CSI or CDI bind of its
files) sees it through a mount in its own mount namespace. That mount is not a mapping, an open
file or a lease, so the ``/proc`` scan of ``holders`` did not see it; yet whatever the pool
directory or its memory holds next shows through it. A pod can stop its own lease sidecar, a
pod without admission has none, and a release, a consumer change or a re-created name then
handed the next tenant's memory to the old pod's mount. So a mounted view holds the pool like a
mapping does: release, reshape and scrub wait for it, and status counts it.

What the kernel shows: ``/proc/<pid>/mountinfo`` lists every mount of the process's mount
namespace (as seen from its root) with its device (decimal ``major:minor``) and its ``root``
field, the path within that file system of the directory the mount shows. A mount is a view of
the pool when it is

* a mount of the pool's own tmpfs/hugetlbfs (``<pool>/mnt``: its device, any root), or
* a mount of the file system holding ``<root>`` whose root is the pool directory's path within
  that file system, or a path beneath it (a bind of the directory, of ``mnt`` underneath, of a
  share's directory).

A root the kernel marks ``//deleted`` shows a directory that was removed: nothing of a pool made
since can appear in it, so it is no view. A pool directory moved aside (``places.set_aside``)
shows its new path, beneath the root-only ``.state``: no view of the pool made in its place.

The node's own namespaces are left out: a namespace with a mount of that file system whose root
is ``<root>``'s path or an ancestor of it sees every pool (the host, the agent, the CSI and DRA
plugins; the guard webhook refuses a pod any hostPath that reaches ``<root>`` other than exactly
``<root>/<pool>``), and so does this process's own.

Cost and bounds: one mountinfo read per distinct (mount namespace, root directory) among the
node's processes — keyed by both, because a process's mountinfo leaves out the mounts outside
its root (a pod could chroot its first process to hide its view). The table is searched for the
two devices as text (one regular expression, in C) before any line is looked at. A pod with
CAP_SYS_ADMIN can make as many mounts in its namespace as ``fs.mount-max`` allows: at most
``MAX_TABLE_BYTES`` of a table are read, and a namespace whose table is longer and shows no view
of all of ``<root>`` within them is taken as holding the pool, saying so (``Holder.unread``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

from offloadpool.region.files import beneath, places
from offloadpool.region.files.handle import PoolHandle
from offloadpool.region.files.manifest import MOUNT_NAME
from offloadpool.region.memory.mounts import mountinfo_escape

#: the most of one namespace's mount table read (about 20,000 mounts of typical length)
MAX_TABLE_BYTES = 4 << 20
#: the kernel's mark on a mount whose root directory was removed
_DELETED = b"//deleted"
#: a mountinfo line's device, root field and mount point
_MOUNT_LINE = re.compile(rb"^\d+ \d+ (\d+:\d+) (\S+) (\S+) ", re.M)


@dataclass(frozen=True)
class Target:
    """What a view of one pool looks like in a mount table (escaped as mountinfo writes it)."""

    dir_dev: bytes  # b"major:minor" of the file system holding <root>
    root_path: bytes  # <root>'s path within that file system
    pool_path: bytes  # <root>/<pool>'s path within it
    data_dev: bytes | None  # b"major:minor" of the pool's own mount; None without one


@dataclass(frozen=True)
class View:
    """One mount namespace (and root) that shows the pool: its processes, and whether its mount
    table was too long to read in full (then it is taken as holding, not known to)."""

    pids: tuple[int, ...]
    unread: bool = False


@dataclass
class _Snapshot:
    """The node's mount namespaces as one ``find`` saw them, for ``max_age`` callers to share:
    the processes grouped by namespace, and each namespace's table and ``<root>``'s place once
    read. Status reports the engines attached at every heartbeat of every pool; one snapshot
    serves them all for a few seconds (the simulated nodes of bench/scale.py, a thousand pools
    in one process, read every table once per window instead of once per pool and step)."""

    taken: float
    proc: str
    mine: str | None
    groups: dict[tuple[str, int, int], list[int]]
    pids: frozenset[int] = frozenset()
    tables: dict[tuple[str, int, int], tuple[bytes, bool] | None] = field(default_factory=dict)
    where: dict[str, tuple[bytes, bytes] | None] = field(default_factory=dict)
    #: this process's own mount table (``own_mounts``), read once per snapshot
    mounts: dict[bytes, tuple[bytes, bytes]] | None = None

    def where_of(self, root: str) -> tuple[bytes, bytes] | None:
        """``_where`` of ``root``, from this process's table as the snapshot first read it."""
        if root not in self.where:
            if self.mounts is None:
                self.mounts = own_mounts()
            self.where[root] = _where(root, self.mounts)
        return self.where[root]


_snapshot: _Snapshot | None = None
_snapshot_lock = threading.Lock()


def _dev(st_dev: int) -> bytes:
    return f"{os.major(st_dev)}:{os.minor(st_dev)}".encode()


def _ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, deepest first (``/a/b`` -> ``/a/b``, ``/a``, ``/``)."""
    out = [path]
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


def own_mounts() -> dict[bytes, tuple[bytes, bytes]]:
    """This process's mount table by mount point (as mountinfo spells it): the device and root
    field of the topmost mount there (the last listed: mounted over the others). Empty without
    procfs."""
    try:
        with open("/proc/self/mountinfo", "rb") as fh:
            table = fh.read()
    except OSError:
        return {}
    return {m.group(3): (m.group(1), m.group(2)) for m in _MOUNT_LINE.finditer(table)}


def _where(root: str, mounts: dict[bytes, tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
    """The device and the path within its file system of the directory ``root``, from this
    process's mount table ``mounts`` (``own_mounts``): the topmost mount at the deepest mount
    point above ``root`` (its root field, plus the rest of the path). None when no mount
    contains it (no procfs)."""
    for point in _ancestors(root):
        found = mounts.get(os.fsencode(mountinfo_escape(point)))
        if found is not None:
            dev, top = found
            if top.endswith(_DELETED):
                return None
            rest = os.path.relpath(root, point)
            top_text = os.fsdecode(top)
            inside = top_text if rest == "." else os.path.join(top_text, mountinfo_escape(rest))
            return dev, os.fsencode(os.path.normpath(inside))
    return None


def target(pool: PoolHandle, snapshot: _Snapshot) -> Target | None:
    """What a view of ``pool`` looks like; None when it has no directory (nothing to view) or
    the file system holding the root cannot be told. Where ``<root>`` is comes from
    ``snapshot`` (and is kept in it)."""
    try:
        pool_st = os.fstat(pool.fd)
    except (FileNotFoundError, places.UnsafeEntry):
        return None
    where = snapshot.where_of(os.path.realpath(pool.root))
    if where is None:
        return None
    dir_dev, root_path = where
    pool_path = os.path.join(root_path, os.fsencode(mountinfo_escape(pool.name)))
    data_dev = None
    try:
        mnt = beneath.open_dir(pool.fd, MOUNT_NAME)
    except OSError:  # none, or a name of the wrong kind: no mount a pod could see
        mnt = None
    if mnt is not None:
        try:
            st = os.fstat(mnt)
        finally:
            os.close(mnt)
        if st.st_dev != pool_st.st_dev:  # a mount point: the pool's own memory
            data_dev = _dev(st.st_dev)
    return Target(dir_dev, root_path, pool_path, data_dev)


def _within(path: bytes, top: bytes) -> bool:
    """Whether ``path`` is ``top`` or beneath it."""
    return path == top or path.startswith(top.rstrip(b"/") + b"/")


def judge(table: bytes, want: Target) -> str | None:
    """What a mount table says about the pool: ``"node"`` (it sees all of ``<root>``),
    ``"view"`` (it shows the pool), or None (neither)."""
    devs = [want.dir_dev] + ([want.data_dev] if want.data_dev else [])
    pattern = rb"^\d+ \d+ (" + b"|".join(re.escape(d) for d in devs) + rb") (\S+) "
    view = False
    for m in re.finditer(pattern, table, re.M):
        dev, root = m.group(1), m.group(2)
        if root.endswith(_DELETED):
            continue  # a removed directory: nothing made since shows in it
        if dev == want.dir_dev and _within(want.root_path, root):
            return "node"
        if dev == want.data_dev or (dev == want.dir_dev and _within(root, want.pool_path)):
            view = True  # the rest may still show all of <root>: read on
    return "view" if view else None


def _read_table(proc: str, pid: int) -> tuple[bytes, bool]:
    """The process's mount table, at most ``MAX_TABLE_BYTES`` (whole lines), and whether that
    was all of it."""
    with open(f"{proc}/{pid}/mountinfo", "rb") as fh:
        table = fh.read(MAX_TABLE_BYTES + 1)
    if len(table) <= MAX_TABLE_BYTES:
        return table, True
    return table[: table.rfind(b"\n", 0, MAX_TABLE_BYTES) + 1], False


def _namespaces(proc: str, pids: list[int]) -> dict[tuple[str, int, int], list[int]]:
    """The processes by (mount namespace, root directory); ones that vanish are left out."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for pid in pids:
        try:
            ns = os.readlink(f"{proc}/{pid}/ns/mnt")
            st = os.stat(f"{proc}/{pid}/root")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited, or not ours to read (a kernel thread's root is the host's)
        groups.setdefault((ns, st.st_dev, st.st_ino), []).append(pid)
    return groups


def own_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None


def process_ids(proc: str) -> list[int]:
    """Every process ``proc`` lists."""
    try:
        return [int(p) for p in os.listdir(proc) if p.isdigit()]
    except FileNotFoundError:
        return []


def _snapshot_for(proc: str, pids: list[int] | None, max_age: float) -> _Snapshot:
    """A snapshot of the node's namespaces no older than ``max_age`` (0: a new one, unshared);
    ``pids``: the processes to group (None: every one of ``proc``)."""
    global _snapshot

    listed = process_ids(proc) if pids is None else pids
    if max_age <= 0:
        return _Snapshot(time.monotonic(), proc, own_namespace(), _namespaces(proc, listed))
    now_pids = frozenset(listed)
    with _snapshot_lock:
        now = time.monotonic()
        held = _snapshot
        if held is None or held.proc != proc or now - held.taken > max_age:
            held = _Snapshot(now, proc, own_namespace(), _namespaces(proc, listed), now_pids)
        elif held.pids != now_pids:
            # processes came or went: group only the new ones, drop the gone ones (and the
            # tables of namespaces left with none), so a pod that started or left shows at once
            groups = {
                key: kept
                for key, members in held.groups.items()
                if (kept := [pid for pid in members if pid in now_pids])
            }
            for key, members in _namespaces(proc, sorted(now_pids - held.pids)).items():
                groups[key] = groups.get(key, []) + members
            tables = dict(held.tables)  # a copy in one step: other threads may be adding to it
            for key in [k for k in tables if k not in groups]:
                del tables[key]
            held = _Snapshot(held.taken, proc, held.mine, groups, now_pids, tables, held.where, held.mounts)
        _snapshot = held
        return held


def _table(snapshot: _Snapshot, key: tuple[str, int, int], members: list[int]) -> tuple[bytes, bool] | None:
    """The namespace's mount table as the first of its processes that can still be read shows
    it (kept in the snapshot); None when none can."""
    if key in snapshot.tables:
        return snapshot.tables[key]
    read = None
    for pid in members:
        try:
            read = _read_table(snapshot.proc, pid)
            break
        except OSError:  # gone, not ours to read, or leaving (EINVAL): the next may speak
            continue
    snapshot.tables[key] = read
    return read


def find(
    pool: PoolHandle, pids: list[int] | None, proc: str = "/proc", *, max_age: float = 0.0
) -> list[View]:
    """The namespaces among ``pids`` (of ``proc``; None: all) that show ``pool`` and are not the
    node's.

    ``max_age``: the namespaces and their tables may be a snapshot that old, shared by every
    caller in this process; for a report (the engines attached), never for a decision —
    release, reshape and scrub read the tables afresh (the default)."""
    snapshot = _snapshot_for(proc, pids, max_age)
    want = target(pool, snapshot)
    if want is None:
        return []
    found: list[View] = []
    for key, members in snapshot.groups.items():
        if key[0] == snapshot.mine:
            continue
        read = _table(snapshot, key, members)
        if read is None:
            continue
        table, whole = read
        said = judge(table, want)
        if said == "view" or (said is None and not whole):
            found.append(View(tuple(members), unread=said is None))
    return found
