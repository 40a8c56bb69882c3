"""Every kopf setting the operator relies on, set explicitly in one place.

Why each one:

- the finalizer is ours (``offloadpool.io/release``), so ``kubectl get -o yaml`` tells a user
  what holds the pool, and the agents can key on it;
- handler progress and the last-handled state live in annotations under ``offloadpool.io/``:
  kopf's default also writes ``status.kopf``, which the CRD's structural schema would prune
  (and the status belongs to the aggregate alone);
- only warnings and errors from kopf's own logging become Kubernetes Events; the operator posts
  its own Events for transitions (see ``events``), so info-level chatter does not bury them;
- watches are restarted by the server every ``OperatorConfig.watch_timeout_seconds``, so a
  silently dead connection cannot leave the operator blind for long;
- peering: ``--standalone`` (one replica, the Deployment uses Recreate) or a named peering;
- kopf watches OffloadPools only (and builds its diff base for them alone): Nodes and
  OffloadPoolNodes are watched by ``watched``, where an event costs a JSON parse instead of
  kopf's cause, diff base and handler machinery.
"""

from __future__ import annotations

import logging

import kopf

from offloadpool.api.constants import FINALIZER, GROUP

from .config import OperatorConfig


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply the operator's settings (called from the startup handler)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = config.watch_timeout_seconds
    # the client gives up a little after the server should have ended the watch
    settings.watching.client_timeout = config.watch_timeout_seconds + 30
    settings.watching.connect_timeout = 30
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    settings.batching.error_delays = (1, 2, 5, 10, 20)
    # Handler errors that are not TemporaryError are retried too (never give up on a pool).
    settings.execution.max_workers = 8
