"""What any pod may hold of the host root, as pure functions (operator/offloadpool/operator/
hostguard.py): hostPaths reaching /var/lib/offloadpool, however spelled, and offloadpool.io/*
resources, refused unless they are exactly what the labelled pool's mutation gives. The same
functions answer the real API server in tests/test_webhook_guard.py."""

from __future__ import annotations

from typing import Any

import pytest

from offloadpool.api.constants import HOST_ROOT, KUBELET_DIR
from offloadpool.operator import admission, hostguard
from offloadpool.operator.admission import InjectionSettings

SETTINGS = InjectionSettings()
TREES = hostguard.guarded(HOST_ROOT, KUBELET_DIR)


def pod(volumes: list[dict[str, Any]] = (), **spec: Any) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c"}], "volumes": list(volumes), **spec},
    }


def host(path: str, name: str = "v", **extra: Any) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, **extra}}


@pytest.mark.parametrize(
    ("path", "normal"),
    [
        ("/var/lib/offloadpool", "/var/lib/offloadpool"),
        ("//var//lib/offloadpool/", "/var/lib/offloadpool"),
        ("/var/./lib/./offloadpool/kv/.", "/var/lib/offloadpool/kv"),
        ("/var/lib/../lib/offloadpool", "/var/lib/offloadpool"),
        ("/../../var/lib/offloadpool", "/var/lib/offloadpool"),
        ("/", "/"),
        ("var/lib/offloadpool", None),
    ],
)
def test_paths_are_normalised_as_the_kernel_resolves_them(path: str, normal: str | None) -> None:
    assert hostguard.normalise(path) == normal


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "//",
        "/var",
        "/var/",
        "/var/lib",
        "/var/lib/offloadpool",
        "/var/lib/offloadpool/kv",
        "/var/lib/offloadpool/kv/mnt/r0-s000",
        "/var/lib/offloadpool/.state",
        "/var/lib/../lib/offloadpool",
        "//var/lib/offloadpool/kv/",
        "/var/./lib/offloadpool",
        "/etc/../var/lib",
        "/proc",
        "/proc/1/root",
        "/proc/self/root/var/lib/offloadpool",
        "relative/path",
    ],
)
def test_hostpaths_that_reach_the_root_are_refused_without_the_label(path: str) -> None:
    assert hostguard.reaches(path, HOST_ROOT)
    (why,) = hostguard.refusals(pod([host(path)]), TREES, None)
    assert f"hostPath {path!r} reaches /var/lib/offloadpool" in why


@pytest.mark.parametrize(
    "path",
    [
        "/var/log",
        "/var/lib/offloadpool-other",
        "/var/lib/kubelet-other",
        "/etc/ssl/certs",
        "/dev/shm",
        "/run",
    ],
)
def test_hostpaths_beside_the_root_are_not_this_guards_business(path: str) -> None:
    assert not hostguard.reaches(path, HOST_ROOT) and not hostguard.reaches(path, KUBELET_DIR)
    assert hostguard.refusals(pod([host(path)]), TREES, None) == []


@pytest.mark.parametrize(
    "path",
    [
        "/var/lib/kubelet",
        "/var/lib/kubelet/",
        "/var/lib/kubelet/pods",
        "/var/lib/kubelet/pods/0a1b/volumes/kubernetes.io~csi/pool/mount",
        "/var/lib/kubelet/plugins",
        "/var/lib/kubelet/plugins/offloadpool.io",
        "/var/lib/kubelet/plugins/offloadpool.io/csi.sock",
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/pod-resources",
        "/var/lib/kubelet/pki",
        "//var/lib/kubelet//pods/",
        "/var/lib/./kubelet/plugins",
        "/var/lib/kubelet/pods/..",
        "/var/log/../lib/kubelet",
    ],
)
def test_hostpaths_into_the_kubelets_tree_are_refused_labelled_or_not(path: str) -> None:
    """``pods/`` holds every CSI-published pool's memory, ``plugins/offloadpool.io/`` the socket
    that publishes any pool (issue 36): the kubelet's tree is guarded as the host root is."""
    assert hostguard.reaches(path, KUBELET_DIR)
    (why,) = hostguard.refusals(pod([host(path)]), TREES, None)
    assert f"hostPath {path!r} reaches /var/lib/kubelet, the kubelet's directory" in why
    volumes = admission.volumes(_pool(), SETTINGS)
    (why,) = hostguard.refusals(pod([*volumes, host(path)]), TREES, "kv", volumes)
    assert "reaches /var/lib/kubelet" in why
    # a kubelet with another --root-dir: that one is guarded
    other = hostguard.guarded(HOST_ROOT, "/data/kubelet")
    moved = str(hostguard.normalise(path)).replace("/var/lib/kubelet", "/data/kubelet")
    assert hostguard.refusals(pod([host(moved)]), other, None), moved
    assert hostguard.refusals(pod([host(path)]), other, None) == []  # the default is not it then


def _pool(name: str = "kv", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"capacity": "1Gi", "medium": "MemoryTHP", **spec}}


def test_a_labelled_pod_may_hold_exactly_its_pools_volumes_and_resource() -> None:
    compat = _pool(compat={"vllm": {"engineId": "e"}}, segments={"maxFiles": 1})
    volumes = admission.volumes(compat, SETTINGS)
    assert len(volumes) == 1  # the region file is a subPath of the pool's directory
    ok = pod(volumes, initContainers=[{"name": "s", "resources": {"limits": {"offloadpool.io/kv": "1"}}}])
    assert hostguard.refusals(ok, TREES, "kv", volumes) == []
    # the same path spelled otherwise, another type, another pool's directory: refused
    for other in (
        host("/var/lib/offloadpool/kv/", name="offloadpool-kv", type="Directory"),
        host("/var/lib/offloadpool/kv", name="offloadpool-kv", type="DirectoryOrCreate"),
        host("/var/lib/offloadpool/kv2", name="offloadpool-kv2", type="Directory"),
        host("/", name="extra"),
    ):
        assert hostguard.refusals(pod([*volumes, other]), TREES, "kv", volumes), other
    # unlabelled, the very same volumes are refused
    assert len(hostguard.refusals(pod(volumes), TREES, None)) == 1
    # an older release's hostPath of the region file (a name in the pool's mount): refused
    old = host("/var/lib/offloadpool/kv/mnt/vllm_offload_e.mmap", name="offloadpool-kv-vllm", type="File")
    assert hostguard.refusals(pod([*volumes, old]), TREES, "kv", volumes)


@pytest.mark.parametrize("kind", ["containers", "initContainers", "ephemeralContainers"])
@pytest.mark.parametrize("part", ["requests", "limits"])
def test_pool_resources_need_the_pools_label(kind: str, part: str) -> None:
    p = pod(**{kind: [{"name": "x", "resources": {part: {"offloadpool.io/kv": "1", "cpu": "1"}}}]})
    (why,) = hostguard.refusals(p, TREES, None)
    assert why.startswith("resource offloadpool.io/kv: only a pod labelled offloadpool.io/pool: kv")
    assert hostguard.refusals(p, TREES, "kv") == []
    assert hostguard.refusals(p, TREES, "other")  # another pool's label does not do
    assert hostguard.pool_resources(pod(resources={"limits": {"offloadpool.io/kv": "1"}})) == {
        "offloadpool.io/kv"
    }
