"""Who holds a pool: every process on the node that maps or has open the pool's files, or
holds its lease — in any mount namespace, with or without the lease.

Why this exists: the lease (a shared flock) protects only engines that take it. Stock vLLM
takes no lock, and a pod sees the pool through a hostPath, i.e. a bind mount in its own mount
namespace. Unmounting the pool on the host then does not fail with EBUSY (the pod's mount keeps
the file system alive), so a release would "free" memory that the pod still uses, and a reshape
would build a second pool next to it. The kernel still knows who uses the files, though, and
tells the host through ``/proc``:

* ``/proc/<pid>/maps`` prints, for each file mapping, the file's device as hex ``major:minor``
  and its inode number;
* ``/proc/<pid>/fd/<n>`` resolves (``stat``) to the open file itself, wherever it was opened;
* ``/proc/locks`` lists flock holders by ``major:minor:inode`` and pid;
* ``/proc/<pid>/mountinfo`` lists the mounts of the process's mount namespace: a mount that
  shows the pool's directory or its memory is a holder too, mapped or not (``views``).

A bind mount shows the same device and inode as the original, so matching by (st_dev, st_ino)
— never by path, which differs in every mount namespace — finds holders in every namespace.
The pids are those of the pid namespace of the ``proc`` read: an agent must read the host's
``/proc`` (hostPID, or the host's procfs mounted somewhere and passed as ``proc``) to see
other pods' processes.

One pass over ``proc`` covers all of a pool's files. Processes come and go during the pass:
one that vanishes (or cannot be read) is skipped, which is right for a process that exited and
the best that can be done for one we may not inspect (the node side runs as root, which may).
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
from dataclasses import dataclass, replace

from offloadpool.region.files import beneath, places
from offloadpool.region.files.handle import Pool, PoolHandle, given
from offloadpool.region.files.manifest import LEASE_NAME, MOUNT_NAME
from offloadpool.region.holding import published, views
from offloadpool.region.holding.lease import Lease, LeaseHeld

FileId = tuple[int, int]  # (st_dev, st_ino)

#: fd link targets that are never a pool file: not worth a stat each
_NOT_FILES = ("socket:", "pipe:", "anon_inode:")
#: how many holders a message names before it says "and N more"
_NAMED = 5
#: how old the node's mount tables may be for ``count`` (a report, made at every heartbeat of
#: every pool: ``views.find``'s shared snapshot); release, reshape and scrub read them afresh
COUNT_VIEWS_MAX_AGE = 5.0
#: scans of every process made by this process (``scans()``; the tests' evidence of a skipped one)
_scans = 0


@dataclass(frozen=True)
class Holder:
    """One process that holds a pool, and how."""

    pid: int
    comm: str  # the command name (``/proc/<pid>/comm``), "?" if it could not be read
    mapped: bool = False  # maps one of the pool's files
    open: bool = False  # has one of the pool's files open
    lease: bool = False  # holds the pool's lease (shared flock)
    #: its mount namespace shows the pool's directory or memory (``views``): mapped or not,
    #: whatever the pool holds next would show through it
    mounted: bool = False
    #: its mount namespace's table is longer than the scan reads (``views.MAX_TABLE_BYTES``):
    #: taken as having the pool mounted
    unread: bool = False

    def describe(self) -> str:
        """``pid 1234 (python3) maps the pool's memory, holds the lease``."""
        how = [
            what
            for what, yes in (
                ("maps the pool's memory", self.mapped),
                ("has a pool file open", self.open),
                ("holds the lease", self.lease),
                ("has the pool mounted", self.mounted and not self.unread),
                (
                    f"has a mount table over {views.MAX_TABLE_BYTES >> 20} MiB (not read in full: "
                    "taken as having the pool mounted)",
                    self.unread,
                ),
            )
            if yes
        ]
        return f"pid {self.pid} ({self.comm}) {', '.join(how)}"


class PoolInUse(LeaseHeld):
    """Processes hold the pool; every caller treats this exactly like a held lease.

    A subclass of LeaseHeld so that the CLI (exit code), the agent (pending with the reason,
    deletion waiting) and provision (nothing touched, nothing marked Failed) need no new case.
    """

    def __init__(
        self,
        pool_dir: str | os.PathLike[str],
        holders: list[Holder],
        volumes: list[published.Published] | None = None,
    ) -> None:
        self.holders = holders
        self.volumes = volumes or []
        n = len(holders) + len(self.volumes)
        said = "; ".join(filter(None, [describe(holders), describe_volumes(self.volumes)]))
        super().__init__(f"pool {pool_dir} is held by {n} attached engine{'s' if n != 1 else ''}: {said}")


