"""Every kopf setting the operator relies on, set explicitly in one place.

Why each one:

- the finalizer is ours (``offloadpool.io/release``), so ``kubectl get -o yaml`` tells a user
  what holds the pool, and the agents can key on it;
- handler progress and the last-handled state live in annotations under ``offloadpool.io/``:
  kopf's default also writes ``status.kopf``, which the CRD's structural schema would prune
  (and the status belongs to the aggregate alone);
- only warnings and errors from kopf's own logging become Kubernetes Events; the operator posts
  its own Events for transitions (see ``events``), so info-level chatter does not bury them;
- watches are restarted by the server every few minutes, so a silently dead connection cannot
  leave the operator blind for long;
- peering: ``--standalone`` (one replica, the Deployment uses Recreate) or a named peering;
- the diff base (kopf's "last handled" essence) is built for pools only: kopf builds it for
  every event of every watched kind, deep-copying the body, but only pools have handlers that
  act on changes; for Nodes and OffloadPoolNodes — thousands of events while a big pool
  converges — that copy was the largest single cost of the operator.
"""

from __future__ import annotations

import logging

import kopf

from offloadpool.api.constants import FINALIZER, GROUP, POOL_KIND


class PoolDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff base, built only for OffloadPools (see the module docstring).

    Other kinds get an empty essence: they have only event/index handlers, for which kopf
    builds the essence and throws it away, never storing it.
    """

    def build(self, *, body: kopf.Body, extra_fields: object = None) -> kopf.BodyEssence:
        if body.get("kind") != POOL_KIND:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def configure(settings: kopf.OperatorSettings) -> None:
    """Apply the operator's settings (called from the startup handler)."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = PoolDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = True
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = 30
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    settings.batching.error_delays = (1, 2, 5, 10, 20)
    # Handler errors that are not TemporaryError are retried too (never give up on a pool).
    settings.execution.max_workers = 8
