"""The admission webhook against the real API server: the operator runs as a real process with
``--webhook`` (its own ServiceAccount, the RBAC of deploy/), serving HTTPS on loopback with the
certificates it made; the webhook configurations are deploy/webhook.yaml's, which the operator
points at itself (URL, caBundle). Pods are created through the API server, which calls the
webhook over TLS; what comes back is what the webhook did.
"""

from __future__ import annotations

import base64
import copy
import json
import secrets
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures.cluster import free_port
from fixtures.cluster_client import ClusterClient
from fixtures.operator_process import OperatorProcess
from fixtures.sglang_pod_env import plugin_reads, resolved_env
from fixtures.wait import wait_for
from offloadpool.api.pods import (
    ENV_CAPACITY_BYTES,
    ENV_POD_UID,
    LEASE_READY_FILE,
    LEASE_SIDECAR_NAME,
    POD_POOL_LABEL,
    WEBHOOK_CONFIGURATION_NAME,
)
from offloadpool.operator import admission, hostguard
from offloadpool.operator.admission import InjectionSettings

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[1]
SIDECAR_IMAGE = "registry.example/offloadpool:test"
MERGE = "application/merge-patch+json"


def webhook_configurations() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((REPO / "deploy" / "webhook.yaml").read_text())
    return [d for d in docs if d["kind"].endswith("WebhookConfiguration")]


