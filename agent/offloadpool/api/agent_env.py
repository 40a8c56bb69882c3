"""The agent's environment: the variables the operator's DaemonSet sets and the agent reads.

The environment is the agent's primary interface (flags exist for running one by hand), so it is
a contract between two processes that are released together but run apart: the operator writes
these names into every agent pod (``offloadpool.operator.daemonset``) and the agent's settings
(``offloadpool.agent.config``) read them. One module, so the two can never disagree on a name.
The defaults are the agent's settings' (``AgentConfig``), not repeated here. Plain strings only,
like ``constants``.
"""

from __future__ import annotations

#: The OffloadPool this agent provisions (the DaemonSet sets it from the pool's name).
POOL_NAME_ENV = "POOL_NAME"
#: This node's name (downward API ``spec.nodeName``).
NODE_NAME_ENV = "NODE_NAME"
#: The pod's namespace, where its heartbeat Lease and Events go (downward API
#: ``metadata.namespace``); the operator reads the same name for its own namespace.
POD_NAMESPACE_ENV = "POD_NAMESPACE"
#: The host root holding every pool's directory; also the CLI's (``offloadpool status`` on a node).
ROOT_ENV = "OFFLOADPOOL_ROOT"
#: The agent's one HTTP port (/healthz, /readyz, /metrics).
HTTP_PORT_ENV = "OFFLOADPOOL_HTTP_PORT"
#: The address that port binds: the operator passes its ``--agent-http-address`` in it.
HTTP_ADDRESS_ENV = "OFFLOADPOOL_HTTP_ADDRESS"
#: Seconds between Lease renewals and steps: the operator passes its ``--agent-heartbeat`` in it.
HEARTBEAT_ENV = "OFFLOADPOOL_HEARTBEAT_SECONDS"
#: Seconds between retries after a failure.
RETRY_ENV = "OFFLOADPOOL_RETRY_SECONDS"
#: What the pod's requests and limits were made for: the pool's medium and capacity in bytes,
#: ``<medium>/<bytes>`` (``sized_for``). An agent whose pool now asks for another never applies
#: it under limits made for the old one: it waits for the operator to replace its pod.
SIZED_FOR_ENV = "OFFLOADPOOL_SIZED_FOR"


def sized_for(medium: str, capacity: int) -> str:
    """The ``SIZED_FOR_ENV`` value of a pod made for ``capacity`` bytes of ``medium``."""
    return f"{medium}/{capacity}"


#: Pre-fault workers, replacing the pool's ``spec.prefault.workers`` when not 0.
WORKERS_ENV = "OFFLOADPOOL_WORKERS"
#: DEBUG, INFO, WARNING.
LOG_LEVEL_ENV = "OFFLOADPOOL_LOG_LEVEL"
#: A kubeconfig file (the kubernetes client's own name); unset: in-cluster credentials.
KUBECONFIG_ENV = "KUBECONFIG"
