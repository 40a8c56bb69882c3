"""The agent DaemonSet of one pool: rendered from the pool (pure), then applied.

Choices, and why:

- **Resources.** The agent pod requests (and is limited to) the pool's memory, so the
  scheduler accounts for it and never places pods that would need it: huge-page media request
  ``hugepages-2Mi``/``hugepages-1Gi`` equal to the capacity (Kubernetes requires requests ==
  limits for huge pages, and a cpu or memory request next to them); tmpfs media request
  ``memory`` = capacity + the agent's own overhead, because tmpfs pages are charged to the
  memory cgroup of the process that first touches them, and the agent pre-faults them: a
  smaller limit would get the agent OOM-killed mid-populate.
- **Host root.** One hostPath volume (``/var/lib/offloadpool``, DirectoryOrCreate) with
  ``mountPropagation: Bidirectional``: the agent mounts the pool's hugetlbfs/tmpfs inside it and
  the mount must propagate back to the host, where inference pods get it by hostPath.
- **Privileges.** ``privileged: true``: mount(2) needs CAP_SYS_ADMIN, and the API server only
  accepts Bidirectional propagation on privileged containers, so privileged is the least that
  works. ``hostPID: true``: the agent must see every process on the node that maps or opens
  the pool's files or holds its lease (``offloadpool.region.holding.holders``), and the other pods'
  processes are visible only in the host's pid namespace; without it stock vLLM in a pod would
  be invisible and a release could free memory it still uses. No hostNetwork or hostIPC, one
  hostPath, read-only root file system.
- **Probes.** Liveness on ``/healthz`` (the agent loop is alive; stays healthy while
  populating), readiness on ``/readyz`` (the region is Ready), both on the agent's one port.
- **Updates.** ``updateStrategy: OnDelete``: changing the template never restarts an agent by
  itself, so no agent is replaced under an attached engine; spec changes reach the nodes
  through ``OffloadPoolNode.spec.targetGeneration`` instead (see ``rollout``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from offloadpool.api import agent_env
from offloadpool.api.constants import POOL_NAME_LABEL
from offloadpool.api.media import SCHEDULING_RESOURCE, is_hugetlbfs
from offloadpool.api.node import pool_owner_reference
from offloadpool.api.quantity import format_quantity, parse_quantity
from offloadpool.api.spec import DEFAULT_MEDIUM

from .config import OperatorConfig

NAME_PREFIX = "offloadpool-agent-"
APP_LABEL = "app.kubernetes.io/name"
APP_NAME = "offloadpool-agent"
CONTAINER_NAME = "agent"
VOLUME_NAME = "host-root"
#: Hash of the rendered object; the operator replaces the DaemonSet only when it changes.
HASH_ANNOTATION = "offloadpool.io/rendered-hash"


def daemonset_name(pool: str) -> str:
    """``offloadpool-agent-<pool>`` (pool names are at most 40 characters: fits 63)."""
    return NAME_PREFIX + pool


def selector_labels(pool: str) -> dict[str, str]:
    """The DaemonSet's (immutable) pod selector."""
    return {APP_LABEL: APP_NAME, POOL_NAME_LABEL: pool}


def pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node an agent pod (as JSON) is for: spec.nodeName once bound, else the node affinity
    the DaemonSet controller pins each of its pods to (matchFields metadata.name)."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return spec["nodeName"]
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or ():
        for field in term.get("matchFields") or ():
            if field.get("key") == "metadata.name" and field.get("operator") == "In" and field.get("values"):
                return field["values"][0]
    return None


def owner_reference(pool_body: Mapping[str, Any]) -> dict[str, Any]:
    """The pool as controlling owner, so garbage collection removes the object with the pool."""
    return {**pool_owner_reference(pool_body), "blockOwnerDeletion": True}


