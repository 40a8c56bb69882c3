"""What a pod labelled ``offloadpool.io/pool: <pool>`` gets at admission, and when it is refused.

Pure functions of plain dicts (the pod as the API server sends it, the pool as it reads from
the API): the kopf handlers in ``webhook`` only fetch the pool and hand over the result, and
the tests run these on their own output.

A labelled pod gets:

- the pool directory as a hostPath volume (``<host root>/<pool>``, type Directory) mounted
  read-only in every container at ``/offloadpool/<pool>`` with ``mountPropagation:
  HostToContainer``, so a mount the agent makes inside it after the pod started (a
  re-provisioned pool) is seen; the directory is on the host's disk, so no pod writes a byte
  there, while the pool's memory (``mnt/``, a mount of its own, which a read-only bind does not
  make read-only) stays writable;
- for a stock-vLLM compat pool, the region file mounted where vLLM looks for it
  (``/dev/shm/vllm_offload_<engineId>.mmap``) as a ``subPath`` mount of that volume
  (``mnt/<file>``): the kubelet resolves it beneath the pool directory without following a link
  out of it, so a consumer that replaces the name with a link to a host file gets nothing of the
  host; no hostPath ever names anything below ``<host root>/<pool>``;
- ``OFFLOADPOOL_POOL_DIR`` and the pool's name, medium, layout, ranks, capacity (and slot size
  or vLLM engine id when the pool has them) in every container's environment;
- required node affinity to ``pool.offloadpool.io/<pool> In [ready]``, added to every node
  selector term (terms are ORed, so the requirement must be in each);
- a native sidecar (first init container, ``restartPolicy: Always``) that holds the pool's
  shared lease for the pod's whole life (``offloadpool hold-lease``), with a startup probe on
  its ready file so the pod's containers start only once the lease is held; it carries the
  pod's 1 ``offloadpool.io/<pool>`` (request = limit), unless a container already asks for it.

A pool whose ``spec.consumers.delivery`` is CSI gives instead, with the same environment and
affinity:

- the pool directory as an inline ``csi`` volume of the node plugin (driver ``offloadpool.io``,
  ``volumeAttributes: {pool: <pool>}``) under the same name, mounted at the same path, and a
  compat pool's region files as ``subPath`` mounts of that volume (``mnt/<file>``); no hostPath,
  no propagation: the plugin's publication holds the pool, so nothing reshapes it under the pod;
- no sidecar: the published volume is the pod's hold (``region.holding.published``), from the kubelet's
  publish to its unpublish; the pod's 1 ``offloadpool.io/<pool>`` goes to its first container
  (request = limit), unless a container already asks for it.

A pool whose delivery is DRA gives only the pod's 1 ``offloadpool.io/<pool>`` in its first
container (request = limit, unless a container already asks for it): the scheduler satisfies it
with a device of the pool's DeviceClass (the operator renders it and advertises no node
resource for the pool), and the DRA kubelet plugin's CDI edits bring the pool's directory (or
the allocated share) and ``OFFLOADPOOL_POOL_DIR``, ``OFFLOADPOOL_POOL`` (``OFFLOADPOOL_SHARE``)
into that container. No volume, no environment, no affinity (only a node whose slice offers a
device gets the pod), no sidecar (the prepared claim holds the pool); a container's own mount
at ``/offloadpool/<pool>``, where the CDI edits mount, is refused.

Nothing of the CSI or DRA mutation needs a privilege, a capability or a host namespace, so the
mutated pod is admissible under Pod Security ``restricted`` whenever the user's own containers
are. A ``csi`` volume of the driver that a pod writes itself is refused by the guard
(``hostguard``): only the mutation's volume, which comes with the pool's resource, may take a
share; the node plugin still checks the pod's namespace against ``spec.consumers.namespaces``
at publish
(docs/webhook.md).

Idempotent by construction: everything is keyed by name and added only when absent (a volume,
a mount, the sidecar, an affinity expression) or set only when different (an env value).
Nothing present is rewritten, because the API server defaults fields of what the webhook added
(probe timeouts, termination message paths): a pod that already went through the webhook and
comes back through it — by reinvocation, or re-created from its own manifest — is unchanged.
That is also how the validating webhook tells a pod that bypassed mutation: ``mutate`` would
still change it. The validating webhook sees the pod after the API server's defaults, so what
is compared by content is written as the API server stores it (an env ``fieldRef``'s
``apiVersion: v1``), or compared less the defaults (the sidecar's); its refusal names each place
that differs with both values (``differences``, ``unmutated_refusal``).

What is keyed by a reserved name is checked by content, never trusted by name: a volume named
like the pool's (or its compat files') must be exactly the one the mutation writes, every mount
of it in any container exactly the mutation's mount, and an init container named like the lease
sidecar exactly the sidecar (less the fields the API server defaults); anything else is refused
(``Refused``), so a pod cannot bring its own ``offloadpool-<pool>`` as ``hostPath: /`` and keep it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonpatch

from offloadpool.api.constants import (
    HOST_ROOT,
    KUBELET_DIR,
    POOL_KIND,
    POOL_LABEL_READY,
    extended_resource_name,
    pool_label_key,
    pool_name_error,
)
from offloadpool.api.pods import (
    ADMISSION_DISABLED,
    ADMISSION_NAMESPACE_LABEL,
    CSI_DRIVER,
    CSI_POOL_ATTRIBUTE,
    ENV_CAPACITY_BYTES,
    ENV_LAYOUT,
    ENV_MEDIUM,
    ENV_POD_UID,
    ENV_POOL,
    ENV_POOL_DIR,
    ENV_RANKS,
    ENV_SLOT_BYTES,
    ENV_VLLM_ENGINE_ID,
    LEASE_READY_FILE,
    LEASE_SIDECAR_NAME,
    POD_POOL_LABEL,
    SYSTEM_NAMESPACES,
    compat_files,
    compat_volume_name,
    pod_pool_dir,
    pool_volume_name,
)
from offloadpool.api.spec import OffloadPoolSpec
from offloadpool.region.vocabulary import DELIVERY_CSI, DELIVERY_DRA

from . import hostguard

Pod = dict[str, Any]
Pool = Mapping[str, Any]


class Refused(Exception):
    """The pod may not be admitted; the message is what the user sees from ``kubectl``."""


@dataclass(frozen=True)
class InjectionSettings:
    """What the operator is told about the pods it mutates (from its flags)."""

    #: The agents' host root: the pool directory on the node is ``<host_root>/<pool>``.
    host_root: str = HOST_ROOT
    #: The image of the lease sidecar: the offloadpool image (``offloadpool hold-lease``).
    sidecar_image: str = "ghcr.io/offloadpool/offloadpool:latest"
    sidecar_image_pull_policy: str = "IfNotPresent"
    sidecar_cpu_request: str = "10m"
    #: Request and limit: a Python process holding one file descriptor.
    sidecar_memory: str = "64Mi"
    #: Namespaces never mutated, whatever their pods say (the operator adds its own namespace).
    excluded_namespaces: tuple[str, ...] = SYSTEM_NAMESPACES
    #: The kubelet's directory on the nodes (``OperatorConfig.kubelet_dir``): guarded as the host
    #: root is (``hostguard``).
    kubelet_dir: str = KUBELET_DIR

    def guarded(self) -> tuple[hostguard.Guarded, ...]:
        """The host trees no pod's hostPath may reach but the pool's own volume (``hostguard``)."""
        return hostguard.guarded(self.host_root, self.kubelet_dir)


# -- which pods, which pool --------------------------------------------------------------------
def requested_pool(pod: Mapping[str, Any]) -> str | None:
    """The pool a pod asks for with its label, or None when it carries no such label."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    value = labels.get(POD_POOL_LABEL)
    return None if value is None else str(value)


