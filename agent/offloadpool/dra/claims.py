"""A ResourceClaim as the kubelet plugin reads it: the kubelet's request names only the claim
(namespace, name, uid); what was allocated is in the claim's ``status.allocation``, read from
the API server. Only this driver's results on this node's slices are ours."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from offloadpool.api import dra
from offloadpool.api.constants import split_node_object_name
from offloadpool.region.files.names import pool_name_error

#: a claim's uid (a UUID): what becomes a directory and a record name
CLAIM_UID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


class ClaimError(ValueError):
    """The claim cannot be prepared here (gone, another uid, allocated elsewhere, not ours)."""


@dataclass(frozen=True)
class Allocated:
    """One device of ours the scheduler allocated to the claim."""

    request: str
    #: the OffloadPool's name, from the DRA pool ``<pool>.<node>``
    pool: str
    #: the DRA pool (the slice's ``spec.pool.name``)
    dra_pool: str
    device: str
    #: the share the device is (``share-<i>``); None for a whole pool's device
    share: int | None


def read(api: client.ApiClient, namespace: str, name: str, uid: str) -> dict[str, Any]:
    """The claim, checked to be the one the kubelet means (its uid)."""
    if not CLAIM_UID_PATTERN.fullmatch(uid):
        raise ClaimError(f"claim uid {uid!r} is not a uid")
    try:
        claim = client.CustomObjectsApi(api).get_namespaced_custom_object(
            dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, namespace, "resourceclaims", name
        )
    except ApiException as exc:
        if exc.status == 404:
            raise ClaimError(f"ResourceClaim {namespace}/{name} does not exist") from None
        raise
    if (claim.get("metadata") or {}).get("uid") != uid:
        raise ClaimError(f"ResourceClaim {namespace}/{name} is not uid {uid} (it was replaced)")
    return claim


def allocated(claim: dict[str, Any], node: str) -> list[Allocated]:
    """This driver's devices in the claim's allocation, each on a slice of ``node``."""
    meta = claim.get("metadata") or {}
    where = f"ResourceClaim {meta.get('namespace')}/{meta.get('name')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{where} is not allocated")
    out = []
    for result in (allocation.get("devices") or {}).get("results") or []:
        if result.get("driver") != dra.DRA_DRIVER:
            continue
        dra_pool, device = str(result.get("pool", "")), str(result.get("device", ""))
        try:
            pool, on = split_node_object_name(dra_pool)
        except ValueError:
            raise ClaimError(f"{where}: device {device} of DRA pool {dra_pool!r} is not a pool's") from None
        if pool_name_error(pool) is not None:
            raise ClaimError(f"{where}: DRA pool {dra_pool!r} names no pool")
        if on != node:
            raise ClaimError(f"{where}: device {device} is on node {on}, not {node}")
        share = dra.share_of_device(device)
        if share is None and device != dra.POOL_DEVICE:
            raise ClaimError(f"{where}: {device!r} is not a device of offloadpool.io")
        out.append(Allocated(str(result.get("request", "")), pool, dra_pool, device, share))
    if not out:
        raise ClaimError(f"{where} has no device of {dra.DRA_DRIVER}")
    pools = [a.pool for a in out]
    if len(set(pools)) != len(pools):
        raise ClaimError(f"{where}: more than one device of one pool (a claim gets one share of a pool)")
    return out