def resources(spec: Mapping[str, Any], config: OperatorConfig) -> dict[str, dict[str, str]]:
    """Requests and limits that make the scheduler account for the pool's memory."""
    medium = spec.get("medium", DEFAULT_MEDIUM)
    capacity = parse_quantity(spec["capacity"])
    overhead = parse_quantity(config.agent_memory_overhead)
    if is_hugetlbfs(medium):
        pages = {SCHEDULING_RESOURCE[medium]: format_quantity(capacity)}
        memory = {"memory": format_quantity(overhead)}
        return {
            "requests": {**pages, **memory, "cpu": config.agent_cpu_request},
            "limits": {**pages, **memory},
        }
    memory = {"memory": format_quantity(capacity + overhead)}
    return {"requests": {**memory, "cpu": config.agent_cpu_request}, "limits": dict(memory)}


def _env(pool: str, spec: Mapping[str, Any], config: OperatorConfig) -> list[dict[str, Any]]:
    def field(path: str) -> dict[str, Any]:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    return [
        {"name": agent_env.NODE_NAME_ENV, "valueFrom": field("spec.nodeName")},
        {"name": agent_env.POD_NAMESPACE_ENV, "valueFrom": field("metadata.namespace")},
        {"name": agent_env.POOL_NAME_ENV, "value": pool},
        {"name": agent_env.ROOT_ENV, "value": config.host_root},
        {"name": agent_env.HTTP_PORT_ENV, "value": str(config.http_port)},
        {"name": agent_env.HTTP_ADDRESS_ENV, "value": config.agent_http_address},
        {"name": agent_env.HEARTBEAT_ENV, "value": f"{config.agent_heartbeat_seconds:.15g}"},  # 10.0: "10"
        # what ``resources`` were made for: the agent never applies another capacity under them
        {
            "name": agent_env.SIZED_FOR_ENV,
            "value": agent_env.sized_for(
                spec.get("medium", DEFAULT_MEDIUM), parse_quantity(spec["capacity"])
            ),
        },
    ]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def render(pool_body: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """The agent DaemonSet for ``pool_body`` (a plain dict, ready to create)."""
    pool = pool_body["metadata"]["name"]
    spec = pool_body.get("spec") or {}
    labels = {
        **selector_labels(pool),
        "app.kubernetes.io/component": "agent",
        "app.kubernetes.io/part-of": "offloadpool",
        "app.kubernetes.io/managed-by": "offloadpool-operator",
    }
    container = {
        "name": CONTAINER_NAME,
        "image": config.agent_image,
        "imagePullPolicy": config.agent_image_pull_policy,
        "command": ["offloadpool-agent"],
        "args": ["--pool", pool],
        "env": _env(pool, spec, config),
        "ports": [{"name": "http", "containerPort": config.http_port, "protocol": "TCP"}],
        "resources": resources(spec, config),
        "volumeMounts": [
            {"name": VOLUME_NAME, "mountPath": config.host_root, "mountPropagation": "Bidirectional"}
        ],
        "livenessProbe": _probe("/healthz", period=10, failures=6),
        "readinessProbe": _probe("/readyz", period=5, failures=1),
        "securityContext": {"privileged": True, "runAsUser": 0, "readOnlyRootFilesystem": True},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": config.agent_service_account,
        "hostPID": True,
        "containers": [container],
        "volumes": [
            {"name": VOLUME_NAME, "hostPath": {"path": config.host_root, "type": "DirectoryOrCreate"}}
        ],
        "nodeSelector": dict(spec.get("nodeSelector") or {}),
        "tolerations": [dict(t) for t in spec.get("tolerations") or ()],
        # The agent exits promptly on SIGTERM without touching the memory.
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
    }
    if config.agent_priority_class:
        pod_spec["priorityClassName"] = config.agent_priority_class
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": daemonset_name(pool),
            "namespace": config.namespace,
            "labels": labels,
            "ownerReferences": [owner_reference(pool_body)],
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(pool)},
            "updateStrategy": {"type": "OnDelete"},
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    body["metadata"]["annotations"] = {HASH_ANNOTATION: rendered_hash(body)}
    return body


def rendered_hash(body: Mapping[str, Any]) -> str:
    """A short digest of what we render (not of what the API server defaults around it)."""
    essence = {
        "metadata": {k: body["metadata"][k] for k in ("labels", "ownerReferences")},
        "spec": body["spec"],
    }
    return hashlib.sha256(json.dumps(essence, sort_keys=True).encode()).hexdigest()[:16]
