"""The few API calls the operator makes, each idempotent, through the official client.

Every call tolerates the outcome it was after already being true (409 on create, 404 on
delete), because after a kill -9 the next operator repeats whatever the last one may or may
not have finished. Calls are synchronous; the reconciler runs in a worker thread.

Bodies go out as plain dicts and answers come back as plain JSON (``_preload_content=False``):
turning each answer into the client's model objects (a whole V1Node for every label written)
would cost more CPU than everything else the operator does per node.

The writes made once per node of a pool (create an OffloadPoolNode, mark a Node, advance a
rollout) and the pool status go through ``Kube.send``: straight into the client's own urllib3
connection pool for the API server (its connections, TLS settings, proxy and retries, and the
client's auth headers), without the generated method's per-call argument validation and
serialisation or the REST layer's and pool manager's per-request work. Those layers cost a fifth
of each write's client CPU (bench/api_write.py), and these writes are most of the operator's
CPU while a pool converges (docs/scale.md).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from offloadpool.api import dra
from offloadpool.api.base import parse_time
from offloadpool.api.constants import GROUP, NODE_PLURAL, POOL_NAME_LABEL, POOL_PLURAL, VERSION

from . import deviceclass
from .daemonset import HASH_ANNOTATION

log = logging.getLogger(__name__)

#: The client's default for a dict body is a JSON patch; every patch here is a merge patch
#: (``null`` removes a key), so say so on each call.
MERGE = "application/merge-patch+json"
POOLS_PATH = f"/apis/{GROUP}/{VERSION}/{POOL_PLURAL}"
NODE_OBJECTS_PATH = f"/apis/{GROUP}/{VERSION}/{NODE_PLURAL}"
#: The client's API classes the operator calls, named at import on purpose: the client imports
#: an API's module on first use of its name, and pydantic then builds the call validators of
#: all its methods (~89,000 objects and 0.8 s for these four). ``main`` freezes the heap of its
#: imports before kopf runs, so these are frozen with it; imported later (by ``Kube`` in the
#: startup handler), every full collection walked them — 24 ms each on a quiet machine, 55
#: under load, one of them within each 1,000-node pool's convergence.
API_CLASSES = (
    kubernetes.client.CustomObjectsApi,
    kubernetes.client.CoreV1Api,
    kubernetes.client.AppsV1Api,
    kubernetes.client.CoordinationV1Api,
)
#: How long ``send`` reuses the auth headers. The client's in-cluster loader re-reads a
#: rotated ServiceAccount token at most once a minute itself, so this delays no rotation.
AUTH_REUSE_SECONDS = 30.0


def load_client() -> kubernetes.client.ApiClient:
    """In-cluster credentials in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def _json(call: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an API method and return its answer as plain JSON (errors still raise ApiException)."""
    resp = call(*args, _preload_content=False, **kwargs)
    try:
        data = resp.data
    finally:
        resp.release_conn()
    return json.loads(data) if data else None


class Kube:
    """Typed access to pools, OffloadPoolNodes, Nodes and DaemonSets."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        self._auth: tuple[float, dict[str, str]] = (float("-inf"), {})
        self._connection_pool: urllib3.HTTPConnectionPool | None = None
        self._spent = threading.local()
        self.custom, self.core, self.apps, self.coordination = (api(client) for api in API_CLASSES)

    def _auth_headers(self) -> dict[str, str]:
        made, headers = self._auth
        if time.monotonic() - made >= AUTH_REUSE_SECONDS:
            headers = {}
            # the client's own auth (and its token refresh hook) fills them in
            self.client.update_params_for_auth(headers, [], ["BearerToken"], "", "", None)
            self._auth = (time.monotonic(), headers)
        return headers

    def _connections(self) -> urllib3.HTTPConnectionPool:
        """The client's connection pool for the API server, looked up once: the lookup parses
        the URL and builds a pool key each time, a cost paid on every write otherwise."""
        if self._connection_pool is None:
            cfg = self.client.configuration
            self._connection_pool = self.client.rest_client.pool_manager.connection_from_url(cfg.host)
        return self._connection_pool

    def write_cpu_seconds(self) -> float:
        """CPU this thread has spent in ``send`` (every write goes through it) so far."""
        return getattr(self._spent, "seconds", 0.0)

    def send(self, method: str, path: str, body: Any, content_type: str = MERGE) -> Any:
        """One request with a JSON body through the client's connection pool; the answer as
        plain JSON.

        The pool is the one the client's REST layer uses for the API server
        (``connection_from_url`` returns it, made with the client's TLS, proxy and retry
        settings), so nothing about the connection differs from a generated call. Errors raise
        the client's ``ApiException`` (``.status`` and ``.headers`` as from the generated
        methods).
        """
        started = time.thread_time()
        try:
            return self._send(method, path, body, content_type)
        finally:
            self._spent.seconds = self.write_cpu_seconds() + time.thread_time() - started

    def _send(self, method: str, path: str, body: Any, content_type: str) -> Any:
        cfg = self.client.configuration
        headers = {"Accept": "application/json", "Content-Type": content_type, **self._auth_headers()}
        # the path alone, as the pool is the host's; through a proxy the whole URL, as the
        # pool manager itself would send it
        url = cfg.host + path if cfg.proxy else path
        payload = json.dumps(body).encode()
        try:
            resp = self._connections().urlopen(method, url, body=payload, headers=headers)
        except urllib3.exceptions.ClosedPoolError:  # the manager dropped it: take the new one
            self._connection_pool = None
            resp = self._connections().urlopen(method, url, body=payload, headers=headers)
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        data = resp.data
        return json.loads(data) if data else None

    # -- pools ---------------------------------------------------------------------------
    def get_pool(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_pool_status(self, name: str, status: Mapping[str, Any]) -> None:
        try:
            self.send("PATCH", f"{POOLS_PATH}/{name}/status", {"status": dict(status)})
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- OffloadPoolNodes ---------------------------------------------------------------
    def list_all_node_objects(self, **kwargs: Any) -> Any:
        """List (or, with ``watch=True``, watch) every OffloadPoolNode: the call ``watched``
        makes; kwargs are the list call's (``_preload_content=False`` for raw JSON)."""
        return self.custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, **kwargs)

    def create_node_object(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The object as created now; None when it existed already."""
        try:
            return self.send("POST", NODE_OBJECTS_PATH, dict(body), "application/json")
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    def delete_node_object(self, name: str) -> bool:
        """True when deleted now, False when it was gone already."""
        try:
            _json(self.custom.delete_cluster_custom_object, GROUP, VERSION, NODE_PLURAL, name)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def patch_node_object(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """The object as patched."""
        return self.send("PATCH", f"{NODE_OBJECTS_PATH}/{name}", dict(patch))

    # -- agents' heartbeat Leases ------------------------------------------------------
    def list_agent_heartbeats(self, namespace: str, pool: str) -> dict[str, datetime]:
        """Lease name (``<pool>.<node>``) -> last renewTime, for the pool's agents.

        Read as raw JSON: a thousand Leases turned into client model objects would cost more
        than the rest of a pass.
        """
        items = (
            _json(
                self.coordination.list_namespaced_lease, namespace, label_selector=f"{POOL_NAME_LABEL}={pool}"
            ).get("items")
            or []
        )
        out: dict[str, datetime] = {}
        for item in items:
            renewed = parse_time((item.get("spec") or {}).get("renewTime"))
            if renewed is not None:
                out[item["metadata"]["name"]] = renewed
        return out

    # -- Nodes -------------------------------------------------------------------------
    def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """The Node as patched; None when it is gone."""
        try:
            return self.send("PATCH", f"/api/v1/nodes/{name}/status", dict(patch))
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    # -- DaemonSets --------------------------------------------------------------------
    def apply_daemonset(self, body: Mapping[str, Any]) -> tuple[str, int | None]:
        """Create the DaemonSet, or replace it when what we render changed.

        Returns ("created" | "updated" | "unchanged", the DaemonSet's generation). A replace
        (not a merge patch) so that removed tolerations or nodeSelector keys really go; the
        rendered hash annotation makes it a no-op when nothing changed, so passes never write
        for nothing.
        """
        meta = body["metadata"]
        try:
            current = _json(self.apps.read_namespaced_daemon_set, meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                made = _json(self.apps.create_namespaced_daemon_set, meta["namespace"], dict(body))
                return "created", made["metadata"].get("generation")
            except ApiException as exc2:
                if exc2.status != 409:
                    raise
                return "unchanged", None
        annotations = current["metadata"].get("annotations") or {}
        if annotations.get(HASH_ANNOTATION) == meta["annotations"][HASH_ANNOTATION]:
            return "unchanged", current["metadata"].get("generation")
        replacement = dict(body)
        replacement["metadata"] = {**meta, "resourceVersion": current["metadata"]["resourceVersion"]}
        made = _json(self.apps.replace_namespaced_daemon_set, meta["name"], meta["namespace"], replacement)
        return "updated", made["metadata"].get("generation")

    # -- DRA pools' DeviceClasses (resource.k8s.io/v1, through the generic custom-object calls) --
    def apply_device_class(self, body: Mapping[str, Any]) -> str:
        """Create the DeviceClass, or replace it when what the operator owns of it differs
        (``deviceclass.essence``): "created", "updated" or "unchanged"."""
        name = body["metadata"]["name"]
        where = (dra.RESOURCE_GROUP, dra.RESOURCE_VERSION, dra.DEVICE_CLASS_PLURAL)
        try:
            current = _json(self.custom.get_cluster_custom_object, *where, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                _json(self.custom.create_cluster_custom_object, *where, dict(body))
                return "created"
            except ApiException as exc2:
                if exc2.status != 409:
                    raise
                return "unchanged"  # made meanwhile: the next pass compares it
        if deviceclass.essence(current) == deviceclass.essence(body):
            return "unchanged"
        meta = current.get("metadata") or {}
        replacement = dict(body)
        replacement["metadata"] = {
            **body["metadata"],
            "labels": {**(meta.get("labels") or {}), **body["metadata"]["labels"]},
            "resourceVersion": meta["resourceVersion"],
        }
        _json(self.custom.replace_cluster_custom_object, *where, name, replacement)
        return "updated"

    def delete_device_class(self, name: str) -> bool:
        """True when deleted now, False when it was gone already."""
        try:
            _json(
                self.custom.delete_cluster_custom_object,
                dra.RESOURCE_GROUP,
                dra.RESOURCE_VERSION,
                dra.DEVICE_CLASS_PLURAL,
                name,
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # -- agent pods --------------------------------------------------------------------
    def list_agent_pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        return (
            _json(self.core.list_namespaced_pod, namespace, label_selector=label_selector).get("items") or []
        )

    def service_account_created(self, namespace: str, name: str) -> datetime | None:
        """When the ServiceAccount was made (its current incarnation); None when it is absent."""
        try:
            body = _json(self.core.read_namespaced_service_account, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return parse_time((body.get("metadata") or {}).get("creationTimestamp"))

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete exactly that pod (uid precondition); True when deleted now."""
        try:
            self.core.delete_namespaced_pod(
                name,
                namespace,
                body=kubernetes.client.V1DeleteOptions(
                    preconditions=kubernetes.client.V1Preconditions(uid=uid)
                ),
            )
            return True
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