def describe(holders: list[Holder]) -> str:
    """The holders in one line, the first few by name."""
    named = "; ".join(h.describe() for h in holders[:_NAMED])
    more = len(holders) - _NAMED
    return named + (f"; and {more} more" if more > 0 else "")


def describe_volumes(volumes: list[published.Published]) -> str:
    """The CSI volumes published from a pool, in one line, the first few by name."""
    named = "; ".join(v.describe() for v in volumes[:_NAMED])
    more = len(volumes) - _NAMED
    return named + (f"; and {more} more" if more > 0 else "")


def csi_holders(pool: Pool) -> list[published.Published]:
    """The pool's volumes published to pods by the CSI node plugin (``region.holding.published``): each
    holds the pool from the kubelet's publish to its unpublish, mapped or not."""
    return published.load_all(pool)


def _mount_dir(pool: Pool) -> int | None:
    """A descriptor of the pool's mount directory, reached without a link; None if there is none."""
    try:
        with given(pool) as handle:
            return beneath.open_dir(handle.fd, MOUNT_NAME)
    except (OSError, places.UnsafeEntry):
        return None


def memory_files(pool: Pool) -> set[FileId]:
    """(st_dev, st_ino) of every regular file in the pool's mount (none without a mount dir).

    All files, not the manifest's list: a half-built pool has no manifest, and the compat file
    is a hard link of segment 0 (the same inode), so it is covered without a special case.
    Entries are looked at, never followed: a link a pod put there names nothing of the pool.
    """
    fd = _mount_dir(pool)
    if fd is None:
        return set()
    ids: set[FileId] = set()
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed meanwhile
                if stat.S_ISREG(st.st_mode):
                    ids.add((st.st_dev, st.st_ino))
    finally:
        os.close(fd)
    return ids


def open_anywhere(pool: Pool) -> bool | None:
    """Whether any process (this one included) has a file of the pool open or mapped: one
    write-lease attempt per file instead of a scan of every process.

    The kernel grants a write lease (``F_SETLEASE``, ``F_WRLCK``) only when no other open file
    description of the inode exists — and a mapping keeps the description it was made from
    alive after its fd is closed, in whatever mount namespace. So granted everywhere means
    nobody holds the memory; refused means somebody may (a scan then says who). None: the
    answer is not known (leases disabled, no CAP_LEASE on another user's file, a file system
    without leases, a file gone meanwhile, a name that is not a plain file); callers scan.

    The lease is held for two system calls. An open by an engine in that window waits for it to
    be dropped and notifies this process with SIGURG (set with ``F_SETSIG``; ignored by default)
    instead of the default SIGIO, which would terminate it.
    """
    mnt = _mount_dir(pool)
    if mnt is None:
        return False
    try:
        for name in os.listdir(mnt):
            try:
                fd = beneath.open_file(mnt, name, links=None)
            except FileNotFoundError:
                continue
            except OSError:  # a link, a fifo, ... (never opened), or unreadable
                return None
            try:
                fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except BlockingIOError:  # EAGAIN: another open file description exists
                return True
            except OSError:
                return None
            finally:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
                except OSError:
                    pass
                os.close(fd)
    finally:
        os.close(mnt)
    return False


def file_id(path: str | os.PathLike[str]) -> FileId | None:
    """(st_dev, st_ino) of ``path`` itself (a link is not followed); None when it is gone."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def pool_lockers(pool: Pool, proc: str = "/proc") -> set[int]:
    """Pids holding a shared flock on the pool's lease (``lease_lockers`` of its lease file)."""
    with given(pool) as handle:
        try:
            st = beneath.lstat(handle.fd, LEASE_NAME)
        except (FileNotFoundError, places.UnsafeEntry):
            st = None
    return lease_lockers(None if st is None else (st.st_dev, st.st_ino), proc)


def parse_dev(text: str) -> int:
    """``fe:01`` (hex major:minor, as /proc prints it) -> a st_dev value."""
    major, minor = text.split(":")
    return os.makedev(int(major, 16), int(minor, 16))


def lease_lockers(lease: FileId | None, proc: str = "/proc") -> set[int]:
    """Pids holding a shared flock on the file ``lease`` (from ``<proc>/locks``).

    Only READ (shared) locks: those are engines; an exclusive one is the node side itself.
    Blocked waiters (lines with ``->``) hold nothing yet.
    """
    pids: set[int] = set()
    if lease is None:
        return pids
    try:
        with open(f"{proc}/locks") as fh:
            for line in fh:
                # "1: FLOCK  ADVISORY  READ 1234 00:1a:5678 0 EOF"
                parts = line.split()
                if len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "READ":
                    continue
                dev, _, ino = parts[5].rpartition(":")
                try:
                    if int(ino) == lease[1] and parse_dev(dev) == lease[0] and int(parts[4]) > 0:
                        pids.add(int(parts[4]))
                except ValueError:
                    continue
    except OSError:
        pass
    return pids


