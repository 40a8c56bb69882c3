"""The Mutating- and ValidatingWebhookConfiguration: rendered here (pure), kept true by the
operator, created by the installer (the chart, or ``deploy/webhook.yaml``).

Why the operator and not kopf manages them: kopf's managed configurations have no
``namespaceSelector`` and only label filters it can express, and it removes its webhooks when
the operator stops. Ours must never see system namespaces, must skip the operator's own agent
pods (which carry the pool label too), and must stay in place while the operator is down, so
that a labelled pod is refused rather than admitted without its pool and lease.

Why the installer creates them and the operator only patches: creating webhook configurations
needs an unrestricted ``create`` (RBAC cannot name an object that does not exist yet), and
``helm uninstall`` must remove them. So the operator may only ``get``/``patch`` the two objects
named ``offloadpool``; at start-up and every ``resync`` it writes the webhooks below with the
current ``caBundle`` and client config when what is there differs (it never touches anything
else). ``tests/test_chart.py`` checks that the chart renders exactly these webhooks.

Failure policy: ``Fail`` for both, and that cannot take the cluster's pods down, because the
API server sends only pods that carry ``offloadpool.io/pool`` (objectSelector), never from
``kube-system``/``kube-public``/``kube-node-lease``, the operator's namespace, or a namespace
labelled ``offloadpool.io/admission=disabled`` (namespaceSelector). While the operator is down,
only new pods that ask for a pool wait (their controllers retry); a pod admitted without the
pool would start without its memory or its lease, which is worse than waiting.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offloadpool.api.pods import (
    ADMISSION_DISABLED,
    ADMISSION_NAMESPACE_LABEL,
    MANAGED_BY_LABEL,
    MUTATE_PATH,
    MUTATING_WEBHOOK_NAME,
    OPERATOR_MANAGER,
    POD_POOL_LABEL,
    SYSTEM_NAMESPACES,
    VALIDATE_PATH,
    VALIDATING_WEBHOOK_NAME,
    WEBHOOK_CONFIGURATION_NAME,
)

log = logging.getLogger(__name__)

MERGE = "application/merge-patch+json"
MUTATING_KIND = "MutatingWebhookConfiguration"
VALIDATING_KIND = "ValidatingWebhookConfiguration"
#: The API server waits this long for an answer (1-30); a pod creation is not latency-critical,
#: a Python operator under load can take a moment.
TIMEOUT_SECONDS = 10


@dataclass(frozen=True)
class Endpoint:
    """How the API server reaches the webhook server: a URL (tests, out-of-cluster), or a
    Service in the operator's namespace (port 443 to the operator's webhook port)."""

    url: str | None = None
    service: str | None = None
    namespace: str | None = None
    port: int = 443

    def client_config(self, path: str, ca_bundle: str | None) -> dict[str, Any]:
        config: dict[str, Any]
        if self.url:
            config = {"url": f"{self.url.rstrip('/')}/{path}"}
        else:
            config = {
                "service": {
                    "namespace": self.namespace,
                    "name": self.service,
                    "path": f"/{path}",
                    "port": self.port,
                }
            }
        if ca_bundle:
            config["caBundle"] = ca_bundle
        return config


def namespace_selector(excluded: Sequence[str]) -> dict[str, Any]:
    return {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(excluded)},
            {"key": ADMISSION_NAMESPACE_LABEL, "operator": "NotIn", "values": [ADMISSION_DISABLED]},
        ]
    }


def object_selector() -> dict[str, Any]:
    return {
        "matchExpressions": [
            {"key": POD_POOL_LABEL, "operator": "Exists"},
            {"key": MANAGED_BY_LABEL, "operator": "NotIn", "values": [OPERATOR_MANAGER]},
        ]
    }


def excluded_namespaces(operator_namespace: str, extra: Sequence[str] = ()) -> list[str]:
    """System namespaces, the operator's own (its agent pods must never wait for it), and any
    the installer adds; in that order, each once (as the chart's ``uniq`` renders them)."""
    return list(dict.fromkeys([*SYSTEM_NAMESPACES, operator_namespace, *extra]))


def webhook(
    name: str, path: str, endpoint: Endpoint, ca_bundle: str | None, excluded: Sequence[str], mutating: bool
) -> dict[str, Any]:
    """One webhook entry, with every field the API server would otherwise default spelled out
    (so comparing with what is stored tells real differences only)."""
    entry: dict[str, Any] = {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": endpoint.client_config(path, ca_bundle),
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "operations": ["CREATE"],
                "scope": "Namespaced",
            }
        ],
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "namespaceSelector": namespace_selector(excluded),
        "objectSelector": object_selector(),
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
    }
    if mutating:
        # A later webhook that adds a container (a service mesh proxy) makes the API server call
        # this one again, so the new container gets the mount and env too; mutation is idempotent.
        entry["reinvocationPolicy"] = "IfNeeded"
    return entry


