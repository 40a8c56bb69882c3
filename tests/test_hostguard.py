"""What any pod may hold of the host root, as pure functions (operator/offloadpool/operator/
hostguard.py): hostPaths reaching /var/lib/offloadpool, however spelled, and offloadpool.io/*
resources, refused unless they are exactly what the labelled pool's mutation gives. The same
functions answer the real API server in tests/test_webhook_guard.py."""

from __future__ import annotations

from typing import Any

import pytest

from offloadpool.api.constants import HOST_ROOT
from offloadpool.operator import admission, hostguard
from offloadpool.operator.admission import InjectionSettings

SETTINGS = InjectionSettings()


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
    (why,) = hostguard.refusals(pod([host(path)]), HOST_ROOT, None)
    assert f"hostPath {path!r} reaches /var/lib/offloadpool" in why


@pytest.mark.parametrize(
    "path",
    ["/var/log", "/var/lib/offloadpool-other", "/var/lib/kubelet", "/etc/ssl/certs", "/dev/shm", "/run"],
)
def test_hostpaths_beside_the_root_are_not_this_guards_business(path: str) -> None:
    assert not hostguard.reaches(path, HOST_ROOT)
    assert hostguard.refusals(pod([host(path)]), HOST_ROOT, None) == []


def _pool(name: str = "kv", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"capacity": "1Gi", "medium": "MemoryTHP", **spec}}


def test_a_labelled_pod_may_hold_exactly_its_pools_volumes_and_resource() -> None:
    compat = _pool(compat={"vllm": {"engineId": "e"}}, segments={"maxFiles": 1})
    volumes = admission.volumes(compat, SETTINGS)
    assert len(volumes) == 2
    ok = pod(volumes, initContainers=[{"name": "s", "resources": {"limits": {"offloadpool.io/kv": "1"}}}])
    assert hostguard.refusals(ok, HOST_ROOT, "kv", volumes) == []
    # the same path spelled otherwise, another type, another pool's directory: refused
    for other in (
        host("/var/lib/offloadpool/kv/", name="offloadpool-kv", type="Directory"),
        host("/var/lib/offloadpool/kv", name="offloadpool-kv", type="DirectoryOrCreate"),
        host("/var/lib/offloadpool/kv2", name="offloadpool-kv2", type="Directory"),
        host("/", name="extra"),
    ):
        assert hostguard.refusals(pod([*volumes, other]), HOST_ROOT, "kv", volumes), other
    # unlabelled, the very same volumes are refused
    assert len(hostguard.refusals(pod(volumes), HOST_ROOT, None)) == 2


@pytest.mark.parametrize("kind", ["containers", "initContainers", "ephemeralContainers"])
@pytest.mark.parametrize("part", ["requests", "limits"])
def test_pool_resources_need_the_pools_label(kind: str, part: str) -> None:
    p = pod(**{kind: [{"name": "x", "resources": {part: {"offloadpool.io/kv": "1", "cpu": "1"}}}]})
    (why,) = hostguard.refusals(p, HOST_ROOT, None)
    assert why.startswith("resource offloadpool.io/kv: only a pod labelled offloadpool.io/pool: kv")
    assert hostguard.refusals(p, HOST_ROOT, "kv") == []
    assert hostguard.refusals(p, HOST_ROOT, "other")  # another pool's label does not do
    assert hostguard.pool_resources(pod(resources={"limits": {"offloadpool.io/kv": "1"}})) == {
        "offloadpool.io/kv"
    }
