"""What the operator is told when it starts.

One frozen object, built by ``main`` from flags and environment and handed to every handler
through kopf's ``memo``, so handlers never read the environment themselves and tests can run
two operators with different settings in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from offloadpool.agent.config import AgentConfig
from offloadpool.api.agent_env import POD_NAMESPACE_ENV
from offloadpool.api.constants import AGENT_HTTP_PORT, HOST_ROOT, KUBELET_DIR, MIN_HEARTBEATS_PER_TIMEOUT


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process.

    Each field's default is written here and nowhere else: the flags (``main``) take their
    defaults from these fields, the chart passes a flag only for a value it is given, and the
    docs and tests read them from here.
    """

    namespace: str = "offloadpool-system"
    """Where the agent DaemonSets live: the operator's own namespace (``--namespace``; in a pod
    the downward API's, see ``default_namespace``)."""
    agent_image: str = "ghcr.io/offloadpool/offloadpool:latest"
    """The agents' image (``--agent-image``)."""
    agent_image_pull_policy: str = "IfNotPresent"
    """The agents' imagePullPolicy (``--agent-image-pull-policy``)."""
    agent_service_account: str = "offloadpool-agent"
    """The ServiceAccount the agent pods run as (``--agent-service-account``)."""
    agent_cpu_request: str = "100m"
    """CPU request of every agent pod (``--agent-cpu-request``)."""
    agent_memory_overhead: str = "256Mi"
    """The agent's own memory (Python, client, HTTP server) on top of the pool's memory: tmpfs
    pools request and are limited to capacity + this (``--agent-memory-overhead``)."""
    agent_priority_class: str | None = None
    """The agent pods' priorityClassName (``--agent-priority-class``); None: none."""
    host_root: str = HOST_ROOT
    """The host root the agents' hostPath mounts (the API's ``HOST_ROOT``; no flag)."""
    kubelet_dir: str = KUBELET_DIR
    """The kubelet's directory on the nodes, its ``--root-dir`` (``--kubelet-dir``; the chart
    passes ``csi.kubeletDir``): the guard webhook refuses every hostPath reaching it (the root,
    anything under it: ``pods/``, ``plugins/`` with the CSI plugin's socket, ``plugins_registry/``,
    ``pod-resources/``, and every directory that contains it), as it does the host root's."""
    http_port: int = AGENT_HTTP_PORT
    """The agents' HTTP port (the API's ``AGENT_HTTP_PORT``; no flag)."""
    agent_http_address: str = AgentConfig.http_address
    """The address the agents' HTTP port binds, passed to them in their DaemonSet
    (``--agent-http-address``; the agent's own default: every address of its pod)."""
    heartbeat_timeout_seconds: float = 60.0
    """An agent whose last heartbeat is older than this is treated as unresponsive: its node
    stops counting as Ready (``--heartbeat-timeout``; 0 disables the check). It must span
    ``MIN_HEARTBEATS_PER_TIMEOUT`` agent heartbeats (``problem``)."""
    agent_heartbeat_seconds: float = AgentConfig.heartbeat_seconds
    """How often the agents renew their Leases, passed to them in their DaemonSet
    (``--agent-heartbeat``; the agent's own default). N nodes cost N / this Lease renewals a
    second, for ever: a big cluster may renew less often (with a timeout to match), as it may
    its kubelets."""
    resync_seconds: float = 15.0
    """A pool gets a pass at least this often even without events (``--resync``): what notices
    stale heartbeats and repairs objects someone deleted by hand."""
    node_object_grace_seconds: float = 30.0
    """Agents create their own OffloadPoolNode when they start; the operator creates it for a
    selected node whose agent has not after this long, so an agent that never starts still shows
    as a Pending OffloadPoolNode (``--node-object-grace``; 0: at once, in the first pass)."""
    debounce_seconds: float = 0.5
    """Pause after an event before a pass, so a burst of agent updates costs one pass (no flag)."""
    pass_cpu_share: float = 0.05
    """While events keep coming, a pool's passes use at most this share of a core: a pass over
    N nodes costs O(N), and a pool of thousands converging must not spend its operator's CPU on
    passes that each find a few more nodes Ready (see ``pass_pause``; no flag)."""
    max_pass_pause_seconds: float = 5.0
    """The longest such pause: a pass is never put off longer than this by its own cost."""
    failed_pass_retry_seconds: float = 1.0
    """After a pass that failed, the next waits this long, doubled after each further failure
    (``failed_pass_delay``; no flag)."""
    failed_pass_retry_max_seconds: float = 30.0
    """The longest wait after failed passes."""
    write_concurrency: int = 8
    """Writes of one step of a pass (Node marks, OffloadPoolNodes made, rollout advances) in
    flight at once, so a pass that finds hundreds of nodes Ready does not wait for each answer
    in turn (``--write-concurrency``; 1: one after another)."""
    deletion_retry_seconds: float = 3.0
    """Delay between checks while a deleted pool waits for its nodes to release
    (``--deletion-retry``)."""
    watch_timeout_seconds: int = 270
    """The API server ends each of the operator's watches (kopf's of the pools, ``watched``'s of
    Nodes and OffloadPoolNodes) after this long, and it is resumed from the last
    resourceVersion: a connection that died silently cannot leave the operator blind for longer
    (no flag)."""
    liveness: str = "http://0.0.0.0:8080/healthz"
    """The liveness endpoint, kopf's answer served within ``endpoints.HttpBounds`` (``--liveness``;
    empty: none). The chart's livenessPort sets it."""

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

    def failed_pass_delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` passes in a row failed (1, 2, 4, ... up to the
        longest)."""
        return min(self.failed_pass_retry_max_seconds, self.failed_pass_retry_seconds * 2 ** (failures - 1))


def default_namespace() -> str:
    """The operator's namespace: POD_NAMESPACE (downward API) when running in a pod."""
    return os.environ.get(POD_NAMESPACE_ENV) or OperatorConfig.namespace
