"""A step's wish to come back sooner than its action asks: a refused write's backoff.

A step's action says when the next step is due (a heartbeat period when all is well, the retry
period after a failure). A write the API server refused on the way — the OffloadPoolNode's
create, a heartbeat — must not wait that long: a new pool's agents all start together and are
one ServiceAccount, so API priority and fairness answers many of their first requests 429 at
once, and a heartbeat that does not go through is how the operator takes a live agent for a
silent one. So such a write asks to come back after the server's Retry-After, or 1 s doubling
per failure in a row, each with up to half again at random so the agents' retries spread, and
never later than the retry period. The step takes the earliest wish (``bound``).
"""

from __future__ import annotations

import random

from kubernetes.client.rest import ApiException

from offloadpool.agent.status_writer import RETRY_FIRST_SECONDS, retry_after


class RetrySoon:
    """The earliest delay asked for by the refused writes of the step under way (0: none)."""

    def __init__(self, retry_seconds: float) -> None:
        self.retry_seconds = retry_seconds
        self._soon = 0.0

    def reset(self) -> None:
        """A new step: no wish yet."""
        self._soon = 0.0

    def after(self, exc: ApiException, failures: int) -> None:
        """Come back for a write refused ``failures`` times in a row (the client already sent a
        throttled request again several times: ``kube.throttled_retries``)."""
        delay = max(retry_after(exc), RETRY_FIRST_SECONDS * 2 ** (failures - 1))
        soon = min(self.retry_seconds, delay * random.uniform(1.0, 1.5))
        self._soon = min(self._soon, soon) if self._soon else soon

    def bound(self, delay: float) -> float:
        """The step's delay, or sooner when a refused write asked for it."""
        return min(delay, self._soon) if self._soon else delay
