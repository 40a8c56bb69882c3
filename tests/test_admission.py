"""The admission policy as pure functions (operator/offloadpool/operator/admission.py): what a
labelled pod gets, that mutating its own output changes nothing, and what is refused.

The same functions answer the real API server in tests/test_webhook.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.sglang_pod_env import plugin_reads, resolved_env
from offloadpool.api.constants import extended_resource_name, pool_label_key
from offloadpool.api.pods import (
    ENV_POOL_DIR,
    LEASE_SIDECAR_NAME,
    POD_POOL_LABEL,
    compat_volume_name,
    pod_pool_dir,
    pool_volume_name,
)
from offloadpool.csi.config import DRIVER_NAME
from offloadpool.csi.volume import POOL_ATTRIBUTE
from offloadpool.operator import admission, hostguard
from offloadpool.operator.admission import InjectionSettings, Refused

REPO = Path(__file__).resolve().parents[1]
SETTINGS = InjectionSettings(
    sidecar_image="registry.example/offloadpool:1", excluded_namespaces=("kube-system", "ops")
)


def pool(name: str = "kv", **spec: Any) -> dict[str, Any]:
    body = {"capacity": "4Gi", "medium": "HugePages-2Mi", **spec}
    return {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPool",
        "metadata": {"name": name},
        "spec": body,
    }


def pod(pool_name: str | None = "kv", containers: int = 1, **spec: Any) -> dict[str, Any]:
    labels = {"app": "vllm"} | ({POD_POOL_LABEL: pool_name} if pool_name is not None else {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine", "namespace": "inference", "labels": labels},
        "spec": {
            "containers": [{"name": f"c{i}", "image": "vllm/vllm-openai:v0.33.0"} for i in range(containers)],
            **spec,
        },
    }


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_a_labelled_pod_gets_volume_mounts_env_affinity_resource_and_sidecar() -> None:
    p = pool(
        layout={"type": "Interleaved", "ranks": 4, "slotSize": "2Mi"}, consumers={"uid": 1000, "gid": 2000}
    )
    new = admission.mutate(pod(containers=2), p, SETTINGS)
    spec = new["spec"]
    assert {
        "name": pool_volume_name("kv"),
        "hostPath": {"path": "/var/lib/offloadpool/kv", "type": "Directory"},
    } in spec["volumes"]
    for c in spec["containers"]:
        assert {
            "name": "offloadpool-kv",
            "mountPath": "/offloadpool/kv",
            "mountPropagation": "HostToContainer",
            "readOnly": True,  # the directory is on the host's disk
        } in c["volumeMounts"]
        env = env_of(c)
        assert env[ENV_POOL_DIR] == "/offloadpool/kv"
        assert (env["OFFLOADPOOL_LAYOUT"], env["OFFLOADPOOL_RANKS"], env["OFFLOADPOOL_SLOT_BYTES"]) == (
            "Interleaved",
            "4",
            str(2 << 20),
        )
        assert env["OFFLOADPOOL_MEDIUM"] == "HugePages-2Mi" and env["OFFLOADPOOL_CAPACITY_BYTES"] == str(
            4 << 30
        )
        assert "resources" not in c  # the pod's one unit of the pool is on the sidecar
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term == {
        "matchExpressions": [{"key": pool_label_key("kv"), "operator": "In", "values": ["ready"]}]
    }
    sidecar = spec["initContainers"][0]
    assert sidecar["name"] == LEASE_SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "registry.example/offloadpool:1"
    assert sidecar["command"][:3] == ["offloadpool", "hold-lease", "/offloadpool/kv"]
    assert sidecar["resources"]["limits"][extended_resource_name("kv")] == "1"
    assert sidecar["resources"]["requests"][extended_resource_name("kv")] == "1"
    assert (sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsGroup"]) == (1000, 2000)
    assert sidecar["securityContext"]["runAsNonRoot"] is True
    assert (
        sidecar["startupProbe"]["exec"]["command"][-1] == sidecar["command"][-1]
    )  # waits for its ready file


def test_mutating_its_own_output_changes_nothing() -> None:
    for p in (pool(), pool(compat={"vllm": {"engineId": "llama", "rowSize": "2Mi"}}, medium="MemoryTHP")):
        once = admission.mutate(pod(containers=2), p, SETTINGS)
        assert admission.mutate(once, p, SETTINGS) == once
        assert admission.json_patch(once, admission.mutate(once, p, SETTINGS)) == []
        assert admission.not_mutated(once, p, SETTINGS) == []


def test_what_the_api_server_defaults_around_the_injection_is_left_alone() -> None:
    """The API server adds fields to what the webhook added (probe timeouts, termination
    message paths); a pod coming back through the webhook must not be rewritten."""
    p = pool()
    defaulted = admission.mutate(pod(), p, SETTINGS)
    side = defaulted["spec"]["initContainers"][0]
    side.update(terminationMessagePath="/dev/termination-log", terminationMessagePolicy="File")
    side["startupProbe"].update(timeoutSeconds=1, successThreshold=1)
    defaulted["spec"]["volumes"][0]["hostPath"]["type"] = "Directory"
    assert admission.mutate(defaulted, p, SETTINGS) == defaulted


def test_the_service_account_token_mount_added_to_the_sidecar_is_left_alone() -> None:
    """A pod that mounts its ServiceAccount token (the default): once the webhook added the
    sidecar, the API server's ServiceAccount plugin mounts the token into it too and calls the
    webhook again (reinvocationPolicy IfNeeded). The sidecar is still the webhook's own; a
    mount of anything else in it is not."""
    p = pool()
    token = {
        "name": "kube-api-access-x7k2q",
        "readOnly": True,
        "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
    }
    once = admission.mutate(pod(), p, SETTINGS)
    for container in once["spec"]["containers"] + once["spec"]["initContainers"]:
        container.setdefault("volumeMounts", []).append(dict(token))
    assert admission.mutate(once, p, SETTINGS) == once
    assert admission.not_mutated(once, p, SETTINGS) == []

    for other in ({**token, "readOnly": False}, {**token, "name": "host"}, {**token, "subPath": "x"}):
        forged = copy.deepcopy(once)
        forged["spec"]["initContainers"][0]["volumeMounts"][-1] = other
        with pytest.raises(Refused, match="reserved for the lease sidecar"):
            admission.mutate(forged, p, SETTINGS)


def test_the_input_is_not_changed() -> None:
    original = pod()
    kept = copy.deepcopy(original)
    admission.mutate(original, pool(), SETTINGS)
    assert original == kept


def test_existing_affinity_terms_each_get_the_requirement() -> None:
    gpu = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H200"]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [gpu]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
                ]
            }
        }
    }
    new = admission.mutate(pod(affinity=affinity), pool(), SETTINGS)
    terms = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    ready = {"key": pool_label_key("kv"), "operator": "In", "values": ["ready"]}
    assert terms[0]["matchExpressions"] == [gpu, ready]
    assert terms[1]["matchExpressions"] == [ready] and terms[1]["matchFields"]


def test_existing_env_is_kept_and_ours_wins() -> None:
    base = pod()
    base["spec"]["containers"][0]["env"] = [
        {"name": "HF_HOME", "value": "/cache"},
        {"name": ENV_POOL_DIR, "value": "/wrong"},
    ]
    env = admission.mutate(base, pool(), SETTINGS)["spec"]["containers"][0]["env"]
    assert env[0] == {"name": "HF_HOME", "value": "/cache"}
    assert env[1] == {"name": ENV_POOL_DIR, "value": pod_pool_dir("kv")}  # same place, the pool's value


def test_a_container_that_already_asks_for_the_pool_keeps_it_and_the_sidecar_does_not_add_one() -> None:
    base = pod()
    base["spec"]["containers"][0]["resources"] = {"limits": {extended_resource_name("kv"): "1"}}
    new = admission.mutate(base, pool(), SETTINGS)
    assert extended_resource_name("kv") not in new["spec"]["initContainers"][0]["resources"]["limits"]
    assert new["spec"]["containers"][0]["resources"] == {"limits": {extended_resource_name("kv"): "1"}}


def test_the_sidecar_comes_first_so_the_lease_is_held_before_any_init_container_runs() -> None:
    new = admission.mutate(pod(initContainers=[{"name": "download", "image": "busybox"}]), pool(), SETTINGS)
    assert [c["name"] for c in new["spec"]["initContainers"]] == [LEASE_SIDECAR_NAME, "download"]
    assert "volumeMounts" not in new["spec"]["initContainers"][1]  # user init containers are left alone


def test_compat_pool_mounts_the_region_file_where_vllm_looks_as_a_subpath_of_the_pool() -> None:
    """No hostPath names anything below ``<root>/<pool>``: a root consumer can replace a name in
    the pool's mount (with a link to a host file), and the kubelet's ``stat`` and the runtime's
    bind of a hostPath follow links; a subPath is resolved beneath the volume (issue 36)."""
    p = pool(capacity="1Gi", compat={"vllm": {"engineId": "llama-70b"}}, medium="MemoryTHP")
    new = admission.mutate(pod(), p, SETTINGS)
    assert new["spec"]["volumes"][-1:] == [
        {"name": pool_volume_name("kv"), "hostPath": {"path": "/var/lib/offloadpool/kv", "type": "Directory"}}
    ]
    mounts = new["spec"]["containers"][0]["volumeMounts"]
    assert {
        "name": pool_volume_name("kv"),
        "mountPath": "/dev/shm/vllm_offload_llama-70b.mmap",
        "subPath": "mnt/vllm_offload_llama-70b.mmap",
    } in mounts
    assert env_of(new["spec"]["containers"][0])["OFFLOADPOOL_VLLM_ENGINE_ID"] == "llama-70b"
    for volume in new["spec"]["volumes"]:
        if "hostPath" in volume:
            assert volume["hostPath"]["path"].count("/") == 4, volume  # /var/lib/offloadpool/<pool>


def test_compat_pool_of_several_vllm_files_mounts_each_where_vllm_maps_it() -> None:
    # 4 GiB in 2 MiB rows: CPUOffloadingSpec's 32 segments make min(32, 4) = 4 files.
    p = pool(compat={"vllm": {"engineId": "llama-70b", "rowSize": "2Mi"}}, medium="MemoryTHP")
    new = admission.mutate(pod(), p, SETTINGS)
    names = ["vllm_offload_llama-70b.mmap"] + [f"vllm_offload_llama-70b.mmap.{i}" for i in (1, 2, 3)]
    assert [v["name"] for v in new["spec"]["volumes"]] == [pool_volume_name("kv")]
    mounts = {m["mountPath"]: m for m in new["spec"]["containers"][0]["volumeMounts"]}
    for name in names:
        assert mounts[f"/dev/shm/{name}"] == {
            "name": pool_volume_name("kv"),
            "mountPath": f"/dev/shm/{name}",
            "subPath": f"mnt/{name}",
        }
    assert "/dev/shm/vllm_offload_llama-70b.mmap.4" not in mounts


def test_a_mount_path_taken_by_another_volume_is_refused_with_the_container_named() -> None:
    base = pod(volumes=[{"name": "mine", "emptyDir": {}}])
    base["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": "/offloadpool/kv"}]
    with pytest.raises(Refused, match="container 'c0' already mounts volume 'mine' at /offloadpool/kv"):
        admission.mutate(base, pool(), SETTINGS)


def test_a_pod_that_skipped_mutation_is_told_apart() -> None:
    assert "/spec/initContainers" in admission.not_mutated(pod(), pool(), SETTINGS)


def test_a_refusal_names_each_difference_with_both_values() -> None:
    """A pod the mutation reached but something changed after it is not told to look for a
    missing webhook: the refusal names the place and what the pod has and the webhook writes."""
    changed = admission.mutate(pod(), pool(partitions=2, capacity="4Gi"), SETTINGS)
    env = changed["spec"]["containers"][0]["env"]
    i = next(i for i, e in enumerate(env) if e["name"] == "OFFLOADPOOL_MEDIUM")
    env[i]["value"] = "Memory"
    found = admission.differences(changed, pool(partitions=2, capacity="4Gi"), SETTINGS)
    message = admission.unmutated_refusal("kv", found, "offloadpool")
    assert (
        f'/spec/containers/0/env/{i}/value: the pod has "Memory", the webhook writes "HugePages-2Mi"'
    ) in message, message
    assert "something changed the pod after the mutation" in message and "in place?" not in message
    # a pod the mutation never reached lacks what it adds: that one asks after the webhook
    lacking = admission.unmutated_refusal("kv", admission.differences(pod(), pool(), SETTINGS), "offloadpool")
    assert "lacks what the offloadpool mutating webhook adds (/spec/volumes, " in lacking
    assert "is the MutatingWebhookConfiguration 'offloadpool' in place?" in lacking, lacking


@pytest.mark.parametrize(
    ("name", "namespace", "the_pool", "expected"),
    [
        ("kv", "inference", None, "OffloadPool 'kv' does not exist (pod label offloadpool.io/pool='kv')"),
        ("Not_A_Pool", "inference", None, "cannot name an OffloadPool"),
        (
            "kv",
            "team-b",
            pool(consumers={"namespaces": ["team-a", "inference"]}),
            "namespace 'team-b' may not use OffloadPool 'kv': "
            "its spec.consumers.namespaces allows only inference, team-a",
        ),
    ],
)
def test_refusals_say_why(name: str, namespace: str, the_pool: Any, expected: str) -> None:
    assert expected in (admission.refusal(name, namespace, the_pool) or "")


def test_allowed_pools() -> None:
    assert admission.refusal("kv", "inference", pool()) is None
    assert admission.refusal("kv", "inference", pool(consumers={"namespaces": ["inference"]})) is None
    assert admission.refusal("kv", "inference", pool(consumers={"namespaces": []})) is None  # empty = any


def test_a_pool_being_deleted_is_refused() -> None:
    p = pool()
    p["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    assert "is being deleted" in (admission.refusal("kv", "inference", p) or "")


def test_scope_unlabelled_and_excluded_namespaces_are_out_and_no_label_of_the_pod_exempts_it() -> None:
    assert admission.in_scope(pod(), "inference", SETTINGS)
    assert not admission.in_scope(pod(pool_name=None), "inference", SETTINGS)
    assert not admission.in_scope(pod(), "kube-system", SETTINGS)
    assert not admission.in_scope(pod(), "ops", SETTINGS)
    assert not admission.in_scope(pod(), "inference", SETTINGS, {"offloadpool.io/admission": "disabled"})
    # the operator's agent pods are left out by their namespace, not by a label a pod can copy
    forged = pod()
    forged["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "offloadpool-operator"
    assert admission.in_scope(forged, "inference", SETTINGS)


# -- what the mutation keys by name is checked by content ---------------------------------------
def test_a_volume_under_the_pools_name_that_is_not_the_pools_is_refused_not_kept() -> None:
    """A volume named as the pool's but holding hostPath / (or anything else) is refused,
    never kept in place of the pool's by the mutation."""
    for source in (
        {"hostPath": {"path": "/"}},
        {"hostPath": {"path": "/var/lib/offloadpool/kv", "type": "DirectoryOrCreate"}},
        {"hostPath": {"path": "/var/lib/offloadpool/other", "type": "Directory"}},
        {"emptyDir": {}},
    ):
        base = pod(volumes=[{"name": pool_volume_name("kv"), **source}])
        with pytest.raises(Refused, match="volume 'offloadpool-kv' is reserved for the pool's directory"):
            admission.mutate(base, pool(), SETTINGS)
        with pytest.raises(Refused):
            admission.not_mutated(
                admission.mutate(pod(), pool(), SETTINGS) | {"spec": base["spec"]}, pool(), SETTINGS
            )
    compat = pool(capacity="1Gi", compat={"vllm": {"engineId": "e"}}, medium="MemoryTHP")
    base = pod(
        volumes=[{"name": compat_volume_name("kv"), "hostPath": {"path": "/etc/shadow", "type": "File"}}]
    )
    with pytest.raises(Refused, match="reserved: the webhook mounts a compat pool's region files"):
        admission.mutate(base, compat, SETTINGS)
    # what an older release wrote (a hostPath of the name in the pool's mount) is refused too
    old = pod(
        volumes=[
            {
                "name": compat_volume_name("kv"),
                "hostPath": {"path": "/var/lib/offloadpool/kv/mnt/vllm_offload_e.mmap", "type": "File"},
            }
        ]
    )
    with pytest.raises(Refused, match="never as hostPath volumes"):
        admission.not_mutated(old, compat, SETTINGS)


