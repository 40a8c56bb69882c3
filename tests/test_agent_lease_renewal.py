"""The agent's heartbeat Lease: a new agent creates it with one request; a restarted agent
(a new process, the Lease already there) renews the existing one; a Lease deleted by hand is
made again. Real API server; the Lease is read back after each renewal."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from offloadpool.agent.kube import KubeAccess

pytestmark = pytest.mark.controlplane

NAMESPACE = "default"


def test_created_once_renewed_after_a_restart_and_made_again_when_deleted(control_plane: Any) -> None:
    api = control_plane.api_client()
    leases = client.CoordinationV1Api(api)
    pool = f"lease-{uuid.uuid4().hex[:6]}"
    name = f"{pool}.n1"
    pool_body = {"metadata": {"name": pool}}

    first = KubeAccess(api, pool, name, NAMESPACE)
    first.renew_heartbeat(40, pool_body)
    made = leases.read_namespaced_lease(name, NAMESPACE)
    assert made.spec.holder_identity == name and made.spec.lease_duration_seconds == 40
    try:
        time.sleep(0.01)
        first.renew_heartbeat(40, pool_body)
        renewed = leases.read_namespaced_lease(name, NAMESPACE)
        assert renewed.spec.renew_time > made.spec.renew_time
        assert renewed.spec.acquire_time == made.spec.acquire_time, "renewing re-created the Lease"

        restarted = KubeAccess(api, pool, name, NAMESPACE)  # a new process: the Lease exists
        time.sleep(0.01)
        restarted.renew_heartbeat(40, pool_body)
        again = leases.read_namespaced_lease(name, NAMESPACE)
        assert again.spec.renew_time > renewed.spec.renew_time
        assert again.metadata.uid == made.metadata.uid, "a restarted agent replaced the Lease"

        leases.delete_namespaced_lease(name, NAMESPACE)
        restarted.renew_heartbeat(40, pool_body)
        remade = leases.read_namespaced_lease(name, NAMESPACE)
        assert remade.metadata.uid != made.metadata.uid and remade.spec.holder_identity == name
    finally:
        leases.delete_namespaced_lease(name, NAMESPACE)
        api.close()
