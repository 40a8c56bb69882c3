"""The kopf admission handlers (imported by ``main`` only with ``--webhook``: kopf refuses to
start with admission handlers and no server): the mutation and its check for pods labelled
``offloadpool.io/pool``, and the guard for every pod holding a hostPath or a pool resource.

They are thin: read the pool from the API server (fresh, so a pool created a second ago is
known), ask ``admission`` whether to refuse and what to add, and answer. Both refuse an
unknown pool, a pool being deleted, and a namespace the pool's ``spec.consumers.namespaces``
leaves out, with a message that says which. The validating one also refuses a labelled pod the
mutation did not reach (its configuration removed or edited, a later webhook undoing it): such a
pod would run without its pool's memory and without the lease that protects it; and what the
mutation keys by name (the pool's volumes and mounts, the sidecar) must be exactly what it
writes. The guard (``hostguard``) refuses, labelled or not, a hostPath reaching the host root
or the kubelet's directory other than the labelled pool's own volume, and an
``offloadpool.io/*`` resource other than the labelled pool's.

The handler ids are the URL paths the webhook configurations call (``webhookconfig``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from offloadpool.api.constants import POOL_KIND, pool_name_error
from offloadpool.api.pods import GUARD_PATH, MUTATE_PATH, POD_POOL_LABEL, VALIDATE_PATH

from . import admission, hostguard
from .webhook import WebhookRuntime

FORBIDDEN = 403


def _webhook(memo: kopf.Memo) -> WebhookRuntime:
    return memo["webhook"]


@kopf.on.startup()
def configure_admission(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.admission.server = _webhook(memo).server()
    settings.admission.managed = None  # the operator keeps the configurations itself (webhookconfig)


@kopf.on.cleanup()
def cleanup_admission(memo: kopf.Memo, **_: Any) -> None:
    _webhook(memo).cleanup()


async def _pool_for(
    pod: Mapping[str, Any], namespace: str | None, runtime: WebhookRuntime
) -> dict[str, Any] | None:
    """The pool the pod asks for, or None when the pod is none of the webhook's business.
    Raises AdmissionError when the pod must be refused."""
    if not admission.in_scope(pod, namespace, runtime.options.injection):
        return None
    name = admission.requested_pool(pod) or ""
    pool = None
    if pool_name_error(name) is None:  # a label that cannot name a pool is not looked up
        pool = await asyncio.to_thread(runtime.get_pool, name)
    why = admission.refusal(name, namespace, pool)
    if why:
        raise kopf.AdmissionError(why, code=FORBIDDEN)
    return pool


@kopf.on.mutate(
    "", "v1", "pods", id=MUTATE_PATH, operations=["CREATE"], labels={POD_POOL_LABEL: kopf.PRESENT}
)
async def mutate_pod(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    runtime = _webhook(memo)
    pod = dict(body)
    namespace = body.metadata.namespace
    pool = await _pool_for(pod, namespace, runtime)
    if pool is None:
        return
    try:
        new = admission.mutate(pod, pool, runtime.options.injection)
    except admission.Refused as exc:
        raise kopf.AdmissionError(str(exc), code=FORBIDDEN) from None
    changed = [key for key, value in new["spec"].items() if (pod.get("spec") or {}).get(key) != value]
    for key in changed:
        patch.spec[key] = new["spec"][key]
    name = pool["metadata"]["name"]
    if not (pool.get("status") or {}).get("readyNodes"):
        warnings.append(
            f"{POOL_KIND} {name!r} is Ready on no node yet: the pod stays Pending until it is "
            f"(kubectl get offloadpool {name})"
        )
    if changed:
        logger.info(
            "pod %s/%s: pool %s injected (%s)",
            namespace,
            body.metadata.name or body.metadata.get("generateName"),
            name,
            ", ".join(changed),
        )


@kopf.on.validate(
    "", "v1", "pods", id=VALIDATE_PATH, operations=["CREATE"], labels={POD_POOL_LABEL: kopf.PRESENT}
)
async def validate_pod(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = _webhook(memo)
    pod = dict(body)
    pool = await _pool_for(pod, body.metadata.namespace, runtime)
    if pool is None:
        return
    settings = runtime.options.injection
    try:
        found = admission.differences(pod, pool, settings)
    except admission.Refused as exc:
        raise kopf.AdmissionError(str(exc), code=FORBIDDEN) from None
    _refuse(
        hostguard.refusals(
            pod, settings.guarded(), pool["metadata"]["name"], admission.volumes(pool, settings)
        )
    )
    if found:
        raise kopf.AdmissionError(
            admission.unmutated_refusal(pool["metadata"]["name"], found, runtime.options.configuration),
            code=FORBIDDEN,
        )


def _refuse(why: list[str]) -> None:
    if why:
        raise kopf.AdmissionError("; ".join(why), code=FORBIDDEN)


@kopf.on.validate("", "v1", "pods", id=GUARD_PATH, operations=["CREATE"])
async def guard_pod(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Any pod the API server sends (a hostPath or a pool resource, labelled or not): it may hold
    of the host root only what its labelled pool's mutation gives."""
    runtime = _webhook(memo)
    settings = runtime.options.injection
    pod = dict(body)
    namespace = body.metadata.namespace
    if namespace in settings.excluded_namespaces:  # the configuration leaves them out; restated
        return
    why = hostguard.refusals(pod, settings.guarded(), None)
    dra = await _dra_resources(pod, namespace, runtime) if why else set()
    if dra:
        why = hostguard.refusals(pod, settings.guarded(), None, dra_resources=dra)
    name = admission.requested_pool(pod)
    if not why or name is None:
        _refuse(why)
        return
    pool = None
    if pool_name_error(name) is None:
        pool = await asyncio.to_thread(runtime.get_pool, name)
    denied = admission.refusal(name, namespace, pool)
    if denied or pool is None:
        raise kopf.AdmissionError(f"{'; '.join(why)} ({denied})", code=FORBIDDEN)
    _refuse(
        hostguard.refusals(
            pod, settings.guarded(), name, admission.volumes(pool, settings), dra_resources=dra
        )
    )


#: most pools a pod's resources name that the guard looks up (each a read of the API server)
DRA_LOOKUPS = 8


async def _dra_resources(pod: Mapping[str, Any], namespace: str | None, runtime: WebhookRuntime) -> set[str]:
    """The pod's ``offloadpool.io/<pool>`` resources whose pool is delivered by DRA and allows
    the pod's namespace: requested by hand, labelled or not, they bring nothing of the host (the
    scheduler allocates a device of the pool's DeviceClass; the plugin checks the claim's
    namespace again at prepare). At most ``DRA_LOOKUPS`` pools are read; others stay refused."""
    out = set()
    for resource in sorted(hostguard.pool_resources(pod))[:DRA_LOOKUPS]:
        name = resource[len(hostguard.RESOURCE_PREFIX) :]
        if pool_name_error(name) is not None:
            continue
        pool = await asyncio.to_thread(runtime.get_pool, name)
        if pool is None or not admission.dra_delivery(pool):
            continue
        if admission.refusal(name, namespace, pool) is None:
            out.add(resource)
    return out