@pytest.mark.parametrize(
    "mount",
    [
        {"mountPath": "/offloadpool/kv", "mountPropagation": "HostToContainer"},  # writable
        {"mountPath": "/offloadpool/kv", "mountPropagation": "HostToContainer", "readOnly": False},
        {"mountPath": "/offloadpool/kv", "mountPropagation": "Bidirectional", "readOnly": True},
        {"mountPath": "/offloadpool/kv"},
        {"mountPath": "/elsewhere", "mountPropagation": "HostToContainer"},
        {"mountPath": "/offloadpool/kv", "mountPropagation": "HostToContainer", "subPath": "mnt"},
    ],
)
@pytest.mark.parametrize("kind", ["containers", "initContainers"])
def test_a_mount_of_the_pools_volume_other_than_the_webhooks_is_refused(
    mount: dict[str, Any], kind: str
) -> None:
    mutated = admission.mutate(pod(), pool(), SETTINGS)
    changed = copy.deepcopy(mutated)
    target = changed["spec"][kind][-1]
    target["volumeMounts"] = [m for m in target.get("volumeMounts", []) if m["name"] != "offloadpool-kv"]
    target["volumeMounts"].append({"name": "offloadpool-kv", **mount})
    with pytest.raises(Refused, match="mounts volume 'offloadpool-kv' differently from the webhook"):
        admission.not_mutated(changed, pool(), SETTINGS)


