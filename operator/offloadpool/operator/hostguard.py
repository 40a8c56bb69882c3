"""What any pod may hold of the node's pools, whatever its labels: hostPath volumes that reach
the host root or the kubelet's tree, and ``offloadpool.io/*`` extended resources.

A pod spec reaches a pool's memory three ways: a hostPath volume whose path reaches a guarded
tree (``guarded``: the root itself, anything under it, anything that contains it such as ``/``,
``/var`` or ``/var/lib``), a hostPath under ``/proc``, through which every process's root
directory is visible, and a pool's extended resource, which takes the node's one slot of the
pool. The guarded trees are the host root (``/var/lib/offloadpool``: every pool) and the
kubelet's directory (``/var/lib/kubelet`` or the ``--kubelet-dir`` given: ``pods/`` holds every
CSI-published pool's memory, ``plugins/offloadpool.io/`` the CSI plugin's socket, through which
any pool could be published, ``plugins_registry/`` and ``pod-resources/`` the kubelet's own
sockets). The mutating webhook gives a pod labelled ``offloadpool.io/pool: <pool>`` exactly the
pool's volumes and its resource; everything else is refused here, labelled or not. Paths are compared after
normalisation (``//``, ``/./``, ``..``, a trailing ``/``); a relative path cannot be reasoned
about and is refused when it could reach anything. A symlink on the node (a hostPath through a
link into the root) is beyond what admission can see: keep hostPath volumes in consumer
namespaces to what you trust (docs/webhook.md).

Pure functions of the pod as the API server sends it; the validating webhook's handler
(``admission_handlers``) calls them for every pod the webhook configuration sends it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offloadpool.api.constants import GROUP, extended_resource_name
from offloadpool.api.pods import CSI_DRIVER, POD_POOL_LABEL

#: Every extended resource a pool advertises is ``offloadpool.io/<pool>``.
RESOURCE_PREFIX = f"{GROUP}/"
#: ``/proc/<pid>/root`` is every process's root directory, the host's too under hostPID.
PROC = "/proc"
#: The pod's containers of every kind (ephemeral ones cannot be created with the pod, nor carry
#: resources, but are checked all the same).
CONTAINER_KINDS = ("containers", "initContainers", "ephemeralContainers")


@dataclass(frozen=True)
class Guarded:
    """A host tree no pod's hostPath may reach, and why (said in the refusal)."""

    path: str
    why: str


def guarded(host_root: str, kubelet_dir: str) -> tuple[Guarded, ...]:
    """The trees the guard keeps pods out of: the host root first (a labelled pod's own pool
    volume is the one exception), then the kubelet's directory."""
    return (
        Guarded(host_root, "where the offloadpool agents keep every pool's memory"),
        Guarded(
            kubelet_dir,
            "the kubelet's directory: every pod's volumes (CSI-published pools among them), the "
            "plugins' sockets (offloadpool.io's CSI socket among them), their registry and the "
            "pod-resources socket",
        ),
    )


def normalise(path: str) -> str | None:
    """``path`` as the kernel resolves it without symlinks (``/a//b/./c/../`` is ``/a/b``); None
    for a relative path. ``..`` above ``/`` stays at ``/``, as it does in the kernel."""
    if not path.startswith("/"):
        return None
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def reaches(path: str, root: str) -> bool:
    """Whether a hostPath of ``path`` gives a pod anything of ``root``: it is the root, lies under
    it, contains it, or is ``/proc`` or under it. A relative path: True (refused)."""
    target = normalise(path)
    base = normalise(root)
    if target is None or base is None:
        return True
    if target == PROC or target.startswith(PROC + "/"):
        return True
    inside = target == base or target.startswith(base.rstrip("/") + "/")
    contains = base.startswith(target.rstrip("/") + "/")
    return inside or contains


