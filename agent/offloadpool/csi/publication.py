"""Publish and unpublish: the access check, the hold (``region.published``) and the bind mount.

Order, so that a plugin killed at any point leaves nothing the next call cannot settle:
publish zeroes the memory for a new holder when the pool's scrub policy says so
(``scrub.before_new_holder``: a kill there leaves the scrub pending, the pool not Ready), then
writes the holder's record, then mounts (a record without its whole tree is unmounted and
dropped by ``rebuild``, or its tree redone by the kubelet's retry; a mount is never without
its record); unpublish unmounts before it drops the record. Both run under the pool's lock
(``places.lock``), which a release or a reshape also takes: a pool cannot be released between
the publish's check that it is Ready and its record.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import grpc

from offloadpool.csi import bind, faults
from offloadpool.csi import target as targets
from offloadpool.csi.config import CsiConfig
from offloadpool.csi.refusal import Refused
from offloadpool.csi.volume import Publish, Unpublish
from offloadpool.region import beneath, places, published, scrub, vllm_compat
from offloadpool.region import record as records
from offloadpool.region.errors import RegionError
from offloadpool.region.manifest import MOUNT_NAME
from offloadpool.region.planner import plan as make_plan
from offloadpool.region.status import pool_state
from offloadpool.region.vocabulary import READY

#: one publish or unpublish at a time in this process (the kubelet retries concurrently)
_serial = threading.Lock()


def _ready(root: str, pool: str) -> None:
    state = pool_state(root, pool)
    if state.phase != READY:
        why = f": {state.message}" if state.message else ""
        message = f"pool {pool} is not Ready on this node ({state.phase}{why})"
        raise Refused(grpc.StatusCode.NOT_FOUND, message)


def allowed_namespaces(pool_dir: os.PathLike[str] | str) -> frozenset[str] | None:
    """The namespaces the node recorded for the pool (``spec.consumers.namespaces`` as the
    agent's last provision wrote it into the record's request); None: every namespace."""
    rec = records.load(pool_dir)
    if rec is None:
        return frozenset()
    names = rec.request.get("consumer_namespaces")
    return None if names is None else frozenset(str(names).split(","))


def engine_files(pool_dir: os.PathLike[str] | str) -> list[str]:
    """The names in the pool's mount an engine opens: each segment of the recorded plan, and
    stock vLLM's name of each for a compat pool (the node's record, not the directory's
    listing, says which)."""
    rec = records.load(pool_dir)
    if rec is None:
        raise RegionError(f"{pool_dir} has no provisioning record")
    req = rec.pool_request()
    segments = make_plan(req).segments
    names = [seg.file.removeprefix(f"{MOUNT_NAME}/") for seg in segments]
    if req.compat_engine_id:
        names += vllm_compat.file_names(req.compat_engine_id, len(segments))
    return names


def _record_of(req: Publish) -> published.Published:
    return published.Published(req.volume_id, req.pod_uid, req.pod_namespace, req.target.path, req.pod_name)


def publish(config: CsiConfig, req: Publish) -> None:
    """Bind the pool at the target for the pod, once its namespace may have it (idempotent)."""
    pool_dir = places.pool_dir(config.root, req.pool)
    _ready(config.root, req.pool)  # before the lock: the lock makes the pool's state directory
    with _serial, places.lock(pool_dir):
        _ready(config.root, req.pool)
        allowed = allowed_namespaces(pool_dir)
        if allowed is not None and req.pod_namespace not in allowed:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"pool {req.pool} is not for namespace {req.pod_namespace} "
                f"(spec.consumers.namespaces: {', '.join(sorted(allowed)) or 'none'})",
            )
        want = _record_of(req)
        _no_conflict(config, req.pool, want)
        try:
            with targets.parent_fd(req.target) as parent:
                files = engine_files(pool_dir)
                scrub.before_new_holder(pool_dir, req.pod_uid, say=faults.reached)
                published.save(pool_dir, want)
                faults.reached(faults.RECORDED)
                found = bind.state(pool_dir, parent, files)
                if found == bind.COMPLETE:
                    return  # bound already: the kubelet's retry
                if found == bind.PARTIAL:
                    bind.unbind(parent)  # a plugin killed while binding: made again whole
                try:
                    bind.bind(pool_dir, parent, files, config.stage, req.volume_id)
                except BaseException:
                    published.drop(pool_dir, want.volume_id)
                    raise
        except beneath.WrongEntry as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"target_path: {exc}: not followed") from None
        except FileNotFoundError:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the kubelet has not made the directory of {req.target.path}",
            ) from None
        except RegionError as exc:
            raise Refused(grpc.StatusCode.INTERNAL, str(exc)) from None


def _no_conflict(config: CsiConfig, pool: str, want: published.Published) -> None:
    """AlreadyExists when the volume is published otherwise, or the target holds another."""
    found = published.find(config.root, want.volume_id)
    # a record written without the pod's name (an older plugin) is the same publication
    if found is not None and (found[0], replace(found[1], pod_name=want.pod_name)) != (pool, want):
        raise Refused(
            grpc.StatusCode.ALREADY_EXISTS,
            f"volume {want.volume_id} is published from pool {found[0]} at {found[1].target_path} "
            f"for pod {found[1].pod_uid}",
        )
    for other in _all(config):
        if other[1].target_path == want.target_path and other[1].volume_id != want.volume_id:
            raise Refused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{want.target_path} holds volume {other[1].volume_id} of pod {other[1].pod_uid}",
            )


def _all(config: CsiConfig) -> list[tuple[str, published.Published]]:
    """Every published volume under the root, with its pool's name."""
    state = os.path.join(config.root, places.STATE_DIR_NAME)
    try:
        names = sorted(os.listdir(state))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[tuple[str, published.Published]] = []
    for name in names:
        try:
            pool_dir = places.pool_dir(config.root, name)
        except ValueError:
            continue
        out.extend((name, pub) for pub in published.load_all(pool_dir))
    return out


