"""Helpers for the operator tests: Nodes, pools and agent-side status writes against the real
API server, with cleanup that runs even when a test fails.

Statuses are written the way an agent writes them: through the status subresource, with a
token of the agent's ServiceAccount (so the agent's RBAC is exercised too). Every name carries a
random suffix so tests sharing the session's control plane never see each other's objects.
"""

from __future__ import annotations

import json
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures.cluster import wait_for
from fixtures.operator_process import OperatorProcess
from offloadpool.api.base import format_time, now
from offloadpool.api.constants import GROUP, NODE_PLURAL, POOL_PLURAL, VERSION, extended_resource_name, pool_label_key

MERGE = "application/merge-patch+json"
NAMESPACE = "offloadpool-system"
MiB = 1 << 20

__all__ = ["World", "world", "operator_proc", "wait_for"]


class World:
    def __init__(self, control_plane: Any) -> None:
        self.cp = control_plane
        self.suffix = secrets.token_hex(3)
        admin = control_plane.api_client()
        self.core = client.CoreV1Api(admin)
        self.apps = client.AppsV1Api(admin)
        self.custom = client.CustomObjectsApi(admin)
        kc = Path(tempfile.mkdtemp(prefix="offloadpool-agent-kc-")) / "agent.kubeconfig"
        token = control_plane.token_for(NAMESPACE, "offloadpool-agent")
        from kubernetes import config

        self.agent = client.CustomObjectsApi(config.new_client_from_config(
            config_file=str(control_plane.kubeconfig_for_token(token, kc))))
        self.nodes: list[str] = []
        self.pools: list[str] = []

    # -- objects ---------------------------------------------------------------------------
    def name(self, base: str) -> str:
        return f"{base}-{self.suffix}"

    def add_node(self, base: str, labels: dict[str, str] | None = None, taints: list[dict] | None = None) -> str:
        name = self.name(base)
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
        if taints:
            body["spec"] = {"taints": taints}
        self.core.create_node(client.V1Node.from_dict(body))
        self.nodes.append(name)
        return name

    def create_pool(self, base: str, spec: dict[str, Any]) -> str:
        name = self.name(base)
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "OffloadPool", "metadata": {"name": name}, "spec": spec}
        self.custom.create_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, body)
        self.pools.append(name)
        return name

    def pool(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def node_objects(self, pool: str) -> dict[str, dict[str, Any]]:
        items = self.custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)["items"]
        return {i["spec"]["nodeName"]: i for i in items if i["spec"]["pool"] == pool}

    def node(self, name: str) -> client.V1Node:
        return self.core.read_node(name)

    def marked(self, pool: str, node: str) -> tuple[bool, bool]:
        """(has the ready label, advertises the extended resource)."""
        n = self.core.read_node(node)
        labels = n.metadata.labels or {}
        capacity = (n.status.capacity or {}) if n.status else {}
        return labels.get(pool_label_key(pool)) == "ready", extended_resource_name(pool) in capacity

    def events(self, pool: str) -> list[client.CoreV1Event]:
        return self.core.list_event_for_all_namespaces(field_selector=f"involvedObject.name={pool}").items

    def event_reasons(self, pool: str) -> set[str]:
        return {e.reason for e in self.events(pool)}

    # -- what an agent does -------------------------------------------------------------------
    def report(self, pool: str, node: str, **status: Any) -> None:
        status.setdefault("heartbeat", format_time(now()))
        self.agent.patch_cluster_custom_object_status(
            GROUP, VERSION, NODE_PLURAL, f"{pool}.{node}", {"status": status}, _content_type=MERGE)

    def report_ready(self, pool: str, node: str, generation: int = 1, **extra: Any) -> None:
        self.report(pool, node, phase="Ready", progress=100, bytesTotal=64 * MiB, bytesPopulated=64 * MiB,
                    observedGeneration=generation, **extra)

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> None:
        for pool in self.pools:
            try:
                self.custom.patch_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool,
                                                        {"metadata": {"finalizers": None}}, _content_type=MERGE)
                self.custom.delete_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, pool)
            except ApiException:
                pass
            for item in self.custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)["items"]:
                if item["spec"]["pool"] == pool:
                    try:
                        self.custom.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, item["metadata"]["name"])
                    except ApiException:
                        pass
            try:
                self.apps.delete_namespaced_daemon_set(f"offloadpool-agent-{pool}", NAMESPACE)
            except ApiException:
                pass
        for node in self.nodes:
            try:
                self.core.delete_node(node)
            except ApiException:
                pass


@pytest.fixture
def operator_proc(crds_installed: Any, operator_rbac: Path) -> Iterator[OperatorProcess]:
    """The operator process (its own ServiceAccount), with a heartbeat timeout long enough that
    statuses the test wrote a minute ago are still fresh, and short resync/retry periods."""
    workdir = Path(tempfile.mkdtemp(prefix="offloadpool-operator-"))
    op = OperatorProcess(crds_installed, operator_rbac, workdir,
                         extra_args=("--heartbeat-timeout", "900", "--resync", "5", "--deletion-retry", "1")).start()
    try:
        yield op
    finally:
        op.stop()
        print(op.log(8000))


@pytest.fixture
def world(control_plane: Any, operator_rbac: Any) -> Iterator[World]:
    w = World(control_plane)
    try:
        yield w
    finally:
        w.cleanup()


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
