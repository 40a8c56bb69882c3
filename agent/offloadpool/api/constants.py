"""Names of the offloadpool API: group, version, kinds, plurals, the names derived from a
pool's name (label key, extended resource, OffloadPoolNode name), and the node-side places
every component must agree on (the agents' host root, the agent's HTTP port).

Kept free of pydantic so the operator, the agent and the CLI agree on every derived name by
importing one function instead of formatting strings in three places. (Importing it still runs
``offloadpool.api``'s ``__init__``, which loads pydantic: the stdlib-only engine library,
``offloadpool.region`` and ``offloadpool.pinning``, never imports this package; the values the
engine also needs, such as the default medium and the file limit, are the engine's own
constants in ``offloadpool.region.request``, which ``offloadpool.api`` imports.)
"""

from __future__ import annotations

# A pool's name (a DNS label of at most ``MAX_POOL_NAME`` characters, some reserved): the rule
# is the engine's own, since the node side checks every name it is given before it makes a path.
from offloadpool.region.files.names import MAX_POOL_NAME as MAX_POOL_NAME
from offloadpool.region.files.names import POOL_NAME_PATTERN as POOL_NAME_PATTERN
from offloadpool.region.files.names import RESERVED_POOL_NAMES as RESERVED_POOL_NAMES
from offloadpool.region.files.names import RESERVED_POOL_PREFIXES as RESERVED_POOL_PREFIXES
from offloadpool.region.files.names import pool_name_error as _name_error

GROUP = "offloadpool.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

POOL_KIND = "OffloadPool"
NODE_KIND = "OffloadPoolNode"
POOL_PLURAL = "offloadpools"
NODE_PLURAL = "offloadpoolnodes"
PLURALS = {POOL_KIND: POOL_PLURAL, NODE_KIND: NODE_PLURAL}
SHORT_NAMES = {POOL_KIND: ("op", "opool"), NODE_KIND: ("opn",)}
#: ``kubectl get offloadpool-all`` lists both kinds. Not ``offloadpool``: kubectl resolves a
#: category before a singular name, so that would break ``kubectl get offloadpool <name>``.
CATEGORY = "offloadpool-all"
CRD_NAMES = {kind: f"{plural}.{GROUP}" for kind, plural in PLURALS.items()}

#: Label the operator sets on a Node while the pool is Ready there (value ``ready``).
POOL_LABEL_PREFIX = f"pool.{GROUP}/"
POOL_LABEL_READY = "ready"
#: Label the operator sets on every Node where some pool is Ready (value ``true``), removed with
#: the last pool's label: one fixed key (a node affinity cannot match a key prefix) that keeps the
#: operator off the nodes whose privileged agents could read its token (the chart's default
#: ``operator.affinity``).
POOL_NODE_LABEL = f"node.{GROUP}/pools"
POOL_NODE_VALUE = "true"
#: Label the operator puts on objects it renders for a pool (DaemonSet, its pods).
POOL_NAME_LABEL = f"{GROUP}/pool"
FINALIZER = f"{GROUP}/release"

#: The host directory holding every pool's directory (``<root>/<pool>/``) on a node: the
#: agents' hostPath, the webhook's pod volumes, and the CLI's default (``agent_env.ROOT_ENV``).
HOST_ROOT = "/var/lib/offloadpool"
#: The kubelet's directory on a node (its ``--root-dir``): every pod's volumes (``pods/``), the
#: plugins' sockets and their registry (``plugins/``, ``plugins_registry/``), the pod-resources
#: socket. The CSI plugin serves below it; the guard webhook refuses hostPaths reaching it. A
#: kubelet with another root is named to both (the chart's ``csi.kubeletDir``).
KUBELET_DIR = "/var/lib/kubelet"
#: The agent's one HTTP port (/healthz, /readyz, /metrics).
AGENT_HTTP_PORT = 9475

#: The longest message offloadpool writes anywhere: an Event's note (the API server refuses
#: more than 1 kB) and an OffloadPool's ``failingNodes[].message`` (the CRD's maxLength).
#: Longer text is cut (``clip_message``), never refused: a failure must still be reported.
MAX_MESSAGE_LENGTH = 1024
#: The longest ``failingNodes[].reason`` (the CRD's maxLength; an agent's reason is cut to it).
MAX_REASON_LENGTH = 128

#: Liveness, the way the kubelet reports it: each agent renews a small coordination.k8s.io
#: Lease named like its OffloadPoolNode, in the agents' namespace, labelled with its pool.
#: Renewals are cheap writes nobody watches, so a heartbeat never wakes the operator; the
#: OffloadPoolNode's status is written only when something in it changes.
LEASE_API_VERSION = "coordination.k8s.io/v1"
#: The operator's heartbeat timeout must span at least this many agent heartbeats (the agent's
#: ``AgentConfig.heartbeat_seconds``, which the operator passes to every agent): a renewal
#: a little late (a busy API server, a step that provisions) must not make a node unready.
MIN_HEARTBEATS_PER_TIMEOUT = 3


def pool_name_error(name: str) -> str | None:
    """Why ``name`` cannot name a pool (the same rules the CRD's CEL enforces), or None."""
    return _name_error(name, "metadata.name")


def pool_label_key(pool: str) -> str:
    """``pool.offloadpool.io/<pool>``: the Node label meaning "this pool is Ready here"."""
    return POOL_LABEL_PREFIX + pool


def extended_resource_name(pool: str) -> str:
    """``offloadpool.io/<pool>``: the extended resource a Node advertises while the pool is Ready."""
    return f"{GROUP}/{pool}"


def node_object_name(pool: str, node: str) -> str:
    """Name of the OffloadPoolNode for ``pool`` on ``node`` (the CRD insists on exactly this)."""
    return f"{pool}.{node}"


def split_node_object_name(name: str) -> tuple[str, str]:
    """Inverse of node_object_name: pool names have no dots, so the first dot splits."""
    pool, sep, node = name.partition(".")
    if not sep or not pool or not node:
        raise ValueError(f"{name!r} is not an OffloadPoolNode name of the form <pool>.<node>")
    return pool, node


def clip_message(text: str) -> str:
    """``text`` cut to ``MAX_MESSAGE_LENGTH`` characters, for an Event or a status message."""
    return text[:MAX_MESSAGE_LENGTH]
