"""The Mutating- and ValidatingWebhookConfiguration: rendered here (pure), kept true by the
operator, created by the installer (the chart, or ``deploy/webhook.yaml``).

Three webhooks: ``pods.mutate`` (mutating) and ``pods.validate`` see pods labelled
``offloadpool.io/pool``: the mutation, and the check that it reached the pod and that what it
keys by name is what it writes. ``pods.guard`` (validating) sees every other pod that could take
something of a pool: those holding a hostPath volume or an ``offloadpool.io/*`` resource,
labelled or not, chosen on the API server's side by ``matchConditions`` (CEL on the request), so
ordinary pods never reach the operator; it refuses hostPaths that reach the host root, the
kubelet's directory or ``/proc``, and pool resources without the pool's label (``hostguard``).

Why the operator and not kopf manages them: kopf's managed configurations have no
``namespaceSelector``, no ``matchConditions`` and only label filters it can express, and it
removes its webhooks when the operator stops. Ours must never see system namespaces nor the
operator's own (its agent pods carry the pool label and the host root), and must stay in place
while the operator is down, so that a pod is refused rather than admitted unchecked.

Scope. No label a pod sets takes it out of scope. Namespaces are left out by name only
(``kubernetes.io/metadata.name``, which the API server sets and nobody can change): the system
ones, the operator's (only the operator's DaemonSets and administrators create pods there, and
its agents are the host root's owners), and those the installer names. A namespace labelled
``offloadpool.io/admission=disabled`` turns off the mutation and its check there (labelled pods
are created as written), never the guard.

Why the installer creates them and the operator only patches: creating webhook configurations
needs an unrestricted ``create`` (RBAC cannot name an object that does not exist yet), and
``helm uninstall`` must remove them. So the operator may only ``get``/``patch`` the two objects
named ``offloadpool``; at start-up and every ``resync`` it writes the webhooks below with the
current ``caBundle`` and client config when what is there differs (it never touches anything
else). ``tests/test_chart.py`` checks that the chart renders exactly these webhooks.

Failure policy: ``Fail`` for all three. The mutating and validating webhooks reach only labelled
pods: while the operator is down those wait (their controllers retry); admitted without the pool
they would start without their memory or its lease. The guard reaches pods with a hostPath or a
pool resource outside the excluded namespaces: while the operator is down those wait too, since
``Ignore`` would let a pod take the host root in exactly that window (an attacker can wait for
it). Node agents with host mounts (log collectors, exporters, CSI plugins) belong in an excluded
namespace (docs/webhook.md).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from offloadpool.api.constants import GROUP, HOST_ROOT, KUBELET_DIR
from offloadpool.api.pods import (
    ADMISSION_DISABLED,
    ADMISSION_NAMESPACE_LABEL,
    CSI_DRIVER,
    GUARD_PATH,
    GUARD_WEBHOOK_NAME,
    MUTATE_PATH,
    MUTATING_WEBHOOK_NAME,
    POD_POOL_LABEL,
    SYSTEM_NAMESPACES,
    VALIDATE_PATH,
    VALIDATING_WEBHOOK_NAME,
    WEBHOOK_CONFIGURATION_NAME,
)
from offloadpool.operator.hostguard import PROC

from .certs import bundle_certificates

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


def namespace_selector(excluded: Sequence[str], honour_disabled: bool = True) -> dict[str, Any]:
    """Namespaces by name (the API server's own label); the disabled label only where asked."""
    expressions: list[dict[str, Any]] = [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(excluded)}
    ]
    if honour_disabled:
        expressions.append(
            {"key": ADMISSION_NAMESPACE_LABEL, "operator": "NotIn", "values": [ADMISSION_DISABLED]}
        )
    return {"matchExpressions": expressions}


def object_selector() -> dict[str, Any]:
    return {"matchExpressions": [{"key": POD_POOL_LABEL, "operator": "Exists"}]}


