"""Writes this node's OffloadPoolNode status — the only thing the agent ever writes.

Every write is a merge patch of the status subresource, so the agent can never touch the spec
(which the operator owns) and a field set to None is removed. The writer keeps the status it
last wrote, so a heartbeat re-sends only the fields that change (timestamp, engines attached),
and progress updates coming from populate worker threads are throttled and serialised here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from offloadpool import __version__

log = logging.getLogger(__name__)

Patch = Callable[[dict[str, Any]], Any]


class StatusWriter:
    """Thread-safe, throttled writer of one OffloadPoolNode's status.

    ``patch`` sends a merge patch of the status (``KubeAccess.patch_status``); it returns None
    when the object does not exist (yet), and may raise on API errors: a failed write is
    remembered and retried with the next write or heartbeat, never raised into provisioning.
    """

    def __init__(self, patch: Patch, clock: Callable[[], str], progress_interval: float = 0.5) -> None:
        self._patch = patch
        self._clock = clock
        self._lock = threading.Lock()
        self._written: dict[str, Any] = {}
        self._dirty: dict[str, Any] = {}
        self._last_progress = 0.0
        self.progress_interval = progress_interval
        self.phase: str = "Pending"
        self.exists = False

    @property
    def current(self) -> dict[str, Any]:
        with self._lock:
            return {**self._written, **self._dirty}

    def set(self, **fields: Any) -> bool:
        """Record ``fields`` (camelCase status keys) and write them with a fresh heartbeat."""
        with self._lock:
            if "phase" in fields and fields["phase"] is not None:
                self.phase = fields["phase"]
            self._dirty.update(fields)
            return self._flush_locked()

    def progress(self, done: int, total: int) -> None:
        """Populate progress from a worker thread; written at most every ``progress_interval`` s."""
        t = time.monotonic()
        pct = int(done * 100 // total) if total else 0
        with self._lock:
            self._dirty.update(bytesPopulated=int(min(done, total)), bytesTotal=int(total), progress=pct)
            if self.phase != "Populating":
                self.phase = "Populating"
                self._dirty["phase"] = "Populating"
            elif t - self._last_progress < self.progress_interval and done < total:
                return
            self._last_progress = t
            self._flush_locked()

    def heartbeat(self, **fields: Any) -> bool:
        """Re-send the whole status (not just changes), so a re-created object is filled again."""
        with self._lock:
            self._dirty.update(fields)
            return self._flush_locked(full=True)

    def _flush_locked(self, full: bool = False) -> bool:
        body = {
            **(self._written if full or not self.exists else {}),
            **self._dirty,
            "heartbeat": self._clock(),
            "agentVersion": __version__,
        }
        try:
            result = self._patch(body)
        except Exception as exc:  # API down, throttled, RBAC: keep the update and retry later
            log.warning("status write failed (will retry): %s", exc)
            return False
        if result is None:
            self.exists = False
            log.info("OffloadPoolNode does not exist (yet); status kept for the next write")
            return False
        self.exists = True
        self._written.update(body)
        self._dirty.clear()
        return True
