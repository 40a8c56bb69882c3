"""The agent's heartbeat: its coordination.k8s.io Lease, renewed as the kubelet renews a node's.

The Lease is named like the OffloadPoolNode (``<pool>.<node>``), in the agent's namespace, owned
by the pool, and its ``renewTime`` is how the operator tells a live agent from a silent one. It
is the agents' heartbeat, never to be confused with the engine's lease (the flock an inference
process holds on a pool: ``offloadpool.region.holding.lease``). A status write shows the agent alive
too (the operator takes the later of the Lease's ``renewTime`` and the status' ``heartbeat``),
so the heartbeat is sent only when neither went through in the last half period.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.rest import ApiException

from offloadpool.agent import kube
from offloadpool.agent.credential import Credential
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.retry_soon import RetrySoon
from offloadpool.agent.status_writer import StatusWriter

log = logging.getLogger(__name__)

#: The Lease's leaseDurationSeconds, in heartbeat periods (as the kubelet: 40 s for 10 s renewals).
DURATION_PERIODS = 4


@dataclass(kw_only=True)
class Heartbeat:
    """Renews the heartbeat Lease at most every half period, after the step's own work."""

    access: kube.KubeAccess
    #: our status writes: one that went through showed the agent alive too
    status: StatusWriter
    metrics: AgentMetrics
    credential: Credential
    soon: RetrySoon
    heartbeat_seconds: float
    #: when (monotonic) the last heartbeat went through
    _sent: float = field(default=float("-inf"), init=False)
    #: heartbeats refused in a row
    _failures: int = field(default=0, init=False)

    def beat(self, pool: dict[str, Any]) -> None:
        """Renew the heartbeat Lease (creating it first), unless this agent showed itself alive
        less than half a heartbeat period ago — by a heartbeat, or by a status write. So a step
        that wrote the status sends nothing, and a new agent, which writes its status as soon as
        its region is built, makes its Lease a heartbeat later: a pool that converges within a
        heartbeat costs no Lease write at all. A failure is logged and the step goes on; the
        next step comes soon (``RetrySoon``), not a heartbeat period later, and tries again."""
        now = time.monotonic()
        if now - max(self._sent, self.status.written_at) < self.heartbeat_seconds / 2:
            return
        try:
            self.access.renew_heartbeat(max(1, round(self.heartbeat_seconds * DURATION_PERIODS)), pool)
            self._sent = now
            self._failures = 0
            self.credential.accepted()
        except ApiException as exc:
            if exc.status == 401:  # every heartbeat, where reads come only every REREAD_PERIODS
                self.credential.refused()
                return
            log.warning("cannot renew the heartbeat Lease: %s %s", exc.status, exc.reason)
            self.metrics.error("LeaseRenew")
            self._failures += 1
            self.soon.after(exc, self._failures)