def in_scope(
    pod: Mapping[str, Any],
    namespace: str | None,
    settings: InjectionSettings,
    namespace_labels: Mapping[str, str] | None = None,
) -> bool:
    """Whether the mutation applies to this pod: labelled, not in an excluded namespace (the
    operator's own is one: its agent pods carry the pool label too). No label of the pod's own
    exempts it. The webhook configurations select exactly this on the API server's side; this is
    the same rule, restated for safety."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if POD_POOL_LABEL not in labels:
        return False
    if namespace in settings.excluded_namespaces:
        return False
    return (namespace_labels or {}).get(ADMISSION_NAMESPACE_LABEL) != ADMISSION_DISABLED


def refusal(pool_name: str, namespace: str | None, pool: Pool | None) -> str | None:
    """Why a pod in ``namespace`` asking for ``pool_name`` must be refused, or None."""
    label = f"{POD_POOL_LABEL}={pool_name!r}"
    error = pool_name_error(pool_name)
    if error:
        return f"pod label {label} cannot name an {POOL_KIND}: {error}"
    if pool is None:
        return (
            f"{POOL_KIND} {pool_name!r} does not exist (pod label {label}); "
            f"create the pool first, or fix the label (kubectl get offloadpools)"
        )
    if (pool.get("metadata") or {}).get("deletionTimestamp"):
        return f"{POOL_KIND} {pool_name!r} is being deleted; pods cannot start using it (pod label {label})"
    allowed = ((pool.get("spec") or {}).get("consumers") or {}).get("namespaces") or []
    if allowed and namespace not in allowed:
        return (
            f"namespace {namespace!r} may not use {POOL_KIND} {pool_name!r}: its "
            f"spec.consumers.namespaces allows only {', '.join(sorted(allowed))} (pod label {label})"
        )
    return None


# -- the mutation ------------------------------------------------------------------------------
def pool_env(pool: Pool) -> list[dict[str, Any]]:
    """The environment every container gets: where the pool is and what shape it has.

    A pool of several shares: the capacity is one share's (what an engine attaches), and the
    pod's uid names the engine, so every worker of the pod claims the same share."""
    name = pool["metadata"]["name"]
    spec = _spec(pool)
    env = {
        ENV_POOL: name,
        ENV_POOL_DIR: pod_pool_dir(name),
        ENV_MEDIUM: spec.medium,
        ENV_LAYOUT: spec.layout.type,
        ENV_RANKS: str(spec.layout.rank_count),
        ENV_CAPACITY_BYTES: str(spec.capacity_bytes() // spec.partitions),
    }
    slot = spec.slot_size_bytes()
    if slot is not None:
        env[ENV_SLOT_BYTES] = str(slot)
    if spec.compat is not None and spec.compat.vllm is not None:
        env[ENV_VLLM_ENGINE_ID] = spec.compat.vllm.engine_id
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items()]
    if spec.partitions > 1:
        # apiVersion written as the API server defaults it: what the webhook adds must be what
        # the API server stores, or the validating webhook finds the stored pod unmutated
        field_ref = {"apiVersion": "v1", "fieldPath": "metadata.uid"}
        out.append({"name": ENV_POD_UID, "valueFrom": {"fieldRef": field_ref}})
    return out


