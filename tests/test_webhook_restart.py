"""The webhook across operator restarts and while the operator is down, against the real API
server (the operator as a process, as in tests/test_webhook.py, with its own certificate
directory): ordinary pods never reach the webhook (matchConditions), pods holding a hostPath
that could reach the host root wait for it (failurePolicy Fail); a restart, with the
certificates kept or lost (a re-created pod's emptyDir), never leaves a moment in which the API
server cannot verify what is served.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from fixtures.wait import wait_for
from offloadpool.api.pods import LEASE_SIDECAR_NAME
from test_webhook import Webhook, serving_operator

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="module")
def hook(
    crds_installed: Any, operator_rbac: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Webhook]:
    workdir = tmp_path_factory.mktemp("webhook-restart")
    with serving_operator(crds_installed, operator_rbac, workdir, ready="pointed_at_operator") as wh:
        yield wh


def bundle(hook: Webhook) -> list[x509.Certificate]:
    """The CAs of the validating configuration's guard webhook (all three carry the same)."""
    bundles = {
        h["clientConfig"]["caBundle"]
        for kind in ("mutating", "validating")
        for h in hook.configuration(kind)["webhooks"]
    }
    assert len(bundles) == 1, bundles
    return x509.load_pem_x509_certificates(base64.b64decode(bundles.pop()))


def failed_call(hook: Webhook, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as err:
        hook.core.create_namespaced_pod(hook.namespace, body)
    return str(json.loads(err.value.body)["message"])


def test_ordinary_pods_never_reach_the_webhook_and_hostpath_pods_wait_for_it(hook: Webhook) -> None:
    """With the operator stopped (failurePolicy Fail): an unlabelled pod without a pool resource
    or a hostPath that could reach the host root is admitted, so the API server did not call the
    webhook (matchConditions) — a plain pod and a log collector's ``/var/log`` alike; one with a
    hostPath that could reach the root (``/var``, ``/var/log/..``), or a pool resource, is
    refused until the operator is back."""
    pool = hook.create_pool("down")
    hook.operator.stop()
    try:
        plain = hook.pod_body("plain-while-down", None)
        plain["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
        plain["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1", "memory": "1Gi"}}
        assert hook.create_pod(plain)["metadata"]["name"] == "plain-while-down"
        logs = hook.pod_body("logs-while-down", None)
        logs["spec"]["volumes"] = [{"name": "logs", "hostPath": {"path": "/var/log"}}]
        assert hook.create_pod(logs)["metadata"]["name"] == "logs-while-down"
        for name, path in (("var-while-down", "/var"), ("dots-while-down", "/var//lib/offloadpool")):
            near = hook.pod_body(name, None)
            near["spec"]["volumes"] = [{"name": "host", "hostPath": {"path": path}}]
            message = failed_call(hook, near)
            assert 'failed calling webhook "pods.guard.offloadpool.io"' in message, (path, message)
        slot = hook.pod_body("slot-while-down", None)
        slot["spec"]["containers"][0]["resources"] = {"limits": {f"offloadpool.io/{pool}": "1"}}
        assert 'failed calling webhook "pods.guard.offloadpool.io"' in failed_call(hook, slot)
    finally:
        hook.operator.start()
        wait_for("the operator to serve again", hook.ready, timeout=90)
    # back: the guard itself refuses /var (it contains the host root)
    var = hook.pod_body("var-when-back", None)
    var["spec"]["volumes"] = [{"name": "host", "hostPath": {"path": "/var"}}]
    assert "reaches /var/lib/offloadpool" in failed_call(hook, var)


class Creator(threading.Thread):
    """Creates labelled pods one after another, each retried until admitted; keeps every refusal."""

    def __init__(self, hook: Webhook, pool: str) -> None:
        super().__init__(daemon=True)
        self.hook, self.pool = hook, pool
        self.stopping = threading.Event()
        self.admitted: list[tuple[float, str]] = []
        self.refusals: list[tuple[float, str]] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            body = self.hook.pod_body(f"loop-{secrets.token_hex(4)}", self.pool)
            while not self.stopping.is_set():
                try:
                    pod = self.hook.create_pod(body)
                except ApiException as exc:
                    self.refusals.append((time.monotonic(), str(exc.body)))
                    time.sleep(0.1)
                    continue
                assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME
                self.admitted.append((time.monotonic(), pod["metadata"]["name"]))
                break
            time.sleep(0.2)


def restart_under_load(hook: Webhook, pool: str, before_start: Any = None) -> Creator:
    creator = Creator(hook, pool)
    creator.start()
    try:
        wait_for("a pod admitted before the restart", lambda: creator.admitted, timeout=30)
        hook.operator.stop()
        stopped = time.monotonic()
        if before_start is not None:
            before_start()
        hook.operator.start()
        wait_for(
            "a pod admitted by the new operator",
            lambda: [t for t, _ in creator.admitted if t > stopped],
            timeout=90,
        )
        back = time.monotonic()
        wait_for(
            "pods admitted for 5 s after",
            lambda: time.monotonic() - back > 5 and creator.admitted,
            timeout=30,
        )
    finally:
        creator.stopping.set()
        creator.join(30)
    tls = [m for _, m in creator.refusals if "x509" in m or "certificate" in m or "tls:" in m]
    assert not tls, tls[:3]
    late = [m for t, m in creator.refusals if t > back]
    assert not late, late[:3]
    assert len(creator.admitted) > 10
    return creator


def test_a_restart_keeps_the_ca_and_admits_labelled_pods_throughout(hook: Webhook) -> None:
    pool = hook.create_pool("restart")
    before = bundle(hook)
    restart_under_load(hook, pool)
    assert bundle(hook) == before  # the same CA, kept in the certificate directory


def test_a_restart_that_lost_its_certificates_trusts_only_the_new_ca_with_no_window(hook: Webhook) -> None:
    """The chart keeps the certificates in an emptyDir: a re-created pod has none. The old CA's
    key is gone with it, so the new CA alone is the bundle (a CA is adopted only for the key the
    operator holds), written before anything is served under it: no pod meets a TLS refusal."""
    pool = hook.create_pool("lost")
    (old,) = bundle(hook)
    certs = Path(hook.operator.extra_args[hook.operator.extra_args.index("--webhook-cert-dir") + 1])
    restart_under_load(hook, pool, before_start=lambda: shutil.rmtree(certs))
    new = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    assert new != old and bundle(hook) == [new]
    served = x509.load_pem_x509_certificate((certs / "tls.crt").read_bytes())
    served.verify_directly_issued_by(new)
