"""What a publish or unpublish request asks for, every field checked before anything is touched.

validate-first: ``publish_request`` and ``unpublish_request`` turn the kubelet's request into
plain values or raise ``Refused`` (InvalidArgument) naming the field; nothing is opened,
created or mounted for a request that fails here. Everything in a volume's attributes is
written by whoever wrote the pod (past the webhook, too), so it is hostile input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from offloadpool.api.pods import CSI_POOL_ATTRIBUTE
from offloadpool.csi import target as targets
from offloadpool.csi.refusal import invalid
from offloadpool.region.files.names import pool_name_error
from offloadpool.region.holding.published import volume_id_error

#: the volume attribute naming the pool (``volumeAttributes: {pool: kv}``)
POOL_ATTRIBUTE = CSI_POOL_ATTRIBUTE
#: what the kubelet adds to the context of an inline ephemeral volume (``podInfoOnMount``)
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
POD_NAME = "csi.storage.k8s.io/pod.name"
#: a pod's name: a DNS subdomain (it is printed in every message naming the holder)
POD_NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class Publish:
    volume_id: str
    pool: str
    pod_namespace: str
    pod_uid: str
    target: targets.Target
    pod_name: str = ""


@dataclass(frozen=True)
class Unpublish:
    volume_id: str
    target: targets.Target


def _volume_id(value: str) -> str:
    error = volume_id_error(value)
    if error:
        raise invalid(error)
    return value


def _target(kubelet_dir: str, value: str) -> targets.Target:
    try:
        return targets.parse(kubelet_dir, value)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def publish_request(req: Any, kubelet_dir: str) -> Publish:
    """The checked fields of a ``NodePublishVolumeRequest``."""
    volume_id = _volume_id(req.volume_id)
    if not req.HasField("volume_capability"):
        raise invalid("volume_capability is required")
    cap = req.volume_capability
    if cap.WhichOneof("access_type") != "mount":
        raise invalid("volume_capability must be a mount (a pool is a directory, not a block device)")
    if cap.mount.mount_flags or cap.mount.fs_type:
        raise invalid("volume_capability.mount takes no fs_type or mount_flags (the pool's own are used)")
    if req.readonly:
        raise invalid("readonly: an engine writes its pool's memory; a read-only pool is not offered")
    ctx = dict(req.volume_context)
    if ctx.get(EPHEMERAL) != "true":
        raise invalid(f"volume_context[{EPHEMERAL!r}] must be 'true': only inline ephemeral volumes")
    pool = ctx.get(POOL_ATTRIBUTE)
    error = pool_name_error(pool, f"volume_context[{POOL_ATTRIBUTE!r}]")
    if error:
        raise invalid(error)
    namespace = ctx.get(POD_NAMESPACE, "")
    if not targets.DNS_LABEL_PATTERN.fullmatch(namespace):
        raise invalid(f"volume_context[{POD_NAMESPACE!r}] {namespace!r} is not a namespace name")
    pod_uid = ctx.get(POD_UID, "")
    if not targets.POD_UID_PATTERN.fullmatch(pod_uid):
        raise invalid(f"volume_context[{POD_UID!r}] {pod_uid!r} is not a pod uid")
    pod_name = ctx.get(POD_NAME, "")
    if pod_name and not POD_NAME_PATTERN.fullmatch(pod_name):
        raise invalid(f"volume_context[{POD_NAME!r}] {pod_name!r} is not a pod name")
    target = _target(kubelet_dir, req.target_path)
    if target.pod_uid != pod_uid:
        raise invalid(f"target_path {req.target_path!r} is not in the directory of pod {pod_uid}")
    assert isinstance(pool, str)
    return Publish(volume_id, pool, namespace, pod_uid, target, pod_name)


def unpublish_request(req: Any, kubelet_dir: str) -> Unpublish:
    """The checked fields of a ``NodeUnpublishVolumeRequest``."""
    return Unpublish(_volume_id(req.volume_id), _target(kubelet_dir, req.target_path))
