"""What the operator is told when it starts.

One frozen object, built by ``main`` from flags and environment and handed to every handler
through kopf's ``memo``, so handlers never read the environment themselves and tests can run
two operators with different settings in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offloadpool.api.constants import (
    AGENT_HTTP_PORT,
    DEFAULT_HEARTBEAT_SECONDS,
    HOST_ROOT,
    MIN_HEARTBEATS_PER_TIMEOUT,
)


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process.

    ``namespace`` is where the agent DaemonSets live (the operator's own namespace).
    ``heartbeat_timeout_seconds``: an agent whose last heartbeat is older than this is treated
    as unresponsive (its node stops counting as Ready); 0 disables the check.
    ``agent_heartbeat_seconds``: how often the agents renew their Leases (passed to them in
    their DaemonSet); the timeout must span ``MIN_HEARTBEATS_PER_TIMEOUT`` of them.
    ``resync_seconds``: a pool is re-reconciled at least this often even without events, which
    is what notices stale heartbeats and repairs objects someone deleted by hand.
    ``node_object_grace_seconds``: agents create their own OffloadPoolNode when they start; the
    operator creates it for a selected node whose agent has not after this long (an agent that
    never starts still shows as a Pending OffloadPoolNode). 0: at once, in the first pass.
    """

    namespace: str = "offloadpool-system"
    agent_image: str = "ghcr.io/offloadpool/offloadpool:latest"
    agent_image_pull_policy: str = "IfNotPresent"
    agent_service_account: str = "offloadpool-agent"
    agent_cpu_request: str = "100m"
    #: The agent's own memory (Python, client, HTTP server) on top of the pool's memory.
    agent_memory_overhead: str = "256Mi"
    agent_priority_class: str | None = None
    host_root: str = HOST_ROOT
    http_port: int = AGENT_HTTP_PORT
    heartbeat_timeout_seconds: float = 60.0
    #: The agents' heartbeat: N nodes cost N / this Lease renewals a second, for ever. A big
    #: cluster may renew less often (with a timeout to match), as it may its kubelets.
    agent_heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS
    resync_seconds: float = 15.0
    node_object_grace_seconds: float = 30.0
    #: Pause after an event before a pass, so a burst of agent updates costs one pass.
    debounce_seconds: float = 0.5
    #: While events keep coming, a pool's passes use at most this share of a core: a pass over
    #: N nodes costs O(N), and a pool of thousands converging must not spend its operator's
    #: CPU on passes that each find a few more nodes Ready (see ``pass_pause``).
    pass_cpu_share: float = 0.05
    #: The longest such pause (a pass is never put off longer than this by its own cost).
    max_pass_pause_seconds: float = 5.0
    #: Writes of one step of a pass (Node marks, OffloadPoolNodes made, rollout advances) in
    #: flight at once: a pass that finds hundreds of nodes Ready no longer waits for each answer
    #: in turn (``writes``). 1: one after another.
    write_concurrency: int = 8
    #: Delay between checks while a deleted pool waits for its nodes to release.
    deletion_retry_seconds: float = 3.0

    def problem(self) -> str | None:
        """What makes these settings unusable, in words (None: nothing): said before the
        operator starts, not found later as nodes that flap between Ready and unresponsive."""
        if not self.agent_heartbeat_seconds > 0:
            return f"--agent-heartbeat must be positive, got {self.agent_heartbeat_seconds:g}"
        if self.heartbeat_timeout_seconds < 0:
            return (
                f"--heartbeat-timeout must be 0 (never) or positive, got {self.heartbeat_timeout_seconds:g}"
            )
        least = MIN_HEARTBEATS_PER_TIMEOUT * self.agent_heartbeat_seconds
        if 0 < self.heartbeat_timeout_seconds < least:
            return (
                f"--heartbeat-timeout {self.heartbeat_timeout_seconds:g} is shorter than "
                f"{MIN_HEARTBEATS_PER_TIMEOUT} agent heartbeats (--agent-heartbeat "
                f"{self.agent_heartbeat_seconds:g}, so at least {least:g}): a renewal a little late "
                "would make a healthy node unready"
            )
        return None

    def pass_pause(self, pass_cpu_seconds: float) -> float:
        """Seconds to wait after a wake-up before the next pass, given the last pass's CPU
        besides its writes (``PassResult.paced_cpu_seconds``): the debounce, or longer when
        passes are expensive (a pass of 50 ms: 1 s)."""
        paced = pass_cpu_seconds / self.pass_cpu_share if self.pass_cpu_share > 0 else 0.0
        return max(self.debounce_seconds, min(self.max_pass_pause_seconds, paced))


def default_namespace() -> str:
    """The operator's namespace: POD_NAMESPACE (downward API) when running in a pod."""
    return os.environ.get("POD_NAMESPACE") or OperatorConfig.namespace