def csi_delivery(pool: Pool) -> bool:
    """Whether the pool is given to pods by the CSI node plugin (``spec.consumers.delivery``)."""
    return _spec(pool).consumers.delivery_mode == DELIVERY_CSI


def dra_delivery(pool: Pool) -> bool:
    """Whether the pool is given to pods by DRA through its extended resource
    (``spec.consumers.delivery``)."""
    return _spec(pool).consumers.delivery_mode == DELIVERY_DRA


def volumes(pool: Pool, settings: InjectionSettings) -> list[dict[str, Any]]:
    """The pool's one volume: for HostPath the pool directory as a hostPath volume (type
    Directory); for CSI an inline ``csi`` volume of the pool directory.

    A compat pool's region files are ``subPath`` mounts of that volume, never hostPath volumes
    of their own: ``<root>/<pool>`` is the only path the kubelet is handed, and its every
    component is root-owned and out of any pod's reach (a pod is given what is below it, never
    ``<root>``). What is below it (``mnt/`` and its files) a root consumer can write, so a name
    there must never become a host path that the kubelet ``stat``s and the runtime binds (both
    follow links): the kubelet resolves a subPath beneath the volume, refusing one that leads
    out of it, and binds what it opened.

    A DRA pool has none: what the guard allows a pod of it (``hostguard``) is no volume at all."""
    name = pool["metadata"]["name"]
    if dra_delivery(pool):
        return []
    if csi_delivery(pool):
        return [
            {
                "name": pool_volume_name(name),
                "csi": {"driver": CSI_DRIVER, "volumeAttributes": {CSI_POOL_ATTRIBUTE: name}},
            }
        ]
    root = settings.host_root.rstrip("/")
    return [{"name": pool_volume_name(name), "hostPath": {"path": f"{root}/{name}", "type": "Directory"}}]


