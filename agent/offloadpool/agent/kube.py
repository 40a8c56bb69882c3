"""Kubernetes access for the agent: the API client and the names of the objects it touches.

The agent talks to exactly five things: its OffloadPool (read/watch, by name), its own
OffloadPoolNode (create when missing, read/watch by name, write status), its heartbeat Lease
in its namespace (create, renew), Events (create), and its pool's ResourceSlice on its node
(read, create, replace, delete by name: ``agent.slices``).
Keeping the calls here keeps RBAC easy to audit against what the code does.
"""

from __future__ import annotations

import logging
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from urllib3.util.retry import Retry

from offloadpool.api import base, dra
from offloadpool.api.constants import (
    API_VERSION,
    GROUP,
    LEASE_API_VERSION,
    NODE_PLURAL,
    POOL_KIND,
    POOL_NAME_LABEL,
    POOL_PLURAL,
    VERSION,
    clip_message,
    split_node_object_name,
)
from offloadpool.api.node import new_object

MERGE = "application/merge-patch+json"
#: events about cluster-scoped objects must live here (API server validation)
EVENT_NAMESPACE = "default"

log = logging.getLogger(__name__)


#: How often one request refused with 429 is sent again before the refusal is the caller's.
THROTTLED_RETRIES = 5


def throttled_retries() -> Retry:
    """Send a request the API server refused with 429 again after its Retry-After, as
    client-go does for every verb (a 429 from API priority and fairness or max-in-flight means
    the request was not processed, so a create or patch is as safe to repeat as a read).

    A new pool's agents all make their first writes at once, and they share one ServiceAccount,
    which priority and fairness treats as one flow: at 1,000 nodes the API server refuses
    hundreds of Lease and OffloadPoolNode writes, and an agent that waited for its next step
    to try again would take a heartbeat period or more each time (docs/scale.md). Connection
    failures are retried as urllib3's default does; a read that failed mid-way is not (the
    request may have been carried out: the agent's loop decides what to do next).
    """
    return Retry(
        total=None,
        connect=3,
        read=0,
        redirect=3,
        status=THROTTLED_RETRIES,
        other=0,
        allowed_methods=None,  # every verb: only 429 is retried on a status, see above
        status_forcelist=frozenset({429}),
        respect_retry_after_header=True,
        backoff_factor=0.5,  # only where a 429 came without Retry-After
        backoff_jitter=0.5,
        raise_on_status=False,  # the last 429 becomes the client's ApiException, as before
    )


def configuration(kubeconfig: str | None = None) -> client.Configuration:
    """In-cluster configuration when running in a pod, else the given (or default) kubeconfig;
    throttled requests retried (``throttled_retries``)."""
    cfg = client.Configuration()
    loaded = False
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=cfg)
            loaded = True
        except config.ConfigException:
            pass
    if not loaded:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.retries = throttled_retries()
    # The proxy from the environment, taken once: otherwise the client takes it again at every
    # request (both loaders' token-refresh hooks set ``host``, whose setter calls
    # urllib.request.getproxies(), which reads the whole environment) — 0.1 ms a request with
    # 35 variables, and a pod's environment holds seven per Service of its namespace.
    cfg.proxy = cfg.proxy
    return cfg


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    return client.ApiClient(configuration(kubeconfig))


def now() -> str:
    """RFC 3339 UTC timestamp with seconds precision, as Kubernetes writes a metav1.Time."""
    return base.format_time(base.now().replace(microsecond=0))


def micro_now() -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return base.format_micro_time(base.now())