def _maps_any(proc: str, pid: int, files: set[FileId], inodes: set[str]) -> bool:
    """True if the process maps one of ``files``. Inodes are compared as text first: cheap.

    The whole table is read at once and searched for the inode numbers before any line is
    parsed: nearly every process on a node maps none of them, and the scan runs over every
    process at every heartbeat (a Python loop over each line of each process's table would be
    most of an agent's CPU on a busy machine).
    """
    with open(f"{proc}/{pid}/maps") as fh:
        table = fh.read()
    if not any(ino in table for ino in inodes):
        return False
    for line in table.splitlines():
        # "7f...-7f... rw-s 00000000 00:1a 5678    /dev/shm/vllm_offload_x.mmap"
        parts = line.split(None, 5)
        if len(parts) >= 5 and parts[4] in inodes:
            try:
                if (parse_dev(parts[3]), int(parts[4])) in files:
                    return True
            except ValueError:
                continue
    return False


def _opens_any(proc: str, pid: int, files: set[FileId]) -> bool:
    """True if the process has one of ``files`` open (stat of each fd resolves the file itself)."""
    fd_dir = f"{proc}/{pid}/fd"
    for fd in os.listdir(fd_dir):
        link = f"{fd_dir}/{fd}"
        try:
            if os.readlink(link).startswith(_NOT_FILES):
                continue
            st = os.stat(link)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # closed meanwhile, or the process exited
        if (st.st_dev, st.st_ino) in files:
            return True
    return False


def command_name(proc: str, pid: int) -> str:
    try:
        with open(f"{proc}/{pid}/comm") as fh:
            return fh.read().strip() or "?"
    except OSError:
        return "?"


def self_pid(proc: str) -> int:
    """This process's pid as ``proc`` numbers it (differs from os.getpid() in a container
    reading the host's procfs)."""
    try:
        return int(os.readlink(f"{proc}/self"))
    except (OSError, ValueError):
        return os.getpid()


def find_holders(pool: Pool, *, proc: str = "/proc") -> list[Holder]:
    """Every other process holding the pool ``pool``, by pid.

    A process that holds the lease and maps the files is one holder. The calling process is
    left out: the node side opens the files itself (populate, the exclusive lease), and an
    unmount it attempts still fails with EBUSY on its own open files. A mount namespace that
    shows the pool (``views``) is one holder: the process of it that holds the pool otherwise,
    else its lowest pid.
    """
    with given(pool) as handle:
        files = memory_files(handle)
        lockers = pool_lockers(handle, proc)
        me = self_pid(proc)
        pids = views.process_ids(proc)
        found = {
            h.pid: replace(h, lease=h.pid in lockers) for h in _mapping_or_opening(files, proc, me, pids)
        }
        for pid in lockers - set(found) - {me}:
            found[pid] = Holder(pid, command_name(proc, pid), lease=True)
        _add_views(found, handle, proc, me, pids)
    return [found[pid] for pid in sorted(found)]


def _mapping_or_opening(files: set[FileId], proc: str, me: int, pids: list[int]) -> list[Holder]:
    """The processes among ``pids`` but ``me`` that map or hold open one of ``files`` (one scan of
    their maps and fds; none when ``files`` is empty)."""
    global _scans
    if not files:
        return []
    _scans += 1
    inodes = {str(ino) for _, ino in files}
    found = []
    for pid in sorted(pids):
        if pid == me:
            continue
        try:
            mapped = _maps_any(proc, pid, files, inodes)
            opened = _opens_any(proc, pid, files)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited during the scan, or not ours to read
        if mapped or opened:
            found.append(Holder(pid, command_name(proc, pid), mapped=mapped, open=opened))
    return found


def _add_views(
    found: dict[int, Holder],
    pool: PoolHandle,
    proc: str,
    me: int,
    pids: list[int] | None = None,
    *,
    max_age: float = 0.0,
) -> None:
    """Add the pool's mounted views (``views.find``) to ``found``: each namespace's view goes
    to the process of it already found holding the pool, else to its lowest pid. ``max_age``:
    as ``views.find`` (a report's may be shared; a decision's never)."""
    for view in views.find(pool, pids, proc, max_age=max_age):
        members = sorted(p for p in view.pids if p != me)
        if not members:
            continue
        pid = next((p for p in members if p in found), members[0])
        held = found.get(pid) or Holder(pid, command_name(proc, pid))
        found[pid] = replace(held, mounted=True, unread=view.unread)