def reserved_volume_names(pool: Pool) -> list[str]:
    """Volume names the webhook keeps for itself and no longer writes: an older release's
    hostPath volumes of a compat pool's region files (``offloadpool-<pool>-vllm[-<i>]``). A pod
    bringing one is refused: a hostPath of a name in the pool's mount is the hole ``volumes``
    closes."""
    name = pool["metadata"]["name"]
    return [_compat_volume(name, i) for i in range(len(_compat(pool)))]


def mounts(pool: Pool) -> list[dict[str, Any]]:
    """The mounts every container gets: the pool directory (for HostPath following the host,
    HostToContainer, so a re-provisioned pool's new mount is seen), and a compat pool's files
    as ``subPath`` mounts of it (``mnt/<file>``), for both deliveries."""
    name = pool["metadata"]["name"]
    volume = pool_volume_name(name)
    whole: dict[str, Any] = {"name": volume, "mountPath": pod_pool_dir(name)}
    if not csi_delivery(pool):
        whole["mountPropagation"] = "HostToContainer"
        # the directory is on the host's disk: read-only, so nothing a pod writes lands there;
        # the pool's memory, a mount of its own below it, stays writable (read-only is not
        # recursive unless recursiveReadOnly asks for it)
        whole["readOnly"] = True
    return [whole] + [{"name": volume, "mountPath": in_pod, "subPath": rel} for rel, in_pod in _compat(pool)]