def _holds_pool_resource(resources: str) -> str:
    """CEL: the resources object ``resources`` (a field path) names an ``offloadpool.io/*`` key."""
    return " || ".join(
        f"(has({resources}.{part}) && {resources}.{part}.exists(k, k.startsWith('{GROUP}/')))"
        for part in ("requests", "limits")
    )


def _cel_string(text: str) -> str:
    """``text`` as a CEL string literal (a path the installer gives: no quote, no backslash)."""
    if "'" in text or "\\" in text or "\n" in text:
        raise ValueError(f"{text!r} cannot be a guarded path (a quote, a backslash or a newline)")
    return f"'{text}'"


def guarded_paths(kubelet_dir: str = KUBELET_DIR) -> list[str]:
    """The trees the guard's condition sends to the webhook, without a trailing slash: ``/proc``,
    the host root, the kubelet's directory (``hostguard`` decides on each exactly)."""
    return [PROC, HOST_ROOT.rstrip("/"), kubelet_dir.rstrip("/") or "/"]


def _may_reach(path: str, kubelet_dir: str = KUBELET_DIR) -> str:
    """CEL: the hostPath ``path`` (a field path) could reach a guarded tree: any path that is not
    plain (relative, or with ``//``, ``.`` or ``..`` components: the guard normalises it), or a
    plain one that is a guarded tree, lies under it or is one of its ancestors. With ``q`` the
    path with one trailing slash, that is ``'<tree>/'.startsWith(q) || q.startsWith('<tree>/')``:
    ``/``, ``/var/``, ``/var/lib/kubelet``, ``/var/lib/kubelet/pods/x`` all are; ``/var/log``
    and ``/var/lib/kubeletX`` are not. A plain path elsewhere (a log collector's ``/var/log``)
    never reaches one, so such pods stay off the webhook and do not wait for the operator."""
    q = f"({path}.endsWith('/') ? {path} : {path} + '/')"
    trees = " || ".join(
        f"{_cel_string(tree)}.startsWith({q}) || {q}.startsWith({_cel_string(tree)})"
        for tree in (t.rstrip("/") + "/" for t in guarded_paths(kubelet_dir))
    )
    return (
        f"(!{path}.startsWith('/') || {path}.contains('//') || {path}.contains('/./') "
        f"|| {path}.contains('/..') || {path}.endsWith('/.') || {trees})"
    )


def guard_expression(kubelet_dir: str = KUBELET_DIR) -> str:
    """CEL on the request: the pod holds a hostPath volume that could reach a guarded tree
    (``_may_reach``; the guard then decides exactly), an inline ``csi`` volume of the node
    plugin (driver ``offloadpool.io``: a share of a pool) or an ``offloadpool.io/*`` resource
    (any container kind, or the pod-level resources). Everything else stays off the webhook."""
    lines = [
        "(has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.hostPath) && "
        f"{_may_reach('v.hostPath.path', kubelet_dir)}))"
    ]
    lines.append(
        "|| (has(object.spec.volumes) && object.spec.volumes.exists(v, has(v.csi) && "
        f"v.csi.driver == {_cel_string(CSI_DRIVER)}))"
    )
    lines.append(f"|| (has(object.spec.resources) && ({_holds_pool_resource('object.spec.resources')}))")
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        lines.append(
            f"|| (has(object.spec.{kind}) && object.spec.{kind}.exists(c, "
            f"has(c.resources) && ({_holds_pool_resource('c.resources')})))"
        )
    return "\n".join(lines)


def match_conditions(kubelet_dir: str = KUBELET_DIR) -> list[dict[str, str]]:
    return [{"name": "holds-host-path-or-pool-resource", "expression": guard_expression(kubelet_dir)}]


def excluded_namespaces(operator_namespace: str, extra: Sequence[str] = ()) -> list[str]:
    """System namespaces, the operator's own (its agent pods must never wait for it), and any
    the installer adds; in that order, each once (as the chart's ``uniq`` renders them)."""
    return list(dict.fromkeys([*SYSTEM_NAMESPACES, operator_namespace, *extra]))