class Webhook(ClusterClient):
    """The operator with --webhook on a loopback port, the configurations, two namespaces, pools."""

    def __init__(self, cp: Any, operator: OperatorProcess, port: int) -> None:
        super().__init__(cp.api_client(), pool_defaults={"capacity": "1Gi", "medium": "HugePages-2Mi"})
        self.cp = cp
        self.operator = operator
        self.port = port
        self.admission = client.AdmissionregistrationV1Api(self.api)
        self.namespace = f"wh-{self.suffix}"
        self.other_namespace = f"wh-other-{self.suffix}"

    def pod_body(self, name: str, pool: str | None, containers: int = 1, **labels: str) -> dict[str, Any]:
        if pool is not None:
            labels[POD_POOL_LABEL] = pool
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                # keeps the spec to what the test and the webhook wrote
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": f"engine-{i}",
                        "image": "vllm/vllm-openai:v0.33.0",
                        "env": [{"name": "HF_HOME", "value": "/cache"}],
                    }
                    for i in range(containers)
                ],
            },
        }

    def create_pod(self, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        ns = namespace or self.namespace
        pod = self.core.create_namespaced_pod(ns, body)
        return self.core.api_client.sanitize_for_serialization(pod)

    def refusal(self, body: dict[str, Any], namespace: str | None = None) -> str:
        with pytest.raises(ApiException) as err:
            self.core.create_namespaced_pod(namespace or self.namespace, body)
        assert err.value.status == 403, err.value.body
        return str(err.value.body)

    # -- setup / teardown ------------------------------------------------------------------
    def setup(self) -> None:
        for ns in (self.namespace, self.other_namespace):
            self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
            # the ServiceAccount admission plugin wants the namespace's default account
            wait_for(
                f"ServiceAccount {ns}/default",
                lambda ns=ns: (
                    self.core.list_namespaced_service_account(
                        ns, field_selector="metadata.name=default"
                    ).items
                ),
            )
        self.delete_configurations()  # a leftover of an interrupted run would make create fail
        for doc in webhook_configurations():
            self.apply_configuration(doc)

    def apply_configuration(self, doc: dict[str, Any]) -> None:
        create = (
            self.admission.create_mutating_webhook_configuration
            if doc["kind"].startswith("Mutating")
            else self.admission.create_validating_webhook_configuration
        )
        create(doc)

    def configuration(self, kind: str) -> dict[str, Any]:
        read = (
            self.admission.read_mutating_webhook_configuration
            if kind == "mutating"
            else self.admission.read_validating_webhook_configuration
        )
        return self.admission.api_client.sanitize_for_serialization(read(WEBHOOK_CONFIGURATION_NAME))

    def pointed_at_operator(self) -> bool:
        for kind in ("mutating", "validating"):
            hook = self.configuration(kind)["webhooks"][0]
            url = hook["clientConfig"].get("url", "")
            if not (
                url.startswith(f"https://127.0.0.1:{self.port}/") and hook["clientConfig"].get("caBundle")
            ):
                return False
        return True

    def ready(self) -> bool:
        """The configurations point at the operator (written before its server starts: the
        bundle goes first) and the server answers."""
        if not self.pointed_at_operator():
            return False
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
        except OSError:
            return False
        return True

    def delete_configurations(self) -> None:
        for delete in (
            self.admission.delete_mutating_webhook_configuration,
            self.admission.delete_validating_webhook_configuration,
        ):
            try:
                delete(WEBHOOK_CONFIGURATION_NAME)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def teardown(self) -> None:
        self.delete_configurations()
        self.delete_pools()
        for ns in (self.namespace, self.other_namespace):
            try:
                self.core.delete_namespace(ns)
            except ApiException:
                pass


@contextmanager
def serving_operator(
    crds_installed: Any, operator_rbac: Path, workdir: Path, ready: str = "ready"
) -> Iterator[Webhook]:
    """The operator as a process serving the webhook on a free loopback port, with its own
    certificate directory in ``workdir``, once it has pointed the configurations at itself
    (``ready``: the name of the ``Webhook`` predicate to wait for); stopped after."""
    port = free_port()
    operator = OperatorProcess(
        crds_installed,
        operator_rbac,
        workdir,
        extra_args=(
            "--webhook",
            "--webhook-listen",
            "127.0.0.1",
            "--webhook-port",
            str(port),
            "--webhook-url",
            f"https://127.0.0.1:{port}",
            "--webhook-cert-dir",
            str(workdir / "certs"),
            "--webhook-resync",
            "1",
            "--sidecar-image",
            SIDECAR_IMAGE,
            "--resync",
            "5",
        ),
    )
    wh = Webhook(crds_installed, operator, port)
    try:
        wh.setup()
        operator.start()
        wait_for("the operator to point the webhook configurations at itself", getattr(wh, ready), timeout=90)
        yield wh
    finally:
        operator.stop()
        wh.teardown()
        print(operator.log(12000))


@pytest.fixture(scope="module")
def webhook(
    crds_installed: Any, operator_rbac: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Webhook]:
    with serving_operator(crds_installed, operator_rbac, tmp_path_factory.mktemp("webhook-operator")) as wh:
        yield wh


def wait_admitted(wh: Webhook, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    """Create the pod; a refusal for a reason the API server has not caught up with (the
    configuration just changed) is retried until the deadline."""
    last: list[str] = []

    def attempt() -> dict[str, Any] | None:
        try:
            return wh.create_pod(copy.deepcopy(body), namespace)
        except ApiException as exc:
            last[:] = [str(exc.body)]
            return None

    return wait_for(f"pod {body['metadata']['name']} admitted ({last})", attempt, timeout=30)


# -- the tests ---------------------------------------------------------------------------------
def test_the_api_server_calls_the_webhook_over_tls_with_the_operators_ca(webhook: Webhook) -> None:
    """The configuration's caBundle verifies the certificate the operator serves on loopback."""
    hook = webhook.configuration("mutating")["webhooks"][0]
    assert hook["clientConfig"]["url"] == f"https://127.0.0.1:{webhook.port}/mutate-pod"
    assert hook["failurePolicy"] == "Fail" and hook["reinvocationPolicy"] == "IfNeeded"
    ca = base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    context = ssl.create_default_context(cadata=ca)
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
            subject = dict(x[0] for x in tls.getpeercert()["subject"])
    assert subject["commonName"] == "127.0.0.1"
    # ... and it is what answers the API server: a labelled pod comes back mutated
    pool = webhook.create_pool("tls")
    pod = wait_admitted(webhook, webhook.pod_body("tls", pool))
    assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME


def test_the_webhook_port_closes_idle_and_surplus_connections(webhook: Webhook) -> None:
    """Issue 36, finding 8, through the operator's own webhook port: 100 TLS connections that
    send no request once all stayed open. Now at most the cap (64, the API server's own among
    them) stay open, every idle one is closed after the 10 s timeout, and while a client holds
    every place with idle connections the API server's call still gets in (the oldest idle
    connection is reset for it): a labelled pod is admitted then, not only once the client has
    gone."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only the handshake matters here

    def closed(conn: ssl.SSLSocket) -> bool:
        """Whether the operator has closed ``conn`` (end of file or reset), without waiting."""
        try:
            return conn.recv(1) == b""
        except ssl.SSLWantReadError:
            return False
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
            return True

    conns: list[ssl.SSLSocket] = []
    try:
        for _ in range(100):
            raw = socket.create_connection(("127.0.0.1", webhook.port), timeout=10)
            conns.append(context.wrap_socket(raw, server_hostname="127.0.0.1"))
            conns[-1].setblocking(False)
        time.sleep(1)
        at_once = sum(closed(c) for c in conns)
        print(f"100 idle TLS connections: {at_once} closed at once")
        assert at_once >= 100 - 64, f"{at_once} of 100 idle connections closed: no cap"
        pool = webhook.create_pool("idle")
        pod = webhook.create_pod(webhook.pod_body("idle", pool))  # no retry: the first call
        assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME
        wait_for("every idle connection closed", lambda: all(closed(c) for c in conns), timeout=20)
    finally:
        for c in conns:
            c.close()


def test_a_labelled_pod_comes_back_mutated_exactly_as_specified(webhook: Webhook) -> None:
    pool = webhook.create_pool(
        "lib",
        layout={"type": "Interleaved", "ranks": 2, "slotSize": "2Mi"},
        consumers={"uid": 1000, "gid": 1000, "namespaces": [webhook.namespace]},
    )
    pod = wait_admitted(webhook, webhook.pod_body("lib", pool, containers=2))
    spec = pod["spec"]
    volume = f"offloadpool-{pool}"
    assert spec["volumes"] == [
        {"name": volume, "hostPath": {"path": f"/var/lib/offloadpool/{pool}", "type": "Directory"}}
    ]
    for i, container in enumerate(spec["containers"]):
        assert container["volumeMounts"] == [
            {
                "name": volume,
                "mountPath": f"/offloadpool/{pool}",
                "mountPropagation": "HostToContainer",
                "readOnly": True,
            }
        ]
        assert container["env"] == [
            {"name": "HF_HOME", "value": "/cache"},
            {"name": "OFFLOADPOOL_POOL", "value": pool},
            {"name": "OFFLOADPOOL_POOL_DIR", "value": f"/offloadpool/{pool}"},
            {"name": "OFFLOADPOOL_MEDIUM", "value": "HugePages-2Mi"},
            {"name": "OFFLOADPOOL_LAYOUT", "value": "Interleaved"},
            {"name": "OFFLOADPOOL_RANKS", "value": "2"},
            {"name": "OFFLOADPOOL_CAPACITY_BYTES", "value": str(1 << 30)},
            {"name": "OFFLOADPOOL_SLOT_BYTES", "value": str(2 << 20)},
        ], f"container {i}"
        assert not container.get("resources", {}).get("limits")
    assert spec["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": f"pool.offloadpool.io/{pool}", "operator": "In", "values": ["ready"]}
                        ]
                    }
                ]
            }
        }
    }
    (sidecar,) = spec["initContainers"]
    assert sidecar["name"] == LEASE_SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == SIDECAR_IMAGE
    assert sidecar["command"] == [
        "offloadpool",
        "hold-lease",
        f"/offloadpool/{pool}",
        "--ready-file",
        LEASE_READY_FILE,
    ]
    assert sidecar["volumeMounts"] == [
        {
            "name": volume,
            "mountPath": f"/offloadpool/{pool}",
            "mountPropagation": "HostToContainer",
            "readOnly": True,
        }
    ]
    assert sidecar["resources"] == {
        "requests": {"cpu": "10m", "memory": "64Mi", f"offloadpool.io/{pool}": "1"},
        "limits": {"memory": "64Mi", f"offloadpool.io/{pool}": "1"},
    }
    assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-e", LEASE_READY_FILE]
    assert (
        sidecar["securityContext"]["runAsUser"] == 1000 and sidecar["securityContext"]["runAsNonRoot"] is True
    )
    # The pure function agrees that nothing is missing, on what the API server stored.
    assert (
        admission.not_mutated(pod, webhook.pool(pool), InjectionSettings(sidecar_image=SIDECAR_IMAGE)) == []
    )


def test_a_compat_pool_mounts_the_region_file_where_stock_vllm_looks(webhook: Webhook) -> None:
    pool = webhook.create_pool(
        "compat", medium="MemoryTHP", segments={"maxFiles": 1}, compat={"vllm": {"engineId": "llama-70b-tp4"}}
    )
    pod = wait_admitted(webhook, webhook.pod_body("compat", pool))
    # no hostPath below the pool directory: the file is a subPath the kubelet resolves beneath it
    assert [v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v] == [
        f"/var/lib/offloadpool/{pool}"
    ]
    assert {
        "name": f"offloadpool-{pool}",
        "mountPath": "/dev/shm/vllm_offload_llama-70b-tp4.mmap",
        "subPath": "mnt/vllm_offload_llama-70b-tp4.mmap",
    } in pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "OFFLOADPOOL_VLLM_ENGINE_ID", "value": "llama-70b-tp4"} in pod["spec"]["containers"][0][
        "env"
    ]


def test_a_pod_of_a_partitioned_pool_is_admitted_told_its_uid_and_a_shares_capacity(
    webhook: Webhook,
) -> None:
    """A pool of 2 shares: the mutation adds the pod's uid by the downward API, and the API
    server stores exactly what the webhook wrote (a ``fieldRef`` it would default otherwise), so
    the validating webhook admits the pod it sees after the API server's defaults."""
    pool = webhook.create_pool("parts", partitions=2)
    pod = wait_admitted(webhook, webhook.pod_body("parts", pool, containers=2))
    for container in pod["spec"]["containers"]:
        env = {e["name"]: e for e in container["env"]}
        assert env[ENV_POD_UID] == {
            "name": ENV_POD_UID,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}},
        }
        assert env[ENV_CAPACITY_BYTES]["value"] == str(512 << 20), "one share's capacity"
    settings = InjectionSettings(sidecar_image=SIDECAR_IMAGE)
    assert admission.differences(pod, webhook.pool(pool), settings) == []


