"""Whether the API server still accepts this agent's token, and when to give up on it.

A 401 is not a passing failure like a 429 or an outage: the token's ServiceAccount was deleted
(perhaps made again), and no retry of this process can mend that, as the kubelet serves a
restarted container the same cached token. So a 401 that lasts is the one failure the agent
exits for: the exit shows on the pod (restarts, CrashLoopBackOff, the last log line says why),
and only a new pod gets a token that works (the operator replaces a pod made before its
ServiceAccount). Memory is never touched by the exit.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

#: After the API server has refused our credential (401) for this many heartbeat periods in a
#: row, the agent stops its loop and so exits non-zero (``main``).
UNAUTHORIZED_PERIODS = 6
#: How often the 401 is logged while it lasts (the first time at once).
UNAUTHORIZED_LOG_SECONDS = 60.0


class Credential:
    """The token's standing with the API server: every answer but a 401 accepts it; 401s in a
    row for ``UNAUTHORIZED_PERIODS`` heartbeats reject it and stop the loop (``stop``)."""

    def __init__(self, heartbeat_seconds: float, retry_seconds: float, stop: threading.Event) -> None:
        self.heartbeat_seconds = heartbeat_seconds
        self.retry_seconds = retry_seconds
        self.stop = stop
        #: set when the loop stopped because the credential no longer authenticates
        self.rejected = False
        #: since when (monotonic) every request was refused with 401, and when that was last logged
        self._unauthorized_since: float | None = None
        self._unauthorized_logged = float("-inf")

    def accepted(self) -> None:
        """A request went through: whatever 401s came before, the token authenticates."""
        self._unauthorized_since = None

    def refused(self) -> float:
        """A read or a heartbeat refused with 401: say so plainly (once a minute, not every
        retry), and once it has lasted ``UNAUTHORIZED_PERIODS`` heartbeats stop the loop, so the
        process exits non-zero (``main``) instead of retrying for ever. Returns the delay before
        the next step."""
        clock = time.monotonic()
        if self._unauthorized_since is None:
            self._unauthorized_since = clock
        lasted = clock - self._unauthorized_since
        if lasted >= UNAUTHORIZED_PERIODS * self.heartbeat_seconds:
            log.error(
                "the API server has refused this agent's token (401 Unauthorized) for %.0fs: exiting. "
                "The token's ServiceAccount was deleted (and perhaps made again); this pod can get no "
                "other token, the next pod will (the operator replaces a pod made before its "
                "ServiceAccount; or delete this pod). The memory on the node is untouched.",
                lasted,
            )
            self.rejected = True
            self.stop.set()
            return 0.0
        if clock - self._unauthorized_logged >= UNAUTHORIZED_LOG_SECONDS:
            self._unauthorized_logged = clock
            log.error(
                "the API server refuses this agent's token (401 Unauthorized): its ServiceAccount "
                "was probably deleted (helm uninstall, kubectl delete); exiting if it lasts %.0fs",
                UNAUTHORIZED_PERIODS * self.heartbeat_seconds,
            )
        return self.retry_seconds
