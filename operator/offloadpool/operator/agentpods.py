"""What a pool's agent pods say about agents that do not report: the scheduler's reason for a
pod it cannot place, and a pod whose token belongs to an earlier incarnation of its
ServiceAccount. Pure functions of the pods (as JSON) and the ServiceAccounts' creation times.

Why the second: a pod's projected token is bound to the ServiceAccount's uid. Delete the
ServiceAccount (``helm uninstall`` of a chart that did not keep it, ``kubectl delete sa``) and
make it again, and every agent pod made before holds a token the API server answers 401 for ever:
the kubelet serves the same cached token to a restarted container until it is near expiry (an
hour), so only a new pod gets a working one. The API server refuses to make a pod whose
ServiceAccount does not exist, so a pod made before its ServiceAccount's creationTimestamp can
only hold a token of an earlier one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from offloadpool.api.base import parse_time

from .daemonset import pod_node

#: Longest scheduler message kept in a pool's status (the scheduler's can list every node).
MAX_MESSAGE = 512


def unschedulable(pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """node -> why the scheduler cannot place that node's agent pod (its ``PodScheduled=False``
    condition: reason and message), for every pod not being deleted that has one."""
    found: dict[str, str] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        node = pod_node(pod)
        for cond in (pod.get("status") or {}).get("conditions") or ():
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and node:
                reason = cond.get("reason") or "Unschedulable"
                message = " ".join(str(cond.get("message") or "").split())
                found[node] = f"{reason}: {message}"[:MAX_MESSAGE] if message else reason
    return found


def service_accounts(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """The ServiceAccounts the pods run as."""
    return {(pod.get("spec") or {}).get("serviceAccountName") or "default" for pod in pods}


def stale_credentials(
    pods: Iterable[Mapping[str, Any]], created: Mapping[str, datetime | None]
) -> list[Mapping[str, Any]]:
    """Pods (not being deleted) made before their ServiceAccount: their tokens cannot
    authenticate. ``created``: ServiceAccount name -> its creationTimestamp (None or absent:
    it does not exist now, and no new pod could be made either, so none is named)."""
    stale = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
        made, since = parse_time(meta.get("creationTimestamp")), created.get(account)
        if meta.get("deletionTimestamp") or made is None or since is None:
            continue
        if made < since:
            stale.append(pod)
    return stale


def never_ran(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """Nodes where no agent pod has ever run a container: every pod for the node (being deleted
    or not) is either not bound to it (the scheduler could not place it) or bound with every
    container and init container reported waiting, never started and never restarted (an image
    that cannot be pulled). A pod bound to its node whose kubelet has reported nothing yet is
    not counted: its agent may be running. A node with no agent pod is not counted either."""
    verdicts: dict[str, bool] = {}
    for pod in pods:
        node = pod_node(pod)
        if node:
            verdicts[node] = verdicts.get(node, True) and _never_ran(pod)
    return {node for node, never in verdicts.items() if never}


def _never_ran(pod: Mapping[str, Any]) -> bool:
    if not (pod.get("spec") or {}).get("nodeName"):
        return True  # only the kubelet of the node it is bound to starts a pod's containers
    status = pod.get("status") or {}
    containers = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    if not containers:
        return False  # the kubelet has said nothing yet
    return all(
        set(c.get("state") or {}) <= {"waiting"}
        and not (c.get("lastState") or {})
        and not c.get("restartCount")
        and not c.get("started")
        for c in containers
    )
