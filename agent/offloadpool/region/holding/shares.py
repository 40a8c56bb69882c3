"""Shares: one node's pool split into N independent pools, one engine on each.

A pool with ``partitions`` N > 1 holds N shares of ``capacity / N`` in its one mount (the
planner names share p's files ``p<p>-r<i>-s<k>``). Each share has a directory that looks like
a pool directory to the engine library, so ``attach(share_dir)`` and everything built on it
(the vLLM spec) serve a share exactly as they serve a pool::

    <pool>/shares/<i>/manifest.json   share i's regions alone (``Manifest.share`` = i)
    <pool>/shares/<i>/lease           the share's claim (an flock) and who holds it
    <pool>/shares/<i>/mnt             a link to ``../../mnt``: the share's segment paths

**Claims.** An engine takes a share when it attaches (``claim``): under a short flock on the
``shares`` directory (the engines' own mutex, so the workers of one engine, arriving together,
agree; no node-side process ever takes it) it takes the share already held by its own owner,
else a free one, and holds a shared flock on that share's lease for as long as it is attached.
The first worker writes the owner into the lease file; the kernel drops the flock when the
last process of the engine exits, so a share is freed when its pod ends (or its engine
crashes), with nothing to clean up. An engine's owner is its pod (``OFFLOADPOOL_POD_UID``, set
by the webhook), so every worker of a pod gets the same share and two pods never do. When
every share is held, the claim is refused naming the holders.

**Reservations.** A pod given the pool through a ``csi`` volume is given one share by the
node's CSI plugin, which binds only that share's files at the pod's target (``offloadpool.csi``):
the plugin writes ``shares/<i>/csi`` (root's, in a root-owned directory, so no pod can forge or
remove it) naming the pod, and removes it when the volume is unpublished. The node's mutex for
reservations is ``<root>/.state/<pool>/shares.lock`` (``MUTEX_NAME``, root-only: no pod can
take it, so a publish never waits on a pod). Against engines, one share's lease is the
arbiter: a reservation is written while the node holds that lease exclusively, and an engine
reads the reservation only once it holds the lease (exclusively, and again once shared), so
no share is given twice across the two deliveries; ``states`` reports it claimed by the pod.

**The node decides over hostPath.** Where the pool's agent runs, the ``shares`` directory holds
its socket (``SOCKET_NAME``, ``share_service``): an engine over hostPath asks it first, and the
node, reading the pod from the kubelet's cgroup of the process that asked (never from what the
pod says), reserves a share for that pod (owner ``pod/<uid>``, the same record and mutex as a
csi volume's) and answers with it; the engine then claims that share alone, under the node's
owner, reading leases only (no record written: a hostPath pool directory is mounted read-only
in the pod). ``OFFLOADPOOL_SHARE_OWNER`` and ``owner`` no longer choose anything there. The
reservation is dropped once no process of the pod is left on the node (``release_gone``). A
pool made without an agent (on this machine, by the CLI) has no socket, and the node leaves a
process in no pod (the host's own engine) to claim by its owner: such engines claim among
themselves by their owners, as below.

Shares separate engines' memory, not pods from each other: a pod that is given the pool can
open every share's files, as it could open the whole pool's before (same uid, gid and mode).

The node writes the directories, leases and links (``write``) and reads who holds each share
(``states``); it never follows the link and reads a lease's record only as hostile text.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from offloadpool.region.files import beneath, bounded, places
from offloadpool.region.files.handle import Pool, PoolHandle, given
from offloadpool.region.files.manifest import LEASE_NAME, MANIFEST_NAME, MOUNT_NAME, Manifest, ManifestError
from offloadpool.region.holding import pod_cgroup
from offloadpool.region.vocabulary import (
    ENV_POD_UID,
    VIA_CSI,
    VIA_DRA,
    VIA_ENGINE,
    VIA_HOSTPATH,
    ShareViaName,
)

SHARES_NAME = "shares"
#: a share's reservation for a pod given it through a csi volume or a DRA claim (root's; see
#: the docstring): one record for both deliveries, under one mutex
RESERVATION_NAME = "csi"
#: a reservation's owner when a DRA claim was given the share (``claim/<claim uid>``; the pod's
#: engine claims it under the same owner, ``OWNER_ENV``); a csi volume's owner is its pod's uid
CLAIM_OWNER_PREFIX = "claim/"
#: a reservation's owner when the node gave the share to a pod over hostPath (``pod/<pod uid>``,
#: the pod read from the kubelet's cgroup of the engine that asked: ``share_service``)
HOSTPATH_OWNER_PREFIX = "pod/"
#: the node's share service, in the ``shares`` directory: a socket only the pool's agent binds
SOCKET_NAME = "node.sock"
#: most bytes of a request or an answer on that socket
MESSAGE_LIMIT = 1024
#: where a share's ``mnt`` points: the pool's mount, two levels up, inside any bind mount
LINK_TARGET = f"../../{MOUNT_NAME}"
#: the environment variables an engine's owner is read from, in this order
OWNER_ENV = "OFFLOADPOOL_SHARE_OWNER"
#: the node's reservation mutex, in the pool's root-only state directory (never the pool's)
MUTEX_NAME = "shares.lock"
#: most bytes of a claim record read (it is written by an engine: hostile to everyone else)
RECORD_LIMIT = 1024
#: longest owner shown or compared
OWNER_LIMIT = 128


class ShareRefused(RuntimeError):
    """No share can be claimed (all held by other engines, or the one asked for is)."""


def claim_owner(claim_uid: str) -> str:
    """The owner a DRA claim reserves a share under."""
    return f"{CLAIM_OWNER_PREFIX}{claim_uid}"


def hostpath_owner(pod_uid: str) -> str:
    """The owner the node reserves a share under for a pod over hostPath."""
    return f"{HOSTPATH_OWNER_PREFIX}{pod_uid}"


def share_rel(index: int) -> str:
    """``shares/<index>``, relative to the pool directory."""
    return f"{SHARES_NAME}/{index}"


def share_dir(pool_dir: str | os.PathLike[str], index: int) -> Path:
    return Path(pool_dir) / share_rel(index)


def pool_of(share: str | os.PathLike[str]) -> Path:
    """The pool directory of the share directory ``share`` (``<pool>/shares/<i>``)."""
    return Path(share).parent.parent


def share_manifest(head: Manifest, index: int) -> Manifest:
    """Share ``index`` of the pool manifest ``head`` as a manifest of its own: its regions,
    numbered from 0, with the pool's medium, layout, ownership and generation."""
    if not 0 <= index < head.shares:
        raise ManifestError(f"pool {head.pool!r} has {head.shares} shares, not share {index}")
    per = len(head.regions) // head.shares
    mine = slice(index * per, (index + 1) * per)
    regions = tuple(replace(r, index=j) for j, r in enumerate(head.regions[mine]))
    extra = dict(head.extra)
    numa = extra.get("numa_nodes")
    if isinstance(numa, list) and len(numa) == len(head.regions):
        extra["numa_nodes"] = numa[mine]  # per region, as the pool's lists them
    total = sum(r.bytes for r in regions)
    return replace(head, regions=regions, total_bytes=total, extra=extra, shares=1, share=index)