def host_volumes(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod's hostPath volumes, as written."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if volume.get("hostPath") is not None:
            yield volume


def pool_csi_volumes(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The pod's inline ``csi`` volumes of the node plugin (driver ``offloadpool.io``), as written."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        csi = volume.get("csi")
        if isinstance(csi, Mapping) and csi.get("driver") == CSI_DRIVER:
            yield volume


def pool_resources(pod: Mapping[str, Any]) -> set[str]:
    """Every ``offloadpool.io/*`` resource the pod requests or limits, in any container or at the
    pod level."""
    spec = pod.get("spec") or {}
    holders = [c.get("resources") or {} for kind in CONTAINER_KINDS for c in spec.get(kind) or []]
    holders.append(spec.get("resources") or {})
    return {
        name
        for resources in holders
        for part in ("requests", "limits")
        for name in (resources.get(part) or {})
        if str(name).startswith(RESOURCE_PREFIX)
    }


def refusals(
    pod: Mapping[str, Any],
    trees: Sequence[Guarded],
    pool: str | None,
    pool_volumes: Sequence[Mapping[str, Any]] = (),
    dra_resources: Collection[str] = (),
) -> list[str]:
    """Why the pod may not hold what it holds of the guarded trees; empty when it may.

    ``trees``: ``guarded(...)``; ``pool``: the pool the pod's label names and that it may use
    (None: no label, or a pool it may not have); ``pool_volumes``: that pool's volumes exactly as
    the mutation writes them, the only hostPath volumes reaching a guarded tree and the only
    ``offloadpool.io`` csi volumes the pod may carry. A csi volume of the driver takes a share
    at publish: written by hand it would carry no ``offloadpool.io/<pool>`` request, so the
    scheduler would count no slot for it and a labelled pod placed by that count would fail
    its publish (``RESOURCE_EXHAUSTED``); only the mutation's volume comes with the request
    (the validating webhook checks the mutation is all there). ``dra_resources``: extended
    resources of DRA pools that allow the pod's namespace, which any pod may request by hand:
    the scheduler satisfies them with a device of the pool's DeviceClass, and the DRA plugin
    checks the claim's namespace again at prepare; nothing of the host comes with them."""
    why = []
    for volume in host_volumes(pod):
        path = str((volume.get("hostPath") or {}).get("path", ""))
        if any(volume == wanted for wanted in pool_volumes):
            continue
        tree = next((t for t in trees if reaches(path, t.path)), None)
        if tree is None:
            continue
        if pool is None:
            why.append(
                f"volume {volume.get('name')!r}: hostPath {path!r} reaches {tree.path}, {tree.why}; "
                f"a pod gets a pool's directory only from the webhook, by the label "
                f"{POD_POOL_LABEL}: <pool>"
            )
        else:
            why.append(
                f"volume {volume.get('name')!r}: hostPath {path!r} reaches {tree.path}, {tree.why}; "
                f"a pod labelled {POD_POOL_LABEL}: {pool} may hold only its pool's volumes, exactly "
                f"as the webhook writes them"
            )
    for volume in pool_csi_volumes(pod):
        if any(volume == wanted for wanted in pool_volumes):
            continue
        attrs = (volume.get("csi") or {}).get("volumeAttributes") or {}
        what = (
            f"volume {volume.get('name')!r}: an inline csi volume of driver {CSI_DRIVER} "
            f"(pool {attrs.get('pool')!r})"
        )
        if pool is None:
            why.append(
                f"{what} is a share of a pool's memory, taken at publish whatever the scheduler "
                f"counted; a pod gets one only from the webhook, by the label {POD_POOL_LABEL}: "
                f"<pool>, which also requests the pool's resource {RESOURCE_PREFIX}<pool>"
            )
        else:
            why.append(
                f"{what} is not the volume the webhook writes for {POD_POOL_LABEL}: {pool} (a pool "
                f"delivered by CSI gets exactly one, of its own pool, with its resource "
                f"{extended_resource_name(pool)})"
            )
    allowed = extended_resource_name(pool) if pool is not None else None
    for name in sorted(pool_resources(pod) - {allowed} - set(dra_resources)):
        why.append(
            f"resource {name}: only a pod labelled {POD_POOL_LABEL}: {name[len(RESOURCE_PREFIX) :]} "
            f"may request it (the webhook gives such a pod its pool and the resource)"
        )
    return why
