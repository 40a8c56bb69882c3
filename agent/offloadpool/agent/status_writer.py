"""Writes this node's OffloadPoolNode status — the only thing the agent ever writes.

Every write is a merge patch of the status subresource, so the agent can never touch the spec
(which the operator owns) and a field set to None is removed. The writer keeps the status it
last wrote, so a heartbeat writes nothing unless a field changed (liveness is the Lease's
job: every status write wakes the operator, a Lease renewal does not), and progress updates
coming from populate worker threads are throttled and serialised here. ``heartbeat`` in the
status is the time of the last status write.

Transient states are deferred, not dropped. Each status write is a watch event the operator
must process, and at 1,000 nodes an agent's Provisioning, Populating, first progress and Ready
— 3-4 writes within a second of each other — are the operator's main input while a pool
converges. So the transient phases (``set(..., defer=True)``: Provisioning, Populating) and
populate progress are recorded at once (``current``, ``phase`` and the agent's metrics see
them) but written only ``progress_interval`` later: when a later ``set`` (Ready, Failed,
anything not deferred) comes first, that one write carries everything, and the deferred flush
then finds nothing changed and writes nothing. A populate that outlasts ``progress_interval``
still shows Populating, its progress updated at most every ``progress_interval``.

Fields are named as the status model (``offloadpool.api.node.OffloadPoolNodeStatus``) names
them and go through it (``status_patch``): a misspelt name raises here, where a raw camelCase
key would be written and then silently pruned by the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from offloadpool import __version__
from offloadpool.api.node import OffloadPoolNodeStatus, status_patch
from offloadpool.region.vocabulary import PENDING, POPULATING, SCRUBBING

log = logging.getLogger(__name__)

Patch = Callable[[dict[str, Any]], Any]

#: Seconds a transient phase or a progress update waits before it is written (and, so, the
#: most often progress is written): a later write within that time carries it instead.
PROGRESS_INTERVAL = 0.5
#: A failed write is tried again after this many seconds, doubling up to RETRY_MAX_SECONDS
#: (or after the server's Retry-After, when it sent one): a Ready refused by a busy API server
#: (429) must not wait for the next heartbeat to be seen.
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 10.0


def retry_after(exc: BaseException) -> float:
    """The Retry-After the API server sent with a refusal (429, 503), in seconds; 0 if none."""
    headers = getattr(exc, "headers", None) or {}
    value = str(headers.get("Retry-After", "") if hasattr(headers, "get") else "")
    return float(value) if value.isdigit() else 0.0


_POPULATING = status_patch(phase=POPULATING)


class StatusWriter:
    """Thread-safe, throttled writer of one OffloadPoolNode's status.

    ``patch`` sends a merge patch of the status (``KubeAccess.patch_status``); it returns None
    when the object does not exist (yet), and may raise on API errors: a failed write is
    remembered and retried by the flusher thread (after RETRY_FIRST_SECONDS, doubling, or the
    server's Retry-After) or with the next write, whichever comes first — never raised into
    provisioning.

    Populate workers call :meth:`progress`; it only records the numbers and wakes a flusher
    thread, so a slow API server never stalls a worker in the middle of pre-faulting. The same
    thread writes deferred changes (progress, ``set(defer=True)``) ``progress_interval`` after
    the first of them was recorded, unless a write carried them before: a pool that converges
    within ``progress_interval`` costs one status write, not one per transient phase.
    """

    def __init__(
        self, patch: Patch, clock: Callable[[], str], progress_interval: float = PROGRESS_INTERVAL
    ) -> None:
        self._patch = patch
        self._clock = clock
        self._lock = threading.Lock()  # guards the dicts below; never held across a request
        self._io_lock = threading.Lock()  # one request at a time, in order
        self._written: dict[str, Any] = {}
        self._dirty: dict[str, Any] = {}
        self._kick = threading.Event()
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._due: float | None = None  # monotonic time the deferred changes in _dirty are written
        self._retry = 0.0  # seconds before the next retry of a failed write (0: none failed)
        self.progress_interval = progress_interval
        self.phase: str = PENDING
        self.exists = False
        #: the object as our last status write left it (its watch event is our own news: the
        #: agent does not wake for it, and takes it as the object's latest known state)
        self.written_object: dict[str, Any] | None = None
        #: monotonic time of the last write that went through: its ``heartbeat`` field showed
        #: the agent alive as its heartbeat Lease does (``Heartbeat.beat``)
        self.written_at = float("-inf")

    @property
    def current(self) -> OffloadPoolNodeStatus:
        """The status as written, with what is still to be written laid over it."""
        with self._lock:
            return OffloadPoolNodeStatus.model_validate({**self._written, **self._dirty})

    def set(self, *, full: bool = False, defer: bool = False, **fields: Any) -> bool:
        """Record ``fields`` (``OffloadPoolNodeStatus`` field names; None removes a field) and
        write those that changed now, with a fresh ``heartbeat`` timestamp; nothing is written
        when none changed.

        Liveness is the heartbeat Lease's job, so an unchanged status costs no write and wakes
        no one. ``full`` re-sends the whole status (an object that lost it: re-created, or
        written by someone else); so does the first write after the object was missing.

        ``defer`` (a transient phase: Provisioning, Populating) records the fields at once but
        leaves the write to the flusher thread, ``progress_interval`` later, so a next ``set``
        that comes sooner (Ready, Failed) writes both in one request. ``full`` is never deferred.
        """
        patch = status_patch(**fields)
        with self._lock:
            if patch.get("phase") is not None:
                self.phase = patch["phase"]
            self._dirty.update(patch)
            if defer and not full:
                self._defer()
                return True
        return self._flush(full=full)

    def progress(self, done: int, total: int) -> None:
        """Populate (or scrub) progress from a worker thread: recorded at once, written by the
        flusher thread at most every ``progress_interval`` seconds. While Scrubbing every page
        stays populated: only ``progress`` moves (the share zeroed)."""
        pct = int(done * 100 // total) if total else 0
        with self._lock:
            if self.phase == SCRUBBING:
                self._dirty.update(status_patch(progress=pct))
                self._defer()
                return
            patch = status_patch(bytes_populated=int(min(done, total)), bytes_total=int(total), progress=pct)
            self._dirty.update(patch)
            if self.phase != POPULATING:
                self.phase = POPULATING
                self._dirty.update(_POPULATING)
            self._defer()

    def _defer(self, delay: float | None = None) -> None:
        """Have the flusher write ``_dirty`` ``delay`` (default ``progress_interval``) from now,
        unless a write is already due sooner (or carries it first). Called with ``_lock`` held."""
        if self._due is None:
            self._due = time.monotonic() + (self.progress_interval if delay is None else delay)
        if self._flusher is None and not self._closed:
            self._flusher = threading.Thread(target=self._flush_deferred, name="status-deferred", daemon=True)
            self._flusher.start()
        self._kick.set()

    @property
    def written_version(self) -> str | None:
        """resourceVersion of ``written_object``."""
        return ((self.written_object or {}).get("metadata") or {}).get("resourceVersion")

    def close(self) -> None:
        """Let the flusher thread end (the agent has stopped): deferred changes stay unwritten,
        as when the process exits. The flusher otherwise waits for work for ever, one idle
        thread per stopped agent — a thread each of the scale test's thousands of agents left
        behind in its process."""
        with self._lock:
            self._closed = True
        self._kick.set()

    def _flush_deferred(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            while True:
                with self._lock:
                    due, closed = self._due, self._closed
                if closed:
                    return
                if due is None:
                    break  # a write carried the deferred changes already
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # then look again: a write meanwhile may have carried them
                    continue
                self._flush()

    def _flush(self, full: bool = False) -> bool:
        with self._io_lock:
            with self._lock:
                sent = {
                    k: v
                    for k, v in self._dirty.items()
                    if full or k not in self._written or self._written[k] != v
                }
                self._due = None  # this write carries whatever was deferred
                if not sent and not full and self.exists:
                    self._dirty.clear()
                    return True  # nothing changed: no write (a late progress flush, a repeated set)
                body = {
                    **(self._written if full or not self.exists else {}),
                    **sent,
                    **status_patch(heartbeat=self._clock(), agent_version=__version__),
                }
                self._dirty.clear()
            refusal: Exception | None = None
            try:
                result = self._patch(body)
            except Exception as error:  # API down, throttled, RBAC: keep the update and retry later
                log.warning("status write failed (will retry): %s", error)
                result, refusal = None, error
            with self._lock:
                if result is None:
                    self._dirty = {**sent, **self._dirty}  # newer values recorded meanwhile win
                    if refusal is not None:
                        self._retry = min(RETRY_MAX_SECONDS, 2 * self._retry or RETRY_FIRST_SECONDS)
                        self._defer(max(self._retry, retry_after(refusal)))
                    else:
                        self.exists = False
                        log.info("OffloadPoolNode does not exist (yet); status kept for the next write")
                    return False
                self._retry = 0.0
                self.exists = True
                self.written_object = result
                self.written_at = time.monotonic()
                self._written.update(body)
                return True