def test_mutating_a_mutated_pod_changes_nothing(webhook: Webhook) -> None:
    """The pod the API server returned, created again (new name) through the same webhooks:
    the second pass adds nothing, so the stored spec is exactly the one submitted."""
    pool = webhook.create_pool("twice")
    first = wait_admitted(webhook, webhook.pod_body("twice-1", pool, containers=2))
    again = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "twice-2", "labels": first["metadata"]["labels"]},
        "spec": copy.deepcopy(first["spec"]),
    }
    second = webhook.create_pod(again)
    assert second["spec"] == first["spec"]


def test_an_unknown_pool_is_refused_naming_it(webhook: Webhook) -> None:
    missing = f"no-such-pool-{webhook.suffix}"
    message = webhook.refusal(webhook.pod_body("unknown", missing))
    assert f"OffloadPool '{missing}' does not exist" in message, message
    assert "pods.mutate.offloadpool.io" in message  # the first webhook already says so


def test_a_pool_the_namespace_may_not_use_is_refused(webhook: Webhook) -> None:
    pool = webhook.create_pool("private", consumers={"namespaces": [webhook.namespace]})
    message = webhook.refusal(webhook.pod_body("outsider", pool), namespace=webhook.other_namespace)
    assert (
        f"namespace '{webhook.other_namespace}' may not use OffloadPool '{pool}'" in message
        and f"spec.consumers.namespaces allows only {webhook.namespace}" in message
    ), message
    wait_admitted(webhook, webhook.pod_body("insider", pool))  # its own namespace may