def test_an_init_container_under_the_sidecars_name_that_is_not_the_sidecar_is_refused() -> None:
    mutated = admission.mutate(pod(), pool(), SETTINGS)
    for change in (
        {"command": ["sleep", "infinity"]},
        {"args": ["--extra"]},
        {"securityContext": {"privileged": True}},
        {
            "volumeMounts": [
                {
                    "name": "offloadpool-kv",
                    "mountPath": "/offloadpool/kv",
                    "mountPropagation": "HostToContainer",
                    "readOnly": True,
                },
                {"name": "x", "mountPath": "/x"},
            ]
        },
    ):
        forged = copy.deepcopy(mutated)
        forged["spec"]["initContainers"][0].update(change)
        with pytest.raises(Refused, match="init container 'offloadpool-lease' is reserved"):
            admission.not_mutated(forged, pool(), SETTINGS)
    # a user's own, before mutation, is refused too (never kept in place of ours)
    own = pod(initContainers=[{"name": LEASE_SIDECAR_NAME, "image": "busybox", "restartPolicy": "Always"}])
    with pytest.raises(Refused, match="reserved for the lease sidecar"):
        admission.mutate(own, pool(), SETTINGS)


# -- spec.consumers.delivery: CSI ------------------------------------------------------------
def csi_pool(name: str = "kv", **spec: Any) -> dict[str, Any]:
    consumers = {"delivery": "CSI", **spec.pop("consumers", {})}
    return pool(name, consumers=consumers, **spec)