def sidecar(pool: Pool, settings: InjectionSettings, with_resource: bool) -> dict[str, Any]:
    """The native sidecar holding the pool's shared lease for the pod's whole life."""
    name = pool["metadata"]["name"]
    consumers = _spec(pool).consumers
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory},
        "limits": {"memory": settings.sidecar_memory},
    }
    if with_resource:
        for part in resources.values():
            part[extended_resource_name(name)] = "1"
    return {
        "name": LEASE_SIDECAR_NAME,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.sidecar_image_pull_policy,
        "command": ["offloadpool", "hold-lease", pod_pool_dir(name), "--ready-file", LEASE_READY_FILE],
        "restartPolicy": "Always",
        "volumeMounts": [mounts(pool)[0]],
        "resources": resources,
        "startupProbe": {
            "exec": {"command": ["test", "-e", LEASE_READY_FILE]},
            # Waits as long as the agent holds the lease exclusively (provisioning, applying a change).
            "periodSeconds": 1,
            "failureThreshold": 600,
        },
        "securityContext": {
            # The lease file belongs to the pool's consumers uid/gid (spec.consumers).
            "runAsUser": consumers.uid,
            "runAsGroup": consumers.gid,
            "runAsNonRoot": consumers.uid != 0,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def mutate(pod: Mapping[str, Any], pool: Pool, settings: InjectionSettings) -> Pod:
    """The pod with the pool injected (a new dict; ``pod`` is not changed). Raises Refused when
    a container already uses the pool's mount path for something else."""
    name = pool["metadata"]["name"]
    new: Pod = copy.deepcopy(dict(pod))
    spec = new.setdefault("spec", {})
    if dra_delivery(pool):
        _mutate_dra(spec, name)
        return new

    vols = spec.setdefault("volumes", [])
    for reserved in reserved_volume_names(pool):
        if any(v.get("name") == reserved for v in vols):
            raise Refused(
                f"volume {reserved!r} is reserved: the webhook mounts a compat pool's region files "
                f"as subPath mounts of volume {pool_volume_name(name)!r}, never as hostPath volumes "
                f"of their own; remove it and let the {POD_POOL_LABEL} label provide the files"
            )
    for volume in volumes(pool, settings):
        _add_exact(vols, volume)

    env = pool_env(pool)
    wanted = mounts(pool)
    for container in spec.get("containers") or []:
        _add_mounts(container, wanted)
        _set_env(container, env)
    for kind in ("initContainers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            _check_mounts(container, wanted)

    _require_ready_node(spec, pool_label_key(name))

    resource = extended_resource_name(name)
    if csi_delivery(pool):
        _ask_in_first_container(spec, resource)
        return new

    inits = spec.setdefault("initContainers", [])
    others = [c for c in (spec.get("containers") or []) + inits if c.get("name") != LEASE_SIDECAR_NAME]
    asked = any(resource in ((c.get("resources") or {}).get("limits") or {}) for c in others)
    expected = sidecar(pool, settings, with_resource=not asked)
    present = [c for c in inits if c.get("name") == LEASE_SIDECAR_NAME]
    if not present:
        inits.insert(0, expected)
    elif _undefaulted(present[0]) != expected:
        raise Refused(
            f"init container {LEASE_SIDECAR_NAME!r} is reserved for the lease sidecar the webhook "
            f"adds, and this one is not it; remove it and let the {POD_POOL_LABEL} label provide it"
        )
    return new


def json_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """RFC 6902 operations that turn ``old`` into ``new`` (what an admission response carries)."""
    return jsonpatch.JsonPatch.from_diff(dict(old), dict(new)).patch


@dataclass(frozen=True)
class Difference:
    """One place where a pod differs from what the mutation writes: the JSON pointer, and the
    value there in the pod and in the mutation (``ABSENT`` where there is none)."""

    path: str
    present: Any
    wanted: Any

    def __str__(self) -> str:
        return f"{self.path}: the pod has {_shown(self.present)}, the webhook writes {_shown(self.wanted)}"


class _Absent:
    def __repr__(self) -> str:
        return "nothing"


#: No value at that path.
ABSENT: Any = _Absent()


def differences(pod: Mapping[str, Any], pool: Pool, settings: InjectionSettings) -> list[Difference]:
    """Where ``pod`` differs from what the mutation writes: empty when the pod is fully mutated."""
    new = mutate(pod, pool, settings)
    return [Difference(op["path"], _at(pod, op["path"]), _at(new, op["path"])) for op in json_patch(pod, new)]


#: Differences (with their values) and missing paths a refusal names one by one (the rest are counted).
DIFFERENCES_NAMED = 4
PATHS_NAMED = 6


def unmutated_refusal(pool_name: str, found: Sequence[Difference], configuration: str) -> str:
    """What the validating webhook says of a labelled pod that differs from its mutation: each
    place, with both values. Where the pod only lacks what the mutation adds, the mutating
    webhook did not reach it; where a value differs, something changed it after the mutation
    (another webhook, the API server's defaulting of a field the mutation left out)."""
    asks = f"pod asks for {POOL_KIND} {pool_name!r} ({POD_POOL_LABEL})"
    if all(d.present is ABSENT for d in found):
        return (
            f"{asks} but lacks what the offloadpool mutating webhook adds "
            f"({_listed([d.path for d in found], PATHS_NAMED, ', ')}); "
            f"is the MutatingWebhookConfiguration {configuration!r} in place?"
        )
    return (
        f"{asks} but differs from what the offloadpool mutating webhook writes "
        f"({_listed([str(d) for d in found], DIFFERENCES_NAMED, '; ')}); something changed the pod "
        "after the mutation (another mutating webhook, or the API server's defaults)"
    )


def _listed(items: Sequence[str], named: int, sep: str) -> str:
    more = len(items) - named
    return sep.join(items[:named]) + (f"{sep}and {more} more" if more > 0 else "")


def not_mutated(pod: Mapping[str, Any], pool: Pool, settings: InjectionSettings) -> list[str]:
    """The paths where the mutation would still change ``pod``: empty when it is fully mutated."""
    return [d.path for d in differences(pod, pool, settings)]


def _at(doc: Any, pointer: str) -> Any:
    """The value at a JSON pointer (RFC 6901), or ``ABSENT``."""
    for token in pointer.split("/")[1:]:
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, Mapping) and key in doc:
            doc = doc[key]
        elif isinstance(doc, list) and key.isdigit() and int(key) < len(doc):
            doc = doc[int(key)]
        else:
            return ABSENT
    return doc


#: Longest rendering of one value in a refusal.
_SHOWN_LENGTH = 160


def _shown(value: Any) -> str:
    if value is ABSENT:
        return "nothing"
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= _SHOWN_LENGTH else text[: _SHOWN_LENGTH - 3] + "..."


# -- helpers -----------------------------------------------------------------------------------
def _spec(pool: Pool) -> OffloadPoolSpec:
    return OffloadPoolSpec.model_validate(pool.get("spec") or {})


def _mutate_dra(spec: dict[str, Any], pool: str) -> None:
    """A DRA pool's pod: the pool's resource in its first container, nothing else. A container
    mounting something at ``/offloadpool/<pool>`` is refused: the plugin's CDI edits mount the
    pool there in the container that asks for the resource."""
    where = pod_pool_dir(pool)
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for container in spec.get(kind) or []:
            for mount in container.get("volumeMounts") or []:
                if str(mount.get("mountPath", "")).rstrip("/") == where:
                    raise Refused(
                        f"container {container.get('name')!r} mounts volume {mount.get('name')!r} at "
                        f"{where}, where the DRA plugin mounts the pool; remove that mount and let "
                        f"the {POD_POOL_LABEL} label provide the pool"
                    )
    _ask_in_first_container(spec, extended_resource_name(pool))


def _ask_in_first_container(spec: dict[str, Any], resource: str) -> None:
    """The pod's 1 ``resource`` (request = limit) in its first container, unless a container or
    init container already asks for it: a CSI or DRA pod has no sidecar to carry it."""
    kinds = ("containers", "initContainers")
    everyone = [c for kind in kinds for c in spec.get(kind) or []]
    if any(resource in ((c.get("resources") or {}).get("limits") or {}) for c in everyone):
        return
    containers = spec.get("containers") or []
    if not containers:
        return  # the API server refuses a pod without containers anyway
    resources = containers[0].setdefault("resources", {})
    for part in ("requests", "limits"):
        resources.setdefault(part, {})[resource] = "1"


def _compat(pool: Pool) -> list[tuple[str, str]]:
    spec = _spec(pool)
    if spec.compat is None or spec.compat.vllm is None:
        return []
    return compat_files(spec.compat.vllm.engine_id, spec.vllm_compat_file_count())


def _compat_volume(pool: str, index: int) -> str:
    return compat_volume_name(pool) + (f"-{index}" if index else "")


#: What the API server fills into a container and its probe when the pod omits it.
_CONTAINER_DEFAULTS = {"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}
_PROBE_DEFAULTS = {"timeoutSeconds": 1, "successThreshold": 1}


def _undefaulted(container: Mapping[str, Any]) -> dict[str, Any]:
    """``container`` less what the API server adds (to compare with what we wrote): defaults,
    and the ServiceAccount admission plugin's token mount. That plugin runs again after the
    webhook has added the sidecar (the API server re-runs its own mutating plugins once a
    webhook changed the pod) and mounts the pod's token into every container, the sidecar too;
    the webhook is then called again (reinvocationPolicy IfNeeded) and must know its sidecar."""
    out = {k: v for k, v in container.items() if _CONTAINER_DEFAULTS.get(k, object()) != v}
    probe = out.get("startupProbe")
    if isinstance(probe, Mapping):
        out["startupProbe"] = {k: v for k, v in probe.items() if _PROBE_DEFAULTS.get(k, object()) != v}
    if isinstance(out.get("volumeMounts"), list):
        out["volumeMounts"] = [m for m in out["volumeMounts"] if not _service_account_token_mount(m)]
    return out


#: Where the ServiceAccount admission plugin mounts the pod's token (a projected volume it
#: names kube-api-access-<random>), read-only.
_TOKEN_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def _service_account_token_mount(mount: Any) -> bool:
    """Exactly the mount the ServiceAccount admission plugin adds to each container."""
    return (
        isinstance(mount, Mapping)
        and set(mount) == {"name", "mountPath", "readOnly"}
        and str(mount["name"]).startswith("kube-api-access-")
        and mount["mountPath"] == _TOKEN_MOUNT_PATH
        and mount["readOnly"] is True
    )


def _add_exact(items: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """Add ``item`` unless present; one of the same name must be exactly it."""
    same = [i for i in items if i.get("name") == item["name"]]
    if not same:
        items.append(item)
    elif any(i != item for i in same):
        raise Refused(
            f"volume {item['name']!r} is reserved for the pool's directory, and this pod "
            f"brings its own ({_describe(same[0])}); remove it and let the {POD_POOL_LABEL} label "
            f"provide it"
        )


def _describe(volume: Mapping[str, Any]) -> str:
    kinds = [k for k in volume if k != "name"]
    host = volume.get("hostPath")
    if isinstance(host, Mapping):
        return f"hostPath {host.get('path')!r}, type {host.get('type')!r}"
    csi = volume.get("csi")
    if isinstance(csi, Mapping):
        return f"csi driver {csi.get('driver')!r}, volumeAttributes {csi.get('volumeAttributes')!r}"
    return ", ".join(kinds) or "no source"


def _check_mounts(container: Mapping[str, Any], wanted: Sequence[dict[str, Any]]) -> None:
    """Every mount of a reserved volume is exactly one of the mutation's (path, propagation,
    readOnly, subPath: a CSI volume is mounted once whole and once per compat file)."""
    reserved = {mount["name"]: mount for mount in wanted}
    for m in container.get("volumeMounts") or []:
        mount = reserved.get(m.get("name"))
        if mount is not None and m not in wanted:
            raise Refused(
                f"container {container.get('name')!r} mounts volume {mount['name']!r} "
                f"differently from the webhook ({m}); remove that mount and let the "
                f"{POD_POOL_LABEL} label provide it"
            )


def _add_mounts(container: dict[str, Any], wanted: Sequence[dict[str, Any]]) -> None:
    _check_mounts(container, wanted)
    present = container.setdefault("volumeMounts", [])
    for mount in wanted:
        if mount in present:
            continue
        clash = [m for m in present if m.get("mountPath") == mount["mountPath"]]
        if clash:
            raise Refused(
                f"container {container.get('name')!r} already mounts volume {clash[0].get('name')!r} at "
                f"{mount['mountPath']}, where the webhook mounts the pool; remove that mount and let "
                f"the {POD_POOL_LABEL} label provide it"
            )
        present.append(dict(mount))


def _set_env(container: dict[str, Any], wanted: list[dict[str, Any]]) -> None:
    env = container.setdefault("env", [])
    for var in wanted:
        for i, present in enumerate(env):
            if present.get("name") == var["name"]:
                if present != var:
                    env[i] = dict(var)
                break
        else:
            env.append(dict(var))


def _require_ready_node(spec: dict[str, Any], label: str) -> None:
    expression = {"key": label, "operator": "In", "values": [POOL_LABEL_READY]}
    required = (
        spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        expressions = term.setdefault("matchExpressions", [])
        if expression not in expressions:
            expressions.append(dict(expression, values=list(expression["values"])))
