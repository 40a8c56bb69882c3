"""The DeviceClass of a DRA pool (``spec.consumers.delivery: DRA``): rendered from the pool
(pure), applied and removed by the reconciler through ``kube``.

Why a class per pool: a pod keeps asking for ``offloadpool.io/<pool>: 1`` (the webhook writes
it, or the pod does), and Kubernetes' DRA extended resources (KEP-5004, GA in 1.37) satisfy such
a request with a device of the DeviceClass whose ``spec.extendedResourceName`` is that name, on
a node that does not advertise the resource itself (the scheduler's
``filterExtendedResources``: backed by a class *and* the node's allocatable 0). So the class
names exactly the pool's resource and selects exactly that pool's devices of the driver, and
the operator advertises no node resource for a DRA pool (``Reconciler._pass``). One class per
pool: a class maps one resource name, and the chart's ``offloadpool.io`` class selects every
pool's devices.

The class is owned by the pool (the garbage collector removes it with the pool, should the
operator be gone), and the operator deletes it itself as soon as the pool is being deleted or
stops being a DRA pool: from then on the resource is no longer satisfied by DRA.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from offloadpool.api import dra
from offloadpool.api.constants import POOL_NAME_LABEL
from offloadpool.region.vocabulary import DELIVERY_DRA

from .daemonset import APP_LABEL, owner_reference

#: ``app.kubernetes.io/name`` of the classes the operator renders (the write policy checks it).
APP_NAME = "offloadpool-deviceclass"


def wanted(pool_body: Mapping[str, Any]) -> bool:
    """Whether the pool has a DeviceClass: a DRA pool that is not being deleted."""
    if (pool_body.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return is_dra(pool_body.get("spec") or {})


def is_dra(spec: Mapping[str, Any]) -> bool:
    """Whether the pool is handed out by DRA (``spec.consumers.delivery``), read from the stored
    spec as it is (the CRD's enum holds the value; a pass does not validate the whole spec for
    one field)."""
    consumers = spec.get("consumers")
    return isinstance(consumers, Mapping) and consumers.get("delivery") == DELIVERY_DRA


def labels(pool: str) -> dict[str, str]:
    return {APP_LABEL: APP_NAME, POOL_NAME_LABEL: pool}


def render(pool_body: Mapping[str, Any]) -> dict[str, Any]:
    """The pool's DeviceClass: its devices of the driver, standing for its extended resource."""
    pool = pool_body["metadata"]["name"]
    return {
        "apiVersion": dra.RESOURCE_API_VERSION,
        "kind": dra.DEVICE_CLASS_KIND,
        "metadata": {
            "name": dra.pool_device_class(pool),
            "labels": labels(pool),
            "ownerReferences": [owner_reference(pool_body)],
        },
        "spec": {
            "selectors": [{"cel": {"expression": dra.pool_device_selector(pool)}}],
            "extendedResourceName": dra.pool_extended_resource(pool),
        },
    }


def essence(body: Mapping[str, Any]) -> dict[str, Any]:
    """What of a class (rendered or stored) the operator owns: its pool label and app label, its
    owner and its spec. A stored class differing here is replaced."""
    meta = body.get("metadata") or {}
    mine = labels(str((meta.get("labels") or {}).get(POOL_NAME_LABEL, "")))
    present = meta.get("labels") or {}
    return {
        "labels": {k: present.get(k) for k in mine},
        "ownerReferences": meta.get("ownerReferences"),
        "spec": body.get("spec"),
    }


def rendering(body: Mapping[str, Any]) -> str:
    """A short digest of what ``render`` made (so a pass knows it applied the same)."""
    return hashlib.sha256(json.dumps(essence(body), sort_keys=True).encode()).hexdigest()[:16]