def view_holders(pool: Pool, *, proc: str = "/proc") -> list[Holder]:
    """The processes whose mount namespace shows the pool (``views``), one per namespace."""
    found: dict[int, Holder] = {}
    with given(pool) as handle:
        _add_views(found, handle, proc, self_pid(proc))
    return [found[pid] for pid in sorted(found)]


def count(pool: Pool, *, proc: str = "/proc") -> int:
    """ "Engines attached": distinct processes holding the lease or mapping/opening the files,
    plus the pool's published CSI volumes (``csi_holders``; a pod's volume and its engine
    process that maps the files are two).

    The scan of every process's maps and fds (``find_holders``) runs only when a file of the
    pool is open or mapped somewhere (``open_anywhere``): the count is reported at every
    heartbeat, the scan's cost grows with the node's processes and sockets, and nearly always
    nothing holds the memory. Otherwise only flock holders and mounted views can hold the pool:
    ``/proc/locks`` names the first, one mount table per namespace the second (``views``).
    """
    with given(pool) as handle:
        volumes = len(csi_holders(handle))
        if open_anywhere(handle) is False:
            me = self_pid(proc)
            found = {pid: Holder(pid, "?", lease=True) for pid in pool_lockers(handle, proc) - {me}}
            _add_views(found, handle, proc, me, max_age=COUNT_VIEWS_MAX_AGE)
            return volumes + len(found)
        return volumes + len(find_holders(handle, proc=proc))


def scans() -> int:
    """How many times this process has scanned every process for a pool's holders."""
    return _scans


def exclusive_unused(pool: Pool, *, proc: str = "/proc") -> Lease:
    """The pool's exclusive lease, taken only when no process holds the pool in any way.

    This is what the node side takes before destroying, reshaping or re-populating memory.
    The lease keeps cooperating engines out while the caller works; the scan covers engines
    that never take it. Raises PoolInUse (a LeaseHeld) naming the holders. A process that
    opens a file after the scan and before the caller's unmount is not seen: the window is
    the caller's own work under the lease, which is why callers scan last, right before it.

    With the exclusive lease taken no engine holds the lease, so when no file of the pool is
    open or mapped anywhere (``open_anywhere``) only a mounted view can hold the pool (one
    mount table per namespace, ``views``) and the scan of every process's maps and fds is
    skipped: a release or a rebuild on a node with thousands of processes or open
    files paid for it, nearly always to find nobody (at 1,000 simulated nodes in one process,
    minutes of deletion).

    A published CSI volume (``csi_holders``) holds the pool too: its record is read under the
    lease, and the plugin writes one before its bind mount exists.
    """
    with given(pool) as handle:
        return _exclusive_unused(handle, proc)


def _exclusive_unused(pool: PoolHandle, proc: str) -> Lease:
    try:
        lease = _exclusive_lease(pool, proc)
    except LeaseHeld:
        holders = find_holders(pool, proc=proc)
        volumes = csi_holders(pool)
        if holders or volumes:
            raise PoolInUse(pool.path, holders, volumes) from None
        raise  # a holder this proc cannot see (another pid namespace): the lease's own message
    try:
        volumes = csi_holders(pool)
        # nothing open or mapped: only a mounted view can hold it (the lease is ours)
        unopened = open_anywhere(pool) is False
        holders = view_holders(pool, proc=proc) if unopened else find_holders(pool, proc=proc)
    except BaseException:
        lease.close()
        raise
    if holders or volumes:
        lease.close()
        raise PoolInUse(pool.path, holders, volumes)
    return lease


def _exclusive_lease(pool: PoolHandle, proc: str) -> Lease:
    """The exclusive lease; a lease name a pod replaced (a link, a fifo, another file's hard
    link) is never opened: with no process holding the pool's memory it is removed as a name and
    made anew (the pool is then rebuilt or re-validated by the caller), else UnsafeEntry."""
    try:
        return Lease.exclusive(pool.path, dir_fd=pool.fd)
    except beneath.WrongEntry as exc:
        wrong = exc
    holders = find_holders(pool, proc=proc)
    if holders:
        raise places.UnsafeEntry(pool.path, wrong, f"; the pool is held ({describe(holders)}): not rebuilt")
    left = places.remove_entry(pool.fd, wrong.name)
    if left is not None:
        raise places.UnsafeEntry(pool.path, wrong, f"; {left}")
    return Lease.exclusive(pool.path, dir_fd=pool.fd)


def holders_of(files: set[FileId], *, proc: str = "/proc") -> list[Holder]:
    """Every other process mapping or holding open one of ``files`` (``find_holders`` for a part
    of a pool: one share's segments, which the node zeroes while other shares stay in use)."""
    return _mapping_or_opening(files, proc, self_pid(proc), views.process_ids(proc) if files else [])