class KubeAccess:
    """The agent's handful of API calls, with 404 turned into None."""

    def __init__(self, api: client.ApiClient, pool: str, node_object: str, namespace: str) -> None:
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.pool = pool
        self.node_object = node_object
        self.namespace = namespace
        self._lease_exists = False  # as far as this process knows

    def get_pool(self) -> dict[str, Any] | None:
        return self._get(POOL_PLURAL, self.pool)

    def get_pool_node(self) -> dict[str, Any] | None:
        return self._get(NODE_PLURAL, self.node_object)

    def create_pool_node(self, pool: dict[str, Any]) -> dict[str, Any] | None:
        """Create our OffloadPoolNode (the pool's current generation as its target) and return
        it; when it exists already (the operator or an earlier agent made it), read it. None
        when it vanished between the two."""
        node = split_node_object_name(self.node_object)[1]
        generation = int((pool.get("metadata") or {}).get("generation") or 1)
        try:
            return self.custom.create_cluster_custom_object(
                GROUP, VERSION, NODE_PLURAL, new_object(pool, node, generation)
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
        return self.get_pool_node()

    def _get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_cluster_custom_object(GROUP, VERSION, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- the pool's ResourceSlice on this node (``agent.slices``) -------------------------------
    def get_slice(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_cluster_custom_object(
                dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_cluster_custom_object(
            dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, body
        )

    def replace_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT with the read object's resourceVersion: a 409 when it changed meanwhile."""
        return self.custom.replace_cluster_custom_object(
            dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, name, body
        )

    def delete_slice(self, name: str) -> None:
        """Delete it; one already gone is deleted."""
        try:
            self.custom.delete_cluster_custom_object(
                dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.SLICE_PLURAL, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def patch_status(self, status: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch our OffloadPoolNode's status subresource; None if the object is gone."""
        try:
            return self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, NODE_PLURAL, self.node_object, {"status": status}
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def renew_heartbeat(self, duration_seconds: int, pool: dict[str, Any]) -> None:
        """Renew our heartbeat Lease (creating it on first use): one small write per heartbeat.

        Owned by the pool, so the garbage collector removes it with the pool. A merge patch of
        ``renewTime`` only; a 404 (the Lease was deleted) creates it. The first renewal of this
        process creates it straight away (a new pool's agents would otherwise each make a
        PATCH that fails first), and patches it if it was there already.
        """
        stamp = micro_now()
        if not self._lease_exists:
            created = self._create_heartbeat(stamp, duration_seconds, pool)  # a refusal raises here
            self._lease_exists = True  # made now, or there already (a restarted agent)
            if created:
                return
        try:
            self.coordination.patch_namespaced_lease(
                self.node_object, self.namespace, {"spec": {"renewTime": stamp}}, _content_type=MERGE
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._create_heartbeat(stamp, duration_seconds, pool)  # deleted: made again

    def _create_heartbeat(self, stamp: str, duration_seconds: int, pool: dict[str, Any]) -> bool:
        """Create the Lease; False if it exists already (a racing step or a restart)."""
        meta = pool.get("metadata") or {}
        body = {
            "apiVersion": LEASE_API_VERSION,
            "kind": "Lease",
            "metadata": {
                "name": self.node_object,
                "namespace": self.namespace,
                "labels": {POOL_NAME_LABEL: self.pool},
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": POOL_KIND,
                        "name": meta.get("name"),
                        "uid": meta.get("uid"),
                    }
                ]
                if meta.get("uid")
                else [],
            },
            "spec": {
                "holderIdentity": self.node_object,
                "leaseDurationSeconds": int(duration_seconds),
                "acquireTime": stamp,
                "renewTime": stamp,
            },
        }
        try:
            self.coordination.create_namespaced_lease(self.namespace, body)
            return True
        except ApiException as exc:
            if exc.status != 409:
                raise
            return False

    def event(self, obj: dict[str, Any], kind: str, reason: str, note: str, type_: str = "Normal") -> None:
        """Record a core/v1 Event about ``obj`` (our OffloadPoolNode); failures are logged, never fatal.

        core/v1 (not events.k8s.io) because that is what kopf and kubectl describe use, so the
        operator's and the agent's events read as one story. The OffloadPoolNode is
        cluster-scoped, and the API server accepts events about cluster-scoped objects only in
        the ``default`` namespace, so that is where they go (as kopf's do).
        """
        meta = obj.get("metadata", {})
        stamp = base.now()
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta.get('name', 'offloadpool')}.", namespace=EVENT_NAMESPACE
            ),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION,
                kind=kind,
                name=meta.get("name"),
                uid=meta.get("uid"),
                resource_version=meta.get("resourceVersion"),
            ),
            reason=reason,
            message=clip_message(note),
            type=type_,
            first_timestamp=stamp,
            last_timestamp=stamp,
            count=1,
            source=client.V1EventSource(
                component="offloadpool-agent", host=split_node_object_name(self.node_object)[1]
            ),
            reporting_component="offloadpool.io/agent",
            reporting_instance=self.node_object[:128],
        )
        try:
            self.core.create_namespaced_event(EVENT_NAMESPACE, body)
        except ApiException as exc:
            log.warning(
                "could not record event %s: %s %s %s", reason, exc.status, exc.reason, (exc.body or "")[:300]
            )
