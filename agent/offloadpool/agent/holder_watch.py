"""The agent's count of attached engines, scanning /proc only when the answer can have changed.

Why: the count is reported at every heartbeat, and the scan behind it (``holders.find_holders``)
reads every process's maps and fd table on the node. On a node with many processes, or many
sockets (a busy engine, a sidecar mesh), that is the agent's largest cost, paid every 10 s to
learn, nearly always, that nothing changed. The kernel can say when something may have:

* to hold a pool a process must open one of its files (mapping needs an open file; the
  lease is a flock on an opened file), and every open of a file on the node raises an inotify
  ``IN_OPEN`` on the directory that holds it — whatever the mount namespace or bind mount the
  process sees the file through (inotify watches the inode, not a path);
* a process that holds nothing cannot come to hold the pool without such an open (a fork
  inherits only what its parent held).

So, once a scan found no holder and no open happened in the pool's mount or the lease's
directory since, no process holds the pool: the count is 0 without a scan. A scan that found
holders is repeated at every count, since holders leave without any event (``munmap`` after a
``close``, or an exit). Flock holders are re-read from ``/proc/locks`` at every count anyway
(one small file), so a lease opened before the watch and locked after it is still seen.

Where inotify is unavailable (no instance or watch left, an unusual file system), the count
falls back to scanning every time: never a wrong answer, only a slower one.

One inotify instance serves the whole process (the kernel allows each user 128 instances; a
test harness runs a thousand agents in one process).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from inotify_simple import INotify, flags

from offloadpool.region import holders
from offloadpool.region.holders import FileId
from offloadpool.region.manifest import LEASE_NAME, MOUNT_NAME

log = logging.getLogger(__name__)

#: events after which the count must be taken by a scan again
_WATCHED = flags.OPEN | flags.CREATE | flags.MOVED_TO
#: events saying a watch has gone (the directory removed or unmounted): re-arm, then scan
_GONE = flags.IGNORED | flags.UNMOUNT | flags.DELETE_SELF


class _Opens:
    """The process's one inotify instance, and which counters each watch descriptor wakes.

    A subscriber is a counter and the one file name in the directory it cares about (None: any
    file). Opens of directories never count: the agent lists the mount at every count.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inotify: INotify | None = None
        self.failed = False
        self.subscribers: dict[int, set[tuple[HolderCount, str | None]]] = {}

    def watch(self, counter: HolderCount, path: Path, only: str | None) -> int | None:
        """Watch ``path`` for ``counter``; None where inotify cannot (the caller then scans)."""
        with self.lock:
            try:
                if self.inotify is None and not self.failed:
                    self.inotify = INotify(nonblocking=True)
                if self.inotify is None:
                    return None
                wd = self.inotify.add_watch(str(path), _WATCHED | flags.DELETE_SELF | flags.ONLYDIR)
            except OSError as exc:
                if self.inotify is None:
                    self.failed = True  # no instance left for this user: scan always
                log.debug("no inotify watch on %s (%s): engines are counted by a scan each time", path, exc)
                return None
            self.subscribers.setdefault(wd, set()).add((counter, only))
            return wd

    def unwatch(self, counter: HolderCount, wd: int) -> None:
        with self.lock:
            subs = self.subscribers.get(wd)
            if subs is None:
                return
            subs -= {s for s in subs if s[0] is counter}
            if not subs:
                del self.subscribers[wd]
                try:
                    assert self.inotify is not None
                    self.inotify.rm_watch(wd)
                except OSError:
                    pass  # already gone (IN_IGNORED was queued)

    def drain(self) -> None:
        """Read every queued event; mark each counter whose watched files saw one."""
        with self.lock:
            if self.inotify is None:
                return
            try:
                events = self.inotify.read(timeout=0)
            except (BlockingIOError, InterruptedError):
                return
            for event in events:
                if event.mask & flags.Q_OVERFLOW:  # events were lost: every counter scans
                    for subs in self.subscribers.values():
                        for c, _ in subs:
                            c.stale = True
                    continue
                for c, only in self.subscribers.get(event.wd, ()):
                    if event.mask & _GONE:
                        c.stale, c.armed = True, False
                    elif not event.mask & flags.ISDIR and only in (None, event.name):
                        c.stale = True
                if event.mask & flags.IGNORED:
                    self.subscribers.pop(event.wd, None)


_OPENS = _Opens()


class HolderCount:
    """``holders.count(pool_dir)``, with the scan skipped while nothing can have changed."""

    def __init__(self, pool_dir: str | os.PathLike[str], *, proc: str = "/proc") -> None:
        self.pool_dir = Path(pool_dir)
        self.proc = proc
        self.stale = True  # set by _Opens.drain on an event in a watched directory
        self.armed = False
        self.scans = 0  # how many /proc scans this counter made (tests, metrics)
        self._wds: list[int] = []
        self._files: set[FileId] | None = None
        self._last = -1

    def count(self) -> int:
        """Processes holding the lease or mapping/opening the pool's files, each once."""
        files = holders.memory_files(self.pool_dir)
        if files != self._files or not self.armed:
            self._arm()  # a new region (new inodes, maybe a new mount): watch it afresh
        _OPENS.drain()
        if (
            self.armed
            and not self.stale
            and self._last == 0
            and files == self._files
            and not holders.pool_lockers(self.pool_dir, self.proc)
        ):
            return 0
        self.stale = False  # before the scan: an open during it is seen at the next count
        self._files = files
        self._last = holders.count(self.pool_dir, proc=self.proc)
        self.scans += 1
        return self._last

    def close(self) -> None:
        for wd in self._wds:
            _OPENS.unwatch(self, wd)
        self._wds = []
        self.armed = False

    def _arm(self) -> None:
        self.close()
        self.stale = True
        # the mount (any memory file) and the pool directory (its lease file only: the agent
        # itself reads the manifest there at every step)
        wds = [
            _OPENS.watch(self, self.pool_dir / MOUNT_NAME, None),
            _OPENS.watch(self, self.pool_dir, LEASE_NAME),
        ]
        self._wds = [wd for wd in wds if wd is not None]
        self.armed = len(self._wds) == len(wds)