CSI_VOLUME = {
    "name": "offloadpool-kv",
    "csi": {"driver": "offloadpool.io", "volumeAttributes": {"pool": "kv"}},
}


def test_csi_delivery_gives_an_inline_csi_volume_env_affinity_resource_and_no_sidecar() -> None:
    """What the node plugin expects (its driver name, the pool in ``volumeAttributes``), the
    same path and environment as HostPath, and nothing that needs a privilege: no hostPath, no
    propagation, no sidecar (the published volume holds the pool); the pod's resource goes to
    its first container."""
    new = admission.mutate(pod(containers=2), csi_pool(), SETTINGS)
    spec = new["spec"]
    assert spec["volumes"] == [CSI_VOLUME]
    assert not spec.get("initContainers")
    for c in spec["containers"]:
        assert c["volumeMounts"] == [{"name": "offloadpool-kv", "mountPath": "/offloadpool/kv"}]
        assert env_of(c)[ENV_POOL_DIR] == "/offloadpool/kv"
    resource = extended_resource_name("kv")
    first, second = spec["containers"]
    assert first["resources"] == {"requests": {resource: "1"}, "limits": {resource: "1"}}
    assert "resources" not in second
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": pool_label_key("kv"), "operator": "In", "values": ["ready"]}
    ]
    assert "hostPath" not in json.dumps(new) and "securityContext" not in json.dumps(new)