def render(
    endpoint: Endpoint, ca_bundle: str | None, excluded: Sequence[str], name: str = WEBHOOK_CONFIGURATION_NAME
) -> list[dict[str, Any]]:
    """``excluded``: the namespaces never sent to the webhook (``excluded_namespaces``)."""
    """Both configurations, complete (what ``deploy/webhook.yaml`` holds, plus the caBundle)."""
    out = []
    for kind, hook, path, mutating in (
        (MUTATING_KIND, MUTATING_WEBHOOK_NAME, MUTATE_PATH, True),
        (VALIDATING_KIND, VALIDATING_WEBHOOK_NAME, VALIDATE_PATH, False),
    ):
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {
                    "name": name,
                    "labels": {
                        "app.kubernetes.io/name": "offloadpool-webhook",
                        "app.kubernetes.io/part-of": "offloadpool",
                    },
                },
                "webhooks": [webhook(hook, path, endpoint, ca_bundle, excluded, mutating)],
            }
        )
    return out


def contains(live: Any, wanted: Any) -> bool:
    """Whether ``live`` holds everything ``wanted`` says (extra defaulted fields allowed)."""
    if isinstance(wanted, Mapping):
        return isinstance(live, Mapping) and all(
            k in live and contains(live[k], v) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return live == wanted


class Configurator:
    """Keeps the two configurations' webhooks equal to ``render`` (get + patch, nothing else)."""

    def __init__(
        self,
        api_client: Any,
        endpoint: Endpoint,
        excluded: Sequence[str],
        name: str = WEBHOOK_CONFIGURATION_NAME,
    ) -> None:
        from kubernetes.client import AdmissionregistrationV1Api

        self.api = AdmissionregistrationV1Api(api_client)
        self.endpoint = endpoint
        self.excluded = list(excluded)
        self.name = name

    def ensure(self, ca_bundle: str | None) -> list[str]:
        """Patch whichever configuration differs; returns the kinds patched. Raises the API's
        error (404: the installer did not create it; 403: RBAC) for the caller to log."""
        patched = []
        for desired in render(self.endpoint, ca_bundle, self.excluded, self.name):
            kind = desired["kind"]
            read, patch = (
                (self.api.read_mutating_webhook_configuration, self.api.patch_mutating_webhook_configuration)
                if kind == MUTATING_KIND
                else (
                    self.api.read_validating_webhook_configuration,
                    self.api.patch_validating_webhook_configuration,
                )
            )
            live = json.loads(read(self.name, _preload_content=False).data)
            if contains(live.get("webhooks"), desired["webhooks"]):
                continue
            patch(self.name, {"webhooks": desired["webhooks"]}, _content_type=MERGE)
            log.info(
                "%s %s: webhooks written (client config %s)",
                kind,
                self.name,
                {k: v for k, v in desired["webhooks"][0]["clientConfig"].items() if k != "caBundle"},
            )
            patched.append(kind)
        return patched