def unpublish(config: CsiConfig, req: Unpublish) -> None:
    """Unmount the volume and drop its record; a volume this node does not know is done."""
    with _serial:
        found = published.find(config.root, req.volume_id)
        if found is None or found[1].target_path != req.target.path:
            _remove_empty_target(req)
            return
        pool_dir = places.pool_dir(config.root, found[0])
        with places.lock(pool_dir):
            try:
                with targets.parent_fd(req.target) as parent:
                    bind.unbind(parent)
                    faults.reached(faults.UNBOUND)
                    bind.remove_target(parent)
            except FileNotFoundError:
                pass  # the kubelet removed the pod's directory: nothing is mounted there
            except beneath.WrongEntry as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"target_path: {exc}: not followed") from None
            except RegionError as exc:
                raise Refused(grpc.StatusCode.INTERNAL, str(exc)) from None
            published.drop(pool_dir, req.volume_id)


def _remove_empty_target(req: Unpublish) -> None:
    """The target directory a plugin killed mid-unpublish left (empty, nothing mounted)."""
    try:
        with targets.parent_fd(req.target) as parent:
            bind.remove_target(parent)
    except (OSError, beneath.WrongEntry):
        pass


def rebuild(config: CsiConfig) -> list[published.Published]:
    """At start: keep the records whose whole tree is still mounted at their target; unmount
    a tree a plugin killed while binding left half made, and drop its record and the records
    with no mount (a plugin killed between its record and its mount, a mount the node lost at
    a reboot): the kubelet's retry publishes them again. The published volumes that hold
    their pools now."""
    kept = []
    with _serial:
        for pool, pub in _all(config):
            pool_dir = places.pool_dir(config.root, pool)
            with places.lock(pool_dir):
                if _bound(config, pool_dir, pub):
                    kept.append(pub)
                else:
                    published.drop(pool_dir, pub.volume_id)
    return kept


def _bound(config: CsiConfig, pool_dir: os.PathLike[str] | str, pub: published.Published) -> bool:
    try:
        target = targets.parse(config.kubelet_dir, pub.target_path)
        files = engine_files(pool_dir)
        with targets.parent_fd(target) as parent:
            found = bind.state(pool_dir, parent, files)
            if found == bind.PARTIAL:
                bind.unbind(parent)
            return found == bind.COMPLETE
    except (ValueError, OSError, RegionError, beneath.WrongEntry):
        return False