def test_csi_volume_matches_what_the_node_plugin_reads() -> None:
    """The driver and attribute the mutation writes are the plugin's own names."""
    (volume,) = admission.volumes(csi_pool(), SETTINGS)
    assert volume["csi"]["driver"] == DRIVER_NAME
    assert volume["csi"]["volumeAttributes"] == {POOL_ATTRIBUTE: "kv"}


def test_csi_delivery_mutating_its_own_output_changes_nothing() -> None:
    once = admission.mutate(pod(containers=2), csi_pool(), SETTINGS)
    assert admission.mutate(once, csi_pool(), SETTINGS) == once
    assert admission.not_mutated(once, csi_pool(), SETTINGS) == []
    assert admission.not_mutated(pod(), csi_pool(), SETTINGS) != []


def test_csi_delivery_a_container_that_asks_for_the_pool_keeps_it_and_none_is_added() -> None:
    resource = extended_resource_name("kv")
    asking = pod(containers=2)
    asking["spec"]["containers"][1]["resources"] = {"limits": {resource: "1"}}
    new = admission.mutate(asking, csi_pool(), SETTINGS)
    assert "resources" not in new["spec"]["containers"][0]
    assert new["spec"]["containers"][1]["resources"] == {"limits": {resource: "1"}}


def test_csi_delivery_of_a_compat_pool_mounts_vllms_files_from_the_volume() -> None:
    p = csi_pool(
        medium="MemoryTHP", segments={"maxFiles": 1}, compat={"vllm": {"engineId": "e1", "numSegments": 1}}
    )
    new = admission.mutate(pod(), p, SETTINGS)
    assert new["spec"]["volumes"] == [CSI_VOLUME]
    assert new["spec"]["containers"][0]["volumeMounts"] == [
        {"name": "offloadpool-kv", "mountPath": "/offloadpool/kv"},
        {
            "name": "offloadpool-kv",
            "mountPath": "/dev/shm/vllm_offload_e1.mmap",
            "subPath": "mnt/vllm_offload_e1.mmap",
        },
    ]
    assert admission.mutate(new, p, SETTINGS) == new


