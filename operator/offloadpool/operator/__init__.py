"""The offloadpool operator (kopf): one agent DaemonSet per OffloadPool, one OffloadPoolNode per
selected Node, pool status aggregated from the agents' reports, Node labels and an extended
resource while a pool is Ready on a node, a finalizer that waits for the agents to release.

Modules, one concept each:

- ``config``      what the operator is told at start (namespace, agent image, timeouts);
- ``settings``    the kopf settings, all explicit;
- ``selection``   which Nodes a pool selects (nodeSelector + taints/tolerations), pure, and
                  ``Selection``, which keeps the answers per Node between passes;
- ``daemonset``   the agent DaemonSet rendered from a pool, pure, plus applying it;
- ``nodes``       OffloadPoolNode objects and the Node labels/extended resource;
- ``rollout``     which OffloadPoolNodes may take a new pool generation now, pure;
- ``aggregate``   OffloadPoolNode statuses -> pool status and conditions, pure;
- ``events``      Kubernetes Events derived from status transitions;
- ``reconcile``   one pass over one pool, computed from current state only;
- ``writes``      a pass's writes of one step sent several at once;
- ``handlers``    the kopf handlers that trigger passes;
- ``admission``   what a pod labelled ``offloadpool.io/pool`` gets, and refusals, pure;
- ``admission_handlers`` the kopf mutating/validating handlers (only with ``--webhook``);
- ``webhook``     the webhook's options and HTTPS server (kopf's), kept in its configurations;
- ``webhookconfig`` the Mutating/ValidatingWebhookConfiguration, rendered (pure) and patched;
- ``certs``       the webhook's certificates: given, or made with a private CA;
- ``main``        the ``offloadpool-operator`` command.

Nothing here is imported by the node-side library: imports flow region/api <- operator.
"""