def webhook(
    name: str,
    path: str,
    endpoint: Endpoint,
    ca_bundle: str | None,
    excluded: Sequence[str],
    mutating: bool,
    kubelet_dir: str = KUBELET_DIR,
) -> dict[str, Any]:
    """One webhook entry, with every field the API server would otherwise default spelled out
    (so comparing with what is stored tells real differences only)."""
    guard = name == GUARD_WEBHOOK_NAME
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
        "namespaceSelector": namespace_selector(excluded, honour_disabled=not guard),
        "objectSelector": {} if guard else object_selector(),
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
    }
    if guard:
        entry["matchConditions"] = match_conditions(kubelet_dir)
    if mutating:
        # A later webhook that adds a container (a service mesh proxy) makes the API server call
        # this one again, so the new container gets the mount and env too; mutation is idempotent.
        entry["reinvocationPolicy"] = "IfNeeded"
    return entry


def render(
    endpoint: Endpoint,
    ca_bundle: str | None,
    excluded: Sequence[str],
    name: str = WEBHOOK_CONFIGURATION_NAME,
    kubelet_dir: str = KUBELET_DIR,
) -> list[dict[str, Any]]:
    """Both configurations, complete (what ``deploy/webhook.yaml`` holds, plus the caBundle);
    ``excluded``: the namespaces never sent to any webhook (``excluded_namespaces``);
    ``kubelet_dir``: the kubelet's directory on the nodes (``OperatorConfig.kubelet_dir``)."""
    out = []
    for kind, hooks in (
        (MUTATING_KIND, [(MUTATING_WEBHOOK_NAME, MUTATE_PATH)]),
        (VALIDATING_KIND, [(VALIDATING_WEBHOOK_NAME, VALIDATE_PATH), (GUARD_WEBHOOK_NAME, GUARD_PATH)]),
    ):
        mutating = kind == MUTATING_KIND
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
                "webhooks": [
                    webhook(hook, path, endpoint, ca_bundle, excluded, mutating, kubelet_dir)
                    for hook, path in hooks
                ],
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
        kubelet_dir: str = KUBELET_DIR,
    ) -> None:
        from kubernetes.client import AdmissionregistrationV1Api

        self.api = AdmissionregistrationV1Api(api_client)
        self.endpoint = endpoint
        self.excluded = list(excluded)
        self.name = name
        self.kubelet_dir = kubelet_dir

    def _read(self, kind: str) -> dict[str, Any]:
        read = (
            self.api.read_mutating_webhook_configuration
            if kind == MUTATING_KIND
            else self.api.read_validating_webhook_configuration
        )
        live: dict[str, Any] = json.loads(read(self.name, _preload_content=False).data)
        return live

    def published(self) -> list[x509.Certificate]:
        """The CAs every webhook of both configurations trusts now (their caBundles' common
        part): what the API server may verify the served certificate with."""
        trusted: dict[bytes, x509.Certificate] | None = None
        for kind in (MUTATING_KIND, VALIDATING_KIND):
            for hook in self._read(kind).get("webhooks") or []:
                try:
                    pem = base64.b64decode((hook.get("clientConfig") or {}).get("caBundle") or "")
                except (binascii.Error, ValueError):
                    pem = b""
                here = {c.public_bytes(serialization.Encoding.DER): c for c in bundle_certificates(pem)}
                trusted = here if trusted is None else {k: v for k, v in trusted.items() if k in here}
        return list((trusted or {}).values())

    def ensure(self, ca_bundle: str | None) -> list[str]:
        """Patch whichever configuration differs; returns the kinds patched. Raises the API's
        error (404: the installer did not create it; 403: RBAC) for the caller to log."""
        patched = []
        for desired in render(self.endpoint, ca_bundle, self.excluded, self.name, self.kubelet_dir):
            kind = desired["kind"]
            patch = (
                self.api.patch_mutating_webhook_configuration
                if kind == MUTATING_KIND
                else self.api.patch_validating_webhook_configuration
            )
            live = self._read(kind)
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