@pytest.mark.parametrize(
    "own",
    [
        {"name": "offloadpool-kv", "hostPath": {"path": "/var/lib/offloadpool/kv", "type": "Directory"}},
        {
            "name": "offloadpool-kv",
            "csi": {"driver": "offloadpool.io", "volumeAttributes": {"pool": "other"}},
        },
        {"name": "offloadpool-kv", "emptyDir": {}},
    ],
)
def test_csi_delivery_a_volume_under_the_pools_name_that_is_not_ours_is_refused(own: dict[str, Any]) -> None:
    with pytest.raises(Refused, match="volume 'offloadpool-kv' is reserved for the pool's directory"):
        admission.mutate(pod(volumes=[own]), csi_pool(), SETTINGS)


@pytest.mark.parametrize(
    "mount",
    [
        {"mountPath": "/offloadpool/kv", "readOnly": True},
        {"mountPath": "/elsewhere"},
        {"mountPath": "/offloadpool/kv", "subPath": "mnt"},
    ],
)
def test_csi_delivery_a_mount_of_the_pools_volume_other_than_the_webhooks_is_refused(
    mount: dict[str, Any],
) -> None:
    changed = admission.mutate(pod(), csi_pool(), SETTINGS)
    target = changed["spec"]["containers"][0]
    target["volumeMounts"] = [{"name": "offloadpool-kv", **mount}]
    with pytest.raises(Refused, match="mounts volume 'offloadpool-kv' differently from the webhook"):
        admission.not_mutated(changed, csi_pool(), SETTINGS)