def guard_calls(wh: Webhook) -> int:
    """The guard's requests so far, from the operator's own access log, once it has been still
    for a second (a line of an earlier test's request may still be on its way)."""

    def still() -> tuple[int] | None:  # a tuple: a count of 0 is an answer too
        first = wh.operator.log(10**8).count("POST /guard-pod")
        time.sleep(1)
        return (first,) if wh.operator.log(10**8).count("POST /guard-pod") == first else None

    return wait_for("the operator's access log to be still", still, timeout=30)[0]


def test_an_unlabelled_pod_is_untouched_and_an_ordinary_one_never_reaches_the_webhook(
    webhook: Webhook,
) -> None:
    """matchConditions: the API server calls the guard for a pod with a hostPath that could
    reach the host root, never for one without a hostPath or with a plain path elsewhere
    (counted in the operator's access log)."""
    before = guard_calls(webhook)
    body = webhook.pod_body("plain", None)
    body["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    pod = webhook.create_pod(body)
    logs = webhook.pod_body("plain-logs", None)
    logs["spec"]["volumes"] = [{"name": "logs", "hostPath": {"path": "/var/log"}}]
    webhook.create_pod(logs)  # a plain path beside the host root: the guard is not asked
    assert guard_calls(webhook) == before
    dotted = webhook.pod_body("dotted-logs", None)
    dotted["spec"]["volumes"] = [{"name": "logs", "hostPath": {"path": "/var/log/./app"}}]
    webhook.create_pod(dotted)  # not plain: the guard normalises it (/var/log/app) and admits it
    assert guard_calls(webhook) == before + 1
    assert "initContainers" not in pod["spec"] and "affinity" not in pod["spec"]
    assert pod["spec"]["volumes"] == [{"name": "scratch", "emptyDir": {}}]
    assert pod["spec"]["containers"][0]["env"] == [{"name": "HF_HOME", "value": "/cache"}]
    assert "volumeMounts" not in pod["spec"]["containers"][0]


def test_labelled_pods_of_system_namespaces_are_untouched(webhook: Webhook) -> None:
    """kube-system is never sent to the webhook (namespaceSelector), even for a pool that does
    not exist."""
    name = f"wh-sys-{webhook.suffix}"
    pod = webhook.create_pod(
        webhook.pod_body(name, f"no-such-pool-{webhook.suffix}"), namespace="kube-system"
    )
    try:
        assert "initContainers" not in pod["spec"] and not pod["spec"].get("volumes")
    finally:
        webhook.core.delete_namespaced_pod(name, "kube-system", grace_period_seconds=0)


def test_a_pod_labelled_as_the_operators_own_is_still_validated(webhook: Webhook) -> None:
    """``app.kubernetes.io/managed-by: offloadpool-operator`` is a label any pod can set, so it
    takes no pod out of scope. The agent pods are left out by their namespace."""
    missing = f"no-such-pool-{webhook.suffix}"
    managed = {"app.kubernetes.io/managed-by": "offloadpool-operator"}
    message = webhook.refusal(webhook.pod_body("agent-like", missing, **managed))
    assert f"OffloadPool '{missing}' does not exist" in message, message
    pool = webhook.create_pool("managed")
    forged = webhook.pod_body("agent-like-root", None, **managed)
    forged["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
    message = webhook.refusal(forged)
    assert "pods.guard.offloadpool.io" in message and "hostPath '/' reaches /var/lib/offloadpool" in message
    pod = wait_admitted(webhook, webhook.pod_body("agent-like-ok", pool, **managed))
    assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME  # mutated like any other


# -- what a pod may hold of the host root ---------------------------------------------------------
def test_a_labelled_pod_bringing_the_pools_volume_as_the_host_root_is_refused(webhook: Webhook) -> None:
    """The pool's volume name on ``hostPath: /`` was kept by the mutation and passed validation."""
    pool = webhook.create_pool("rootvol")
    body = webhook.pod_body("rootvol", pool)
    body["spec"]["volumes"] = [{"name": f"offloadpool-{pool}", "hostPath": {"path": "/"}}]
    message = webhook.refusal(body)
    assert f"volume 'offloadpool-{pool}' is reserved for the pool's directory" in message, message
    assert "hostPath '/'" in message, message
    # a mount of the pool's volume other than the webhook's (here read-write with a subPath)
    body = webhook.pod_body("rootmount", pool)
    body["spec"]["containers"][0]["volumeMounts"] = [
        {"name": f"offloadpool-{pool}", "mountPath": "/x", "subPath": "mnt"}
    ]
    message = webhook.refusal(body)
    assert f"mounts volume 'offloadpool-{pool}' differently from the webhook" in message, message
    # a sidecar of the user's own under the lease sidecar's name
    body = webhook.pod_body("rootside", pool)
    body["spec"]["initContainers"] = [
        {
            "name": LEASE_SIDECAR_NAME,
            "image": "busybox",
            "restartPolicy": "Always",
            "command": ["sleep", "1d"],
        }
    ]
    message = webhook.refusal(body)
    assert f"init container '{LEASE_SIDECAR_NAME}' is reserved" in message, message


HOST_PATHS = [
    "/var/lib/offloadpool/{pool}",
    "/var/lib/../lib/offloadpool",
    "/var/./lib/offloadpool",
    "/",
    "//var/lib/offloadpool/",
    "/proc/1/root",
]


@pytest.mark.parametrize("path", HOST_PATHS)
def test_an_unlabelled_pod_with_a_hostpath_reaching_the_root_is_refused(webhook: Webhook, path: str) -> None:
    pool = webhook.create_pool(f"hp{secrets.token_hex(2)}")
    path = path.format(pool=pool)
    body = webhook.pod_body(f"hp-{secrets.token_hex(3)}", None)
    body["spec"]["volumes"] = [{"name": "state", "hostPath": {"path": path}}]
    if ".." in path:  # the API server's own validation refuses it first (422); the guard would too
        with pytest.raises(ApiException) as err:
            webhook.core.create_namespaced_pod(webhook.namespace, body)
        assert err.value.status == 422 and "must not contain '..'" in str(err.value.body)
        assert hostguard.reaches(path, "/var/lib/offloadpool")
        return
    message = webhook.refusal(body)
    assert "pods.guard.offloadpool.io" in message, message
    assert f"volume 'state': hostPath {path!r} reaches /var/lib/offloadpool" in message, message


KUBELET_PATHS = [
    "/var/lib/kubelet",
    "/var/lib/kubelet/",
    "/var/lib/kubelet/pods",
    "/var/lib/kubelet/plugins/offloadpool.io",
    "/var/lib/kubelet/plugins_registry",
    "/var/lib/kubelet/pod-resources/",
    "//var/lib/kubelet/pods",
    "/var/lib/./kubelet/plugins",
    "/var/lib/kubelet/pods/.",
]


@pytest.mark.parametrize("path", KUBELET_PATHS)
def test_a_hostpath_into_the_kubelets_tree_is_sent_to_the_guard_and_refused(
    webhook: Webhook, path: str
) -> None:
    """Issue 36: ``pods/`` holds every CSI-published pool's memory and ``plugins/offloadpool.io``
    the socket that publishes any pool; the guard's matchConditions send every spelling of the
    kubelet's tree to the webhook, which refuses it, labelled or not."""
    pool = webhook.create_pool(f"kl{secrets.token_hex(2)}")
    for label in (None, pool):
        body = webhook.pod_body(f"kl-{secrets.token_hex(3)}", label)
        body["spec"].setdefault("volumes", []).append({"name": "kubelet", "hostPath": {"path": path}})
        message = webhook.refusal(body)
        # unlabelled, only the guard sees it (its matchConditions sent it); labelled, the
        # validating webhook applies the same rule and may answer first
        hooks = ["pods.guard"] if label is None else ["pods.guard", "pods.validate"]
        assert any(f"{hook}.offloadpool.io" in message for hook in hooks), message
        assert f"volume 'kubelet': hostPath {path!r} reaches /var/lib/kubelet" in message, message
    # beside it: never sent (no wait for the operator), admitted as written
    body = webhook.pod_body(f"kl-{secrets.token_hex(3)}", None)
    body["spec"]["volumes"] = [{"name": "beside", "hostPath": {"path": "/var/lib/kubelet-other"}}]
    assert webhook.create_pod(body)["spec"]["volumes"][0]["hostPath"]["path"] == "/var/lib/kubelet-other"


def test_a_labelled_pod_may_not_add_another_hostpath_to_the_root(webhook: Webhook) -> None:
    pool = webhook.create_pool("hp2")
    other = webhook.create_pool("hp3")
    body = webhook.pod_body("hp2", pool)
    body["spec"]["volumes"] = [{"name": "theirs", "hostPath": {"path": f"/var/lib/offloadpool/{other}"}}]
    message = webhook.refusal(body)
    assert f"volume 'theirs': hostPath '/var/lib/offloadpool/{other}' reaches" in message, message


@pytest.mark.parametrize("kind", ["containers", "initContainers"])
def test_an_unlabelled_pod_requesting_a_pools_resource_is_refused(webhook: Webhook, kind: str) -> None:
    """The node's one slot of a pool, taken by a pod without the label (no pool, no lease)."""
    pool = webhook.create_pool(f"slot{kind[0]}")
    body = webhook.pod_body(f"slot-{kind.lower()}", None)
    container = {
        "name": "taker",
        "image": "busybox",
        "resources": {"limits": {f"offloadpool.io/{pool}": "1"}},
    }
    if kind == "containers":
        body["spec"]["containers"].append(container)
    else:
        body["spec"]["initContainers"] = [container]
    message = webhook.refusal(body)
    assert "pods.guard.offloadpool.io" in message, message
    assert f"resource offloadpool.io/{pool}: only a pod labelled offloadpool.io/pool: {pool}" in message
    # a labelled pod may ask for its own pool's unit in a container (the sidecar then adds none)
    own = webhook.pod_body(f"slot-own-{kind.lower()}", pool)
    own["spec"]["containers"][0]["resources"] = {"limits": {f"offloadpool.io/{pool}": "1"}}
    pod = wait_admitted(webhook, own)
    assert f"offloadpool.io/{pool}" not in pod["spec"]["initContainers"][0]["resources"]["limits"]


def test_a_namespace_with_admission_disabled_keeps_the_guard(webhook: Webhook) -> None:
    """``offloadpool.io/admission=disabled`` turns off the mutation (labelled pods are created as
    written) but not the guard: the host root is still only the labelled pool's volume."""
    pool = webhook.create_pool("disabled")
    ns = f"wh-off-{webhook.suffix}"
    webhook.core.create_namespace(
        client.V1Namespace(
            metadata=client.V1ObjectMeta(name=ns, labels={"offloadpool.io/admission": "disabled"})
        )
    )
    try:
        wait_for(
            f"ServiceAccount {ns}/default",
            lambda: (
                webhook.core.list_namespaced_service_account(ns, field_selector="metadata.name=default").items
            ),
        )
        body = webhook.pod_body("root", pool)
        body["spec"]["volumes"] = [{"name": "root", "hostPath": {"path": "/"}}]
        assert "pods.guard.offloadpool.io" in webhook.refusal(body, namespace=ns)
        # written by hand, exactly the pool's volume, by a pod labelled with the pool: as written
        body = webhook.pod_body("by-hand", pool)
        body["spec"]["volumes"] = [
            {
                "name": f"offloadpool-{pool}",
                "hostPath": {"path": f"/var/lib/offloadpool/{pool}", "type": "Directory"},
            }
        ]
        pod = wait_admitted(webhook, body, namespace=ns)
        assert "initContainers" not in pod["spec"]
    finally:
        webhook.core.delete_namespace(ns)


def test_a_labelled_pod_that_escaped_mutation_is_refused_and_the_operator_restores_the_configuration(
    webhook: Webhook,
) -> None:
    """With the mutating configuration gone, the validating webhook refuses a labelled pod (it
    would run without its pool and lease). Re-created as shipped, the operator points it at
    itself again (its resync), and labelled pods are mutated again."""
    pool = webhook.create_pool("escape")
    webhook.admission.delete_mutating_webhook_configuration(WEBHOOK_CONFIGURATION_NAME)
    try:

        def refused() -> str | None:
            try:
                webhook.create_pod(webhook.pod_body(f"escaped-{secrets.token_hex(2)}", pool))
            except ApiException as exc:
                return str(exc.body) if "pods.validate.offloadpool.io" in str(exc.body) else None
            return None

        message = wait_for("the validating webhook to refuse an unmutated pod", refused, timeout=30)
        assert (
            "lacks what the offloadpool mutating webhook adds" in message
            and "/spec/initContainers" in message
        ), message
    finally:
        (mutating,) = [d for d in webhook_configurations() if d["kind"].startswith("Mutating")]
        webhook.apply_configuration(mutating)
    wait_for("the operator to restore the mutating configuration", webhook.pointed_at_operator, timeout=30)
    pod = wait_admitted(webhook, webhook.pod_body("restored", pool))
    assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME


@pytest.mark.parametrize("example", ["pod-library.yaml", "deployment-stock-compat.yaml"])
def test_the_vllm_example_pods_are_admitted_and_get_their_pool(webhook: Webhook, example: str) -> None:
    """examples/vllm/ as a user writes them (one label), only the pool and namespace renamed; a
    Deployment's pod as its ReplicaSet would create it (its template)."""
    (body,) = list(yaml.safe_load_all((REPO / "examples" / "vllm" / example).read_text()))
    if body["kind"] == "Deployment":
        template = body["spec"]["template"]
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": dict(template["metadata"]),
            "spec": template["spec"],
        }
    labelled = body["metadata"]["labels"][POD_POOL_LABEL]
    spec: dict[str, Any] = {"capacity": "1Gi", "medium": "MemoryTHP"}
    if "compat" in example:
        spec.update(segments={"maxFiles": 1}, compat={"vllm": {"engineId": "llama-70b-tp4"}})
    pool = webhook.create_pool(f"ex-{labelled}"[:30], **spec)
    body["metadata"].update(name=f"ex-{example.split('.')[0]}", namespace=webhook.namespace)
    body["metadata"]["labels"][POD_POOL_LABEL] = pool
    body["spec"]["automountServiceAccountToken"] = False
    # as a user would: kubectl (which also prints the webhook's warning: the pool is Ready nowhere yet)
    out = webhook.cp.kubectl("create", "-f", "-", "-o", "json", input=yaml.safe_dump(body))
    pod = json.loads(out.stdout)
    assert f"OffloadPool '{pool}' is Ready on no node yet" in out.stderr, out.stderr
    assert pod["spec"]["initContainers"][0]["name"] == LEASE_SIDECAR_NAME
    main = pod["spec"]["containers"][0]
    assert {"name": "OFFLOADPOOL_POOL_DIR", "value": f"/offloadpool/{pool}"} in main["env"]
    if "compat" in example:
        assert any(m["mountPath"] == "/dev/shm/vllm_offload_llama-70b-tp4.mmap" for m in main["volumeMounts"])


def test_the_sglang_example_pod_gets_everything_the_sglang_plugin_reads(webhook: Webhook) -> None:
    """examples/sglang/pod-hicache.yaml through the real API server, for a PerRank pool of 2
    shares: the stored pod's environment, resolved as the kubelet would (its real uid), is all
    the SGLang plugin's own reader needs: the pool's directory and the pod's share."""
    (body,) = list(yaml.safe_load_all((REPO / "examples" / "sglang" / "pod-hicache.yaml").read_text()))
    pool = webhook.create_pool("ex-sglang", layout={"type": "PerRank", "ranks": 2}, partitions=2)
    body["metadata"].update(namespace=webhook.namespace)
    body["metadata"]["labels"][POD_POOL_LABEL] = pool
    body["spec"]["automountServiceAccountToken"] = False
    out = webhook.cp.kubectl("create", "-f", "-", "-o", "json", input=yaml.safe_dump(body))
    pod = json.loads(out.stdout)
    (engine,) = pod["spec"]["containers"]
    assert engine["command"][:3] == ["python", "-m", "sglang.launch_server"]
    reads = plugin_reads(resolved_env(pod, engine))
    assert reads == {"pool_dir": f"/offloadpool/{pool}", "owner": pod["metadata"]["uid"]}
    # what the API server stored (its fieldRef defaulted) mutates to itself: validation admits it
    settings = InjectionSettings(sidecar_image=SIDECAR_IMAGE)
    assert admission.not_mutated(pod, webhook.pool(pool), settings) == []
