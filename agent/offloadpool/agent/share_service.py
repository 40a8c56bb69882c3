"""The node's answer to "which share is mine?" for engines over hostPath.

Why: over hostPath every pod given a partitioned pool sees every share's directory, so an
engine that chose its share by an owner it named (``OFFLOADPOOL_SHARE_OWNER``, its pod's uid
from its environment) could join another pod's share by naming that pod. Here the node decides:
the pool's agent binds a socket in the pool's ``shares`` directory
(``region.holding.shares.SOCKET_NAME``); an engine connects (``shares.ask_node``), and the
agent reads the pod from the kubelet's cgroup of the process that connected (``SO_PEERCRED``:
its pid on the node, hostPID; ``pod_cgroup.pod_of``), never from what was sent. It reserves a
share for that pod (``shares.reserve``, owner ``pod/<uid>``: the record and mutex the CSI and
DRA plugins use, so one share is never given twice across the three), zeroes it first when
``scrub: Always`` says so (``share_scrub.before_share_holder``, as a publish does), and answers
``{"share": i, "owner": "pod/<uid>"}``. A process in no pod's cgroup (an engine the host runs
itself, not a pod) is answered ``{"share": null}``: engines outside pods claim among themselves
by their owners, as on a pool made without an agent. The pod keeps that share across its engine's restarts
until it has no process left on the node (``shares.release_gone``, every ``SWEEP_SECONDS``).

The socket's name: made in the root-only state directory (``.state/<pool>``, which no pod is
given), its mode set there (0666: engines need not be root), then renamed into ``shares`` over
whatever stood at the name, so no path a pod can change is bound or chmodded; under the pool's
lock and only while the node's record says Ready, so a release (which removes the name with the
pool's others) never finds it made again behind it. The service checks every
``CHECK_SECONDS`` that the name is still its socket and binds again when it is not (a pool
released and made again, a name replaced). A request is at most ``MESSAGE_LIMIT``
bytes, answered within ``timeout_seconds``; at most ``max_connections`` are served at once
(more are closed at once), each in a thread of its own, so a pod holding connections open
delays no other pod for longer than that timeout.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any

from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, bounded, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import open_pool
from offloadpool.region.holding import pod_cgroup, shares
from offloadpool.region.lifecycle import share_scrub
from offloadpool.region.vocabulary import READY

log = logging.getLogger(__name__)

#: how often the socket's name is checked (and bound again when it is not ours)
CHECK_SECONDS = 1.0
#: how often reservations of pods with no process left are dropped
SWEEP_SECONDS = 10.0
#: the longest a connection is served
TIMEOUT_SECONDS = 5.0
#: the most connections served at once
MAX_CONNECTIONS = 16
#: the socket's mode: any engine's user may connect
SOCKET_MODE = 0o666
_PEERCRED = struct.Struct("3i")


class ShareService:
    """One pool's share service on this node: a thread accepting on the pool's socket."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        pool: str,
        *,
        proc: str = "/proc",
        timeout_seconds: float = TIMEOUT_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.pool_dir = places.pool_dir(root, pool)
        self.proc = proc
        self.timeout_seconds = timeout_seconds
        self.slots = threading.BoundedSemaphore(max_connections)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket's name

    # -- running -------------------------------------------------------------------------------
    def start(self) -> ShareService:
        self.thread = threading.Thread(target=self.run, name=f"shares-{self.pool_dir.name}", daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self._unbind()

    def run(self) -> None:
        swept = 0.0
        while not self.stop.is_set():
            try:
                self._keep_bound()
                if time.monotonic() - swept >= SWEEP_SECONDS:
                    swept = time.monotonic()
                    self._sweep()
            except Exception:  # never let one bad check end the service: log and go on
                log.exception("share service of %s", self.pool_dir)
            self._accept_for(CHECK_SECONDS)

    def _accept_for(self, seconds: float) -> None:
        sock = self._sock
        if sock is None:
            self.stop.wait(seconds)
            return
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([sock], [], [], left)
            if not ready:
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            if not self.slots.acquire(blocking=False):
                conn.close()  # full: the engine's client retries within its own timeout
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    # -- the socket's name ---------------------------------------------------------------------
    def _keep_bound(self) -> None:
        """Bind the socket in the pool's ``shares`` directory, or again when its name is no
        longer ours; unbind while the pool has no ``shares`` directory."""
        try:
            pfd = os.open(self.pool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self._unbind()
            return
        try:
            st = beneath.lstat(pfd, f"{shares.SHARES_NAME}/{shares.SOCKET_NAME}")
        except (OSError, beneath.WrongEntry):
            self._unbind()  # no shares directory (or not a directory): nothing to serve
            return
        finally:
            os.close(pfd)
        if st is not None and self._sock is not None and (st.st_dev, st.st_ino) == self._bound:
            return
        self._unbind()
        self._bind()

    def _bind(self) -> None:
        """Under the pool's lock (so never while a provision or release changes its names: a
        release removes the socket's name with the rest), for a Ready pool only."""
        with open_pool(self.pool_dir, lock=True) as pool:
            rec = records.load(pool)
            if rec is None or rec.phase != READY or rec.deleting or rec.orphaned:
                return
            try:
                sdir = beneath.open_dir(pool.fd, shares.SHARES_NAME)
            except (OSError, beneath.WrongEntry):
                return
            try:
                self._bind_in(pool.state_fd(), sdir)
            finally:
                os.close(sdir)

    def _bind_in(self, sfd: int, sdir: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f".{shares.SOCKET_NAME}.{secrets.token_hex(4)}"
        try:
            sock.bind(f"/proc/self/fd/{sfd}/{tmp}")
            sock.listen(64)  # before the name is there: an engine that finds it can connect
            sock.setblocking(False)
            os.chmod(tmp, SOCKET_MODE, dir_fd=sfd)  # root-only directory: nothing swapped it
            os.rename(tmp, shares.SOCKET_NAME, src_dir_fd=sfd, dst_dir_fd=sdir)
            st = os.stat(shares.SOCKET_NAME, dir_fd=sdir, follow_symlinks=False)
        except OSError as exc:
            sock.close()
            beneath.unlink(sfd, tmp)
            log.warning("cannot bind the share service of %s: %s", self.pool_dir, exc)
            return
        self._sock, self._bound = sock, (st.st_dev, st.st_ino)
        log.info("serving shares of %s", self.pool_dir)

    def _unbind(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._bound = None, None

    def _sweep(self) -> None:
        n = self._partitions()
        if n > 1:
            try:
                dropped = shares.release_gone(self.pool_dir, n, self.proc)
            except (OSError, RegionError, beneath.WrongEntry):
                return
            if dropped:
                log.info("shares %s of %s: their pods have ended", dropped, self.pool_dir)

    def _partitions(self) -> int:
        """The shares the node's record says the pool has (1 when none, or no record)."""
        try:
            rec = records.load(self.pool_dir)
            return 1 if rec is None else rec.pool_request().partitions
        except (OSError, RegionError, TypeError, ValueError):
            return 1

    # -- one request ---------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.timeout_seconds)
                cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                pid, _, _ = _PEERCRED.unpack(cred)
                try:
                    line = shares.read_line(conn)
                except shares.ShareRefused as exc:
                    answer: dict[str, Any] = {"error": str(exc)}
                else:
                    answer = self.answer(pid, line)
                conn.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            pass  # the engine went away, or sent nothing in time
        finally:
            self.slots.release()

    def answer(self, pid: int, line: bytes) -> dict[str, Any]:
        """The share for the pod of process ``pid`` (the node's pid), as the answer to send."""
        try:
            request = bounded.loads(line, shares.MESSAGE_LIMIT)
        except bounded.Malformed as exc:
            return {"error": f"not a share request: {exc}"}
        only = request.get("only") if isinstance(request, dict) else None
        if only is not None and (not isinstance(only, int) or isinstance(only, bool)):
            return {"error": "not a share request: 'only' is a share's number or null"}
        pod = pod_cgroup.pod_of(pid, self.proc)
        if pod is None:  # the host's own engine (no pod can leave the cgroup the kubelet made)
            return {"share": None, "why": f"process {pid} runs in no pod: engines claim by their owners"}
        owner = shares.hostpath_owner(pod)
        try:
            with open_pool(self.pool_dir, lock=True) as pool:
                rec = records.load(pool)  # once, under the lock: what the shares are now
                n = 1 if rec is None else rec.pool_request().partitions
                if n < 2:
                    return {"error": f"pool {pool.name} has no shares on this node now"}
                if only is not None and not 0 <= only < n:
                    return {"error": f"pool {pool.name} has {n} shares, not share {only}"}
                why = (rec.deleting or rec.orphaned) if rec is not None else ""
                if why:
                    return {"error": f"pool {pool.name} is being taken apart ({why}): no share is given"}
                index = shares.reserve(pool, n, owner, only=only, timeout=self.timeout_seconds)
                try:
                    share_scrub.before_share_holder(pool, index, owner)
                except share_scrub.ShareBusy as exc:
                    shares.unreserve(pool, index, owner)
                    return {"error": str(exc)}
        except shares.ShareRefused as exc:
            return {"error": str(exc)}
        except (OSError, RegionError, beneath.WrongEntry, TypeError, ValueError) as exc:
            return {"error": f"pool {self.pool_dir.name}: {exc}"}
        log.info("share %d of %s given to pod %s (pid %d)", index, self.pool_dir.name, pod, pid)
        return {"share": index, "owner": owner}