def test_csi_delivery_the_guard_still_refuses_a_hand_written_hostpath_of_the_pool() -> None:
    """A CSI pool's own volumes are no hostPath: a pod labelled for it that brings the pool
    directory as a hostPath under another name is refused by the guard."""
    p = csi_pool()
    own = {"name": "mine", "hostPath": {"path": "/var/lib/offloadpool/kv"}}
    mutated = admission.mutate(pod(volumes=[own]), p, SETTINGS)
    why = hostguard.refusals(mutated, SETTINGS.guarded(), "kv", admission.volumes(p, SETTINGS))
    assert why and "volume 'mine'" in why[0]
    mutated = admission.mutate(pod(), p, SETTINGS)
    assert hostguard.refusals(mutated, SETTINGS.guarded(), "kv", admission.volumes(p, SETTINGS)) == []


def test_the_guard_refuses_a_csi_volume_of_the_driver_but_the_mutations_own() -> None:
    """Issue 36 finding 7: a csi volume of the driver takes a share at publish; only the
    mutation's, for the pod's labelled pool (with its resource), is admitted."""
    p = csi_pool()
    own = {"name": "own", "csi": {"driver": "offloadpool.io", "volumeAttributes": {"pool": "kv"}}}
    (why,) = hostguard.refusals(pod(volumes=[own]), SETTINGS.guarded(), None)
    assert "volume 'own': an inline csi volume of driver offloadpool.io (pool 'kv')" in why, why
    assert "by the label offloadpool.io/pool: <pool>" in why, why
    mutated = admission.mutate(pod(volumes=[own]), p, SETTINGS)
    (why,) = hostguard.refusals(mutated, SETTINGS.guarded(), "kv", admission.volumes(p, SETTINGS))
    assert "'own'" in why and "is not the volume the webhook writes for offloadpool.io/pool: kv" in why, why
    other = {"name": "x", "csi": {"driver": "other.example.com", "volumeAttributes": {"pool": "kv"}}}
    assert hostguard.refusals(pod(volumes=[other]), SETTINGS.guarded(), None) == []


@pytest.mark.parametrize("partitions", [1, 2])
def test_an_sglang_pod_gets_everything_the_sglang_plugin_reads(partitions: int) -> None:
    """examples/sglang/pod-hicache.yaml through the mutation: the plugin's own reader, run in a
    process whose whole environment is the container's, finds the pool's directory (and, for a
    pool of shares, claims its share for the pod's uid), so no engine annotation is needed."""
    (body,) = yaml.safe_load_all((REPO / "examples" / "sglang" / "pod-hicache.yaml").read_text())
    name = body["metadata"]["labels"][POD_POOL_LABEL]
    body["metadata"]["uid"] = "0f6c1f5e-sglang-pod"
    p = pool(name, capacity="128Gi", layout={"type": "PerRank", "ranks": 2}, partitions=partitions)
    mutated = admission.mutate(body, p, SETTINGS)
    (engine,) = mutated["spec"]["containers"]
    assert engine["command"][:3] == ["python", "-m", "sglang.launch_server"]
    assert "--enable-hierarchical-cache" in engine["command"]
    reads = plugin_reads(resolved_env(mutated, engine))
    assert reads["pool_dir"] == f"/offloadpool/{name}"
    if partitions > 1:
        assert reads["owner"] == "0f6c1f5e-sglang-pod"
    # without the webhook's environment the plugin finds no pool and registers nothing
    assert plugin_reads({})["pool_dir"] is None