# -- the node's side ---------------------------------------------------------------------------


def write(pool: PoolHandle, head: Manifest, uid: int, gid: int, mode: int) -> None:
    """Make every share's directory (root's, 0755), lease (the consumers', ``mode``) and link,
    and write its manifest. Names a pod replaced are replaced as names, never followed."""
    if head.shares == 1:
        return
    pfd = pool.fd
    try:
        places.make_root_dir(pfd, SHARES_NAME, places.POOL_DIR_MODE)
        for i in range(head.shares):
            rel = share_rel(i)
            places.make_root_dir(pfd, rel, places.POOL_DIR_MODE)
            fd = beneath.open_file(pfd, f"{rel}/{LEASE_NAME}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.fchown(fd, uid, gid)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            _link(pfd, rel)
            beneath.write_file(pfd, f"{rel}/{MANIFEST_NAME}", share_manifest(head, i).encode())
    except beneath.WrongEntry as exc:
        raise places.UnsafeEntry(pool.path, exc) from None


def _link(pfd: int, rel: str) -> None:
    """``<rel>/mnt`` -> ``../../mnt``, replacing whatever else stands there."""
    dfd = beneath.open_dir(pfd, rel)
    try:
        try:
            if os.readlink(MOUNT_NAME, dir_fd=dfd) == LINK_TARGET:
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: not a link (removed below)
                raise
        left = places.remove_entry(dfd, MOUNT_NAME)
        if left is not None:
            raise places.RegionError(f"{rel}/{MOUNT_NAME}: {left}")
        os.symlink(LINK_TARGET, MOUNT_NAME, dir_fd=dfd)
    finally:
        os.close(dfd)


def withdraw(pool: PoolHandle, shares: int) -> None:
    """Remove every share's manifest (no engine claims a share of a pool being taken apart)."""
    _remove(pool, [f"{share_rel(i)}/{MANIFEST_NAME}" for i in range(shares)], [])


def remove(pool: PoolHandle, left: list[str]) -> None:
    """Remove the names ``write`` made, each as a name; what is not ours stays, said in ``left``."""
    try:
        found: list[str] | None = sorted(beneath.listdir(pool.fd, SHARES_NAME))
    except FileNotFoundError:
        return
    except (beneath.WrongEntry, NotADirectoryError):
        found = None
    names: list[str] = []
    for i in found or []:
        if i.isdigit():
            rel = f"{SHARES_NAME}/{i}"
            names += [f"{rel}/{n}" for n in (MANIFEST_NAME, LEASE_NAME, MOUNT_NAME, RESERVATION_NAME)] + [rel]
    _remove(pool, [*names, f"{SHARES_NAME}/{SOCKET_NAME}", SHARES_NAME], left)


def _remove(pool: PoolHandle, names: list[str], left: list[str]) -> None:
    try:
        pfd = pool.fd
    except FileNotFoundError:
        return
    for rel in names:
        try:
            why = places.remove_entry(pfd, rel)
        except FileNotFoundError:
            continue
        except beneath.WrongEntry as exc:
            why = str(exc)
        if why is not None:
            left.append(why)


@dataclass(frozen=True)
class ShareState:
    """One share as the node sees it: who holds its lease (pids in the node's /proc), the
    owner its holder wrote (hostile text, clipped; "" when free or unreadable), and the pod a
    csi volume reserved it for ("" when none)."""

    index: int
    holders: tuple[int, ...]
    owner: str = ""
    reserved_for: str = ""
    #: the pods the holders run in, by their cgroups (``pod_cgroup``: the node's evidence, not
    #: the owner an engine wrote), sorted; holders in no pod's cgroup are not counted
    pods: tuple[str, ...] = ()

    @property
    def claimed(self) -> bool:
        return bool(self.holders) or bool(self.reserved_for)

    @property
    def via(self) -> ShareViaName | None:
        """``VIA_CSI``, ``VIA_DRA`` or ``VIA_HOSTPATH`` (a reservation for a pod's volume, a
        claim, a hostPath pod), ``VIA_ENGINE``, or None when free."""
        if self.reserved_for:
            if self.by_claim:
                return VIA_DRA
            return VIA_HOSTPATH if self.reserved_for.startswith(HOSTPATH_OWNER_PREFIX) else VIA_CSI
        return VIA_ENGINE if self.holders else None

    @property
    def reserved_pod(self) -> str:
        """The pod the share is reserved for ("" when none, or a DRA claim's)."""
        if self.by_claim:
            return ""
        return self.reserved_for.removeprefix(HOSTPATH_OWNER_PREFIX)

    @property
    def by_claim(self) -> bool:
        """Reserved for a DRA claim (the scheduler allocated it: it stays in the slice)."""
        return self.reserved_for.startswith(CLAIM_OWNER_PREFIX)

    @property
    def holder(self) -> str:
        """Who has the share, in one word: the csi volume's pod, else the engine's owner."""
        return self.reserved_for or self.owner

    def crossed(self) -> str | None:
        """Why the share is used across pods, or None: holders in two pods (an engine joined
        another pod's share by naming its owner, or by opening its files), or a holder in a pod
        other than the one a csi volume or the node reserved it for. A DRA claim's reservation
        names the claim, not a pod: only the first rule applies to it."""
        if len(self.pods) > 1:
            pods = ", ".join(self.pods)
            return f"share {self.index} is held by processes of {len(self.pods)} pods: {pods}"
        mine = self.reserved_pod
        if self.pods and mine and self.pods[0] != mine:
            return (
                f"share {self.index} is reserved for pod {mine} but held by a process of pod {self.pods[0]}"
            )
        return None


def states(pool: Pool, shares: int, proc: str = "/proc") -> list[ShareState]:
    """Every share of the pool, claimed or free: the kernel's flocks on their leases (engines)
    and the csi plugin's reservations (pods given a share through a csi volume)."""
    from offloadpool.region.holding.holders import lease_lockers  # holders imports lease, not us

    out = []
    with given(pool) as handle:
        reserved = reservations(handle, shares)
        for i in range(shares):
            lease = f"{share_rel(i)}/{LEASE_NAME}"
            pids = lease_lockers(_file_id(handle, lease), proc)
            owner = ""
            if pids:
                try:
                    owner = _parse(beneath.read_file(handle.fd, lease, RECORD_LIMIT)).get("owner", "")
                except (OSError, places.UnsafeEntry):
                    owner = ""
            pods = sorted({pod for pid in pids if (pod := pod_cgroup.pod_of(pid, proc)) is not None})
            out.append(ShareState(i, tuple(sorted(pids)), owner, reserved.get(i, ""), tuple(pods)))
    return out


def _file_id(pool: PoolHandle, rel: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of ``rel`` itself beneath the pool directory; None when it is not there
    (or a link stands on the way: nothing is followed)."""
    try:
        st = beneath.lstat(pool.fd, rel)
    except (OSError, places.UnsafeEntry):
        return None
    return None if st is None else (st.st_dev, st.st_ino)


def claimed_of(found: list[ShareState]) -> str:
    """``claimed/total``, as status columns show it ("1/4")."""
    return f"{sum(s.claimed for s in found)}/{len(found)}"


# -- reservations (the CSI plugin's) -----------------------------------------------------------


def _reservation(sdir: int, index: int) -> str:
    """The pod share ``index`` is reserved for ("" when none), read beneath the ``shares``
    directory ``sdir`` (a name that is not a plain file reads as reserved, never as free)."""
    try:
        data = beneath.read_file(sdir, f"{index}/{RESERVATION_NAME}", RECORD_LIMIT)
    except FileNotFoundError:
        return ""
    except (OSError, beneath.WrongEntry):
        return "?"
    return _parse(data).get("owner", "") or "?"


def _reserved_by(index: int, who: str) -> str:
    """Who holds a reserved share, in words: a DRA claim (``claim_owner``) or a csi volume's pod."""
    if who.startswith(CLAIM_OWNER_PREFIX):
        return f"share {index} by DRA claim {who.removeprefix(CLAIM_OWNER_PREFIX)!r}"
    if who.startswith(HOSTPATH_OWNER_PREFIX):
        return f"share {index} by hostPath pod {who.removeprefix(HOSTPATH_OWNER_PREFIX)!r}"
    return f"share {index} by csi volume of pod {who!r}"


def reservations(pool: Pool, shares: int) -> dict[int, str]:
    """Share index -> the pod a csi volume reserved it for, for every reserved share."""
    try:
        with given(pool) as handle:
            sdir = beneath.open_dir(handle.fd, SHARES_NAME)
    except (OSError, places.UnsafeEntry, beneath.WrongEntry):
        return {}
    try:
        found = {i: _reservation(sdir, i) for i in range(shares)}
    finally:
        os.close(sdir)
    return {i: who for i, who in found.items() if who}


def reserve(
    pool: Pool,
    shares: int,
    owner: str,
    *,
    prefer: int | None = None,
    only: int | None = None,
    timeout: float = 30.0,
) -> int:
    """Reserve a share for ``owner`` (a pod's uid, or ``claim_owner`` of a DRA claim) and return
    its index: the one reserved for it already, else ``prefer`` when free (a kubelet's retry of
    a recorded publish), else a free one — neither reserved nor claimed by an engine; with
    ``only``, that share or none (the share the scheduler allocated to a claim). Under the
    node's mutex (root-only), holding each free share's lease exclusively until the reservation
    is written, so an engine's ``claim`` and this never give one share twice. ShareRefused
    names the holders when every share is taken."""
    owner = _clip(owner)
    with given(pool) as handle, _node_mutex(handle, timeout) as sdir:
        taken: dict[int, str] = {}
        free: dict[int, int] = {}  # index -> its lease, held exclusively until we are done
        try:
            for i in range(shares):
                who = _reservation(sdir, i)
                if who == owner and (only is None or i == only):
                    return i
                if only is not None and i != only:
                    continue
                if who:
                    taken[i] = _reserved_by(i, who)
                    continue
                fd = beneath.open_file(sdir, f"{i}/{LEASE_NAME}", os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    record = _parse(os.pread(fd, RECORD_LIMIT, 0))
                    os.close(fd)
                    who = f"{record['owner']!r} (pid {record['pid']})" if record else "an unnamed holder"
                    taken[i] = f"share {i} by engine {who}"
                    continue
                except BaseException:
                    os.close(fd)
                    raise
                free[i] = fd
            if not free:
                raise ShareRefused(
                    f"no free share in pool {str(handle.path)!r} for {owner!r}: "
                    + "; ".join(taken[i] for i in sorted(taken))
                    + f" ({shares} shares; one is freed when its csi volume is unpublished, its DRA "
                    "claim unprepared, or every process of its engine has exited)"
                )
            index = prefer if prefer in free else min(free)
            data = _claim_record(owner)
            beneath.write_file(sdir, f"{index}/{RESERVATION_NAME}", data, 0o644)
            return index
        finally:
            for fd in free.values():
                os.close(fd)  # drops the lease: an engine taking it now sees the reservation


def release_gone(pool: Pool, shares: int, proc: str = "/proc") -> list[int]:
    """Drop the node's reservations for hostPath pods that have no process left on the node
    (``pod_cgroup.live_pods``) and whose share's lease nobody holds; return their indices.

    A pod's share stays its own while the pod lives, across its engine's restarts (the engine
    asks again and is given the same share); once the kubelet has ended the pod, the share is
    free for the next. A share still held (by whatever process) keeps its reservation."""
    from offloadpool.region.holding.holders import lease_lockers  # holders imports lease, not us

    dropped: list[int] = []
    with given(pool) as handle:
        mine = {i: w for i, w in reservations(handle, shares).items() if w.startswith(HOSTPATH_OWNER_PREFIX)}
        if not mine:
            return dropped
        alive = pod_cgroup.live_pods(proc)
        for i, who in sorted(mine.items()):
            if who.removeprefix(HOSTPATH_OWNER_PREFIX) in alive:
                continue
            if lease_lockers(_file_id(handle, f"{share_rel(i)}/{LEASE_NAME}"), proc):
                continue
            if unreserve(handle, i, who):
                dropped.append(i)
    return dropped


def unreserve(pool: Pool, index: int, owner: str, *, timeout: float = 30.0) -> bool:
    """Drop share ``index``'s reservation if it is ``owner``'s; False when it was not."""
    try:
        with given(pool) as handle, _node_mutex(handle, timeout) as sdir:
            if _reservation(sdir, index) != _clip(owner):
                return False
            return beneath.unlink(sdir, f"{index}/{RESERVATION_NAME}")
    except FileNotFoundError:  # the shares are gone (the pool taken apart)
        return False


def _shares_dir(pool_dir: Path) -> int:
    """The ``shares`` directory, opened beneath the pool directory (the engine's side: the
    engine's own path of its pool)."""
    pfd = os.open(pool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return beneath.open_dir(pfd, SHARES_NAME)
    finally:
        os.close(pfd)


@contextmanager
def _node_mutex(pool: PoolHandle, timeout: float) -> Iterator[int]:
    """The node's reservation mutex (an flock on ``MUTEX_NAME`` in the pool's root-only state
    directory: no pod is given it) held for as long as the block runs, and the ``shares``
    directory. FileNotFoundError when the pool has no state directory or no shares."""
    state = pool.state()
    if state is None:
        raise FileNotFoundError(errno.ENOENT, f"{pool.path} has no state directory")
    lock = beneath.open_file(state, MUTEX_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(lock, places.state_dir(pool.path) / MUTEX_NAME, timeout)
        sdir = beneath.open_dir(pool.fd, SHARES_NAME)
        try:
            yield sdir
        finally:
            os.close(sdir)
    finally:
        os.close(lock)


@contextmanager
def _mutex(pool_dir: Path, timeout: float) -> Iterator[int]:
    """The ``shares`` directory, flocked for as long as the block runs: the engines' own claim
    mutex (a pod can open the directory, so only engines, never the node, wait for it)."""
    sdir = _shares_dir(pool_dir)
    try:
        _lock(sdir, pool_dir / SHARES_NAME, timeout)
        yield sdir
    finally:
        os.close(sdir)


# -- the engine's side -------------------------------------------------------------------------


def default_owner() -> str:
    """Who this process attaches for: ``OFFLOADPOOL_SHARE_OWNER``, else the pod's uid
    (``OFFLOADPOOL_POD_UID``, injected by the webhook), else this process's pid namespace and
    session (the workers one engine starts share both; two containers never share the first,
    two engines started apart on one host never share the second)."""
    for name in (OWNER_ENV, ENV_POD_UID):
        value = os.environ.get(name, "").strip()
        if value:
            return _clip(value)
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "pid:?"
    return f"{ns}/sid:{os.getsid(0)}"


def _clip(text: str, limit: int = OWNER_LIMIT) -> str:
    """At most ``limit`` printable characters: an owner is shown in messages and status."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _claim_record(owner: str) -> bytes:
    """Who holds a share, as a claim or a reservation records it."""
    return json.dumps({"owner": owner, "pid": os.getpid(), "since": round(time.time(), 3)}).encode()


def _parse(data: bytes) -> dict[str, str]:
    """A claim record's owner and pid as text; empty when it is not one."""
    try:
        record = bounded.loads(data, RECORD_LIMIT)
    except bounded.Malformed:
        return {}
    if not isinstance(record, dict) or not isinstance(record.get("owner"), str):
        return {}
    pid = record.get("pid")
    return {"owner": _clip(record["owner"]), "pid": str(pid) if isinstance(pid, int) else "?"}


class Claim:
    """A held share: a shared flock on its lease, dropped by ``close()`` or by process death."""

    def __init__(self, pool_dir: Path, index: int, fd: int, owner: str) -> None:
        self.pool_dir = pool_dir
        self.index = index
        self.owner = owner
        self.fd = fd

    @property
    def dir(self) -> Path:
        return share_dir(self.pool_dir, self.index)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"<Claim share {self.index} of {self.pool_dir} for {self.owner!r}>"


def claim(
    pool_dir: str | os.PathLike[str],
    shares: int,
    *,
    owner: str | None = None,
    only: int | None = None,
    timeout: float = 30.0,
) -> Claim:
    """Claim a share of the pool at ``pool_dir``: the one the node gives this process's pod
    where the pool's agent serves shares (``ask_node``; ``owner`` is then the node's, whatever
    was passed), else, for ``owner`` (default ``default_owner()``), the one its owner holds
    already, else a free one (one this owner held last first), or share ``only``. Raises
    ShareRefused naming the holders when none can be had."""
    pool_dir = Path(pool_dir)
    owner = _clip(owner) if owner else default_owner()
    given_by_node = ask_node(pool_dir, shares, only, timeout)
    if given_by_node is not None:
        only, owner = given_by_node
    wanted = range(shares) if only is None else [only]
    # the node's claims: the record is the node's reservation, the lease only read (a hostPath
    # pool directory is read-only in the pod)
    lease_flags = os.O_RDONLY if given_by_node is not None else os.O_RDWR
    with _mutex(pool_dir, timeout) as mutex:  # closing it drops the mutex
        held: list[str] = []
        free: list[tuple[int, int, str]] = []  # (index, fd held exclusively, last owner)
        try:
            for i in wanted:
                fd = beneath.open_file(mutex, f"{i}/{LEASE_NAME}", lease_flags)
                record = _parse(os.pread(fd, RECORD_LIMIT, 0))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    reserved = _reservation(mutex, i) if given_by_node is not None else ""
                    if (reserved or record.get("owner")) == owner:
                        try:
                            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # join our own engine
                        except BlockingIOError:
                            pass
                        else:
                            return Claim(pool_dir, i, fd, owner)
                    os.close(fd)
                    who = f"{record['owner']!r} (pid {record['pid']})" if record else "an unnamed holder"
                    held.append(_reserved_by(i, reserved) if reserved else f"share {i} by {who}")
                    continue
                # read only now, holding the lease: a reservation is written under it
                reserved = _reservation(mutex, i)
                if reserved and reserved != owner:
                    os.close(fd)
                    held.append(_reserved_by(i, reserved))
                    continue
                free.append((i, fd, record.get("owner", "")))
            free.sort(key=lambda f: f[2] != owner)  # the share this owner held last, first
            while free:
                i, fd, _ = free.pop(0)
                if given_by_node is None:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, _claim_record(owner), 0)
                fcntl.flock(fd, fcntl.LOCK_SH)  # others of this owner join; we still hold the mutex
                # the change to shared may let a reservation in between: read it again
                reserved = _reservation(mutex, i)
                if reserved and reserved != owner:
                    os.close(fd)
                    held.append(_reserved_by(i, reserved))
                    continue
                return Claim(pool_dir, i, fd, owner)
            raise ShareRefused(
                f"no free share in pool {str(pool_dir)!r} for {owner!r}: "
                + ("; ".join(held) or "none")
                + f" ({shares} share{'s' if shares != 1 else ''}; a share is freed when "
                "every process of its engine has exited)"
            )
        finally:
            for _, other, _ in free:
                os.close(other)


def ask_node(pool_dir: Path, shares: int, only: int | None, timeout: float) -> tuple[int, str] | None:
    """The share the node gives this process's pod, and the owner it reserved it under; None
    when the node serves no shares for this pool (no socket in ``shares``: a pool made
    without an agent) or leaves this process its own claim (it runs in no pod). ShareRefused
    with the node's words when it gives none, or when its socket does not answer within
    ``timeout`` (the agent restarting: it binds again at start).

    The socket is reached through the ``shares`` directory opened beneath the pool directory
    (no link followed on the way) and must be a socket; the answer is hostile until checked
    (bounded, a share of this pool, an owner of the node's kind)."""
    sdir = _shares_dir(pool_dir)
    try:
        st = beneath.lstat(sdir, SOCKET_NAME)
        if st is None:
            return None
        where = pool_dir / SHARES_NAME / SOCKET_NAME
        if not stat.S_ISSOCK(st.st_mode):
            raise ShareRefused(f"{where} is {beneath.kind(st.st_mode)}, not the node's share service")
        deadline = time.monotonic() + timeout
        request = json.dumps({"only": only}).encode() + b"\n"
        while True:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(max(0.1, deadline - time.monotonic()))
                    conn.connect(f"/proc/self/fd/{sdir}/{SOCKET_NAME}")
                    conn.sendall(request)
                    answer = read_line(conn)
                break
            except (TimeoutError, ConnectionRefusedError, FileNotFoundError, ConnectionResetError) as exc:
                if time.monotonic() >= deadline:
                    raise ShareRefused(
                        f"the node's share service at {where} did not answer in {timeout:g} s ({exc}): "
                        "the pool's agent gives a hostPath pod its share; is it running?"
                    ) from None
                time.sleep(0.2)
    finally:
        os.close(sdir)
    try:
        reply = bounded.loads(answer, MESSAGE_LIMIT)
    except bounded.Malformed as exc:
        raise ShareRefused(f"the node's share service at {where} answered no share ({exc})") from None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise ShareRefused(_clip(reply["error"], MESSAGE_LIMIT))
    if isinstance(reply, dict) and "share" in reply and reply["share"] is None:
        return None  # not a pod's process: the node leaves the host's engines their own claim
    index = reply.get("share") if isinstance(reply, dict) else None
    given = reply.get("owner") if isinstance(reply, dict) else None
    if (
        not isinstance(index, int)
        or isinstance(index, bool)
        or not 0 <= index < shares
        or (only is not None and index != only)
        or not isinstance(given, str)
        or not given.startswith(HOSTPATH_OWNER_PREFIX)
    ):
        said = _clip(answer.decode("utf-8", "replace"))
        raise ShareRefused(f"the node's share service at {where} answered {said!r}")
    return index, _clip(given)


def read_line(conn: socket.socket) -> bytes:
    """One line (without its newline) of at most ``MESSAGE_LIMIT`` bytes from ``conn``."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(MESSAGE_LIMIT + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > MESSAGE_LIMIT:
            raise ShareRefused(f"a share service message over {MESSAGE_LIMIT} bytes")
    return data.split(b"\n", 1)[0]


def _lock(fd: int, where: Path, timeout: float) -> None:
    """A mutex (an flock on ``where``, opened as ``fd``), waited for up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ShareRefused(
                    f"another process held {where} for {timeout:g} s; a claim takes "
                    "milliseconds, so something holds that flock without claiming"
                ) from None
            time.sleep(0.01)
