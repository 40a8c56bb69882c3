"""Publish and unpublish: the access check, the hold (``region.holding.published``) and the bind mount.

Order, so that a plugin killed at any point leaves nothing the next call cannot settle:
publish zeroes the memory for a new holder when the pool's scrub policy says so
(``scrub.before_new_holder``: a kill there leaves the scrub pending, the pool not Ready), then
writes the holder's record, then mounts (a record without its whole tree is unmounted and
dropped by ``rebuild``, or its tree redone by the kubelet's retry; a mount is never without
its record); unpublish unmounts before it drops the record. Both run under the pool's lock
(``PoolHandle.lock``), which a release or a reshape also takes: a pool cannot be released between
the publish's check that it is Ready and its record.

Locks are per volume and per pool (``serial``), never process-wide: a pool whose lock is
held never delays another pool's publish, and no lock a pod can take is waited for here.

A partitioned pool (``spec.partitions``): the pod is given one share, reserved for its uid
under the node's reservation mutex (``region.holding.shares.reserve``, root-only: the share
it holds already, on a retry or through another volume, else a free one; never one an engine
or another pod holds), before its record (which names the share), and only that share's files
are bound, as a plain pool. Unpublish drops the reservation after the record's unmount, when
no other volume of the pod holds the share; ``rebuild`` makes the reservations again from the
records it keeps and drops the rest.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpc

from offloadpool.csi import bind, faults
from offloadpool.csi import target as targets
from offloadpool.csi.config import CsiConfig
from offloadpool.csi.refusal import Refused
from offloadpool.csi.volume import Publish, Unpublish
from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, places, vllm_compat
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import Pool, PoolHandle, given, open_pool, path_of
from offloadpool.region.files.manifest import MOUNT_NAME, ManifestError
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import published, shares
from offloadpool.region.lifecycle import scrub, share_scrub
from offloadpool.region.lifecycle.status import state_of
from offloadpool.region.vocabulary import READY


class Serial:
    """One publish or unpublish at a time per key in this process (the kubelet retries
    concurrently): per volume and per pool, never process-wide, so a pool whose lock is held (a
    provision, a scrub, a release) never delays another pool's publish. A key's lock lives
    while someone holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users = self._locks[key][1] - 1
                if users:
                    self._locks[key] = (lock, users)
                else:
                    del self._locks[key]


serial = Serial()


def ready(pool: Pool) -> None:
    """NOT_FOUND unless the pool is Ready on this node."""
    with given(pool) as handle:
        state = state_of(handle)
    if state.phase != READY:
        why = f": {state.message}" if state.message else ""
        message = f"pool {handle.name} is not Ready on this node ({state.phase}{why})"
        raise Refused(grpc.StatusCode.NOT_FOUND, message)


def not_deleting(pool: PoolHandle, volume_id: str) -> None:
    """FAILED_PRECONDITION when the node's record says the pool is being deleted (the agent
    marks it when it starts draining it, ``records.mark_deleting``) or was left orphaned, and
    ``volume_id`` is not one of its volumes already: a new holder would keep the deletion
    waiting. Volumes given before keep working (a kubelet's retry of one is answered as ever)
    and are unpublished as ever."""
    if any(p.volume_id == volume_id for p in published.load_all(pool)):
        return
    rec = records.load(pool)
    why = "" if rec is None else rec.deleting or rec.orphaned
    if why:
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool.name} is being deleted ({why}): no new volume or claim is given "
            "it; the ones given before keep working until they are unpublished",
        )


def allowed_namespaces(pool: Pool) -> frozenset[str] | None:
    """The namespaces the node recorded for the pool (``spec.consumers.namespaces`` as the
    agent's last provision wrote it into the record's request); None: every namespace."""
    rec = records.load(pool)
    if rec is None:
        return frozenset()
    names = rec.request.get("consumer_namespaces")
    return None if names is None else frozenset(str(names).split(","))


def engine_files(pool: Pool) -> list[str]:
    """The names in the pool's mount an engine opens: each segment of the recorded plan, and
    stock vLLM's name of each for a compat pool (the node's record, not the directory's
    listing, says which)."""
    rec = records.load(pool)
    if rec is None:
        raise RegionError(f"{path_of(pool)} has no provisioning record")
    req = rec.pool_request()
    segments = make_plan(req).segments
    names = [seg.file.removeprefix(f"{MOUNT_NAME}/") for seg in segments]
    if req.compat_engine_id:
        names += vllm_compat.file_names(req.compat_engine_id, len(segments))
    return names


def partitions(pool: Pool) -> int:
    """The shares the node's record says the pool has (1: no shares)."""
    rec = records.load(pool)
    if rec is None:
        raise RegionError(f"{path_of(pool)} has no provisioning record")
    return rec.pool_request().partitions


def share_view(pool: Pool, index: int) -> tuple[list[str], bytes]:
    """Share ``index``'s segment names in the pool's mount (the node's record's plan) and its
    manifest as a plain pool's (the pool's manifest, whose share must list those very files)."""
    with given(pool) as handle:
        rec = records.load(handle)
        if rec is None:
            raise RegionError(f"{handle.path} has no provisioning record")
        plan = make_plan(rec.pool_request())
        per = len(plan.regions) // plan.shares
        mine = [s for r in plan.regions[index * per : (index + 1) * per] for s in r.segments]
        try:
            view = replace(shares.share_manifest(handle.read_manifest(), index), share=None)
        except ManifestError as exc:
            raise RegionError(f"pool {handle.path}: {exc}") from None
    listed = [(s.file, s.bytes) for r in view.regions for s in r.segments]
    if listed != [(s.file, s.bytes) for s in mine]:
        raise RegionError(f"the manifest of {handle.path} does not match the node's record for share {index}")
    return [s.file.removeprefix(f"{MOUNT_NAME}/") for s in mine], view.encode()


def _record_of(req: Publish, share: int | None = None) -> published.Published:
    return published.Published(
        req.volume_id, req.pod_uid, req.pod_namespace, req.target.path, req.pod_name, share
    )


def publish(config: CsiConfig, req: Publish) -> None:
    """Bind the pool at the target for the pod, once its namespace may have it (idempotent)."""
    pool_dir = places.pool_dir(config.root, req.pool)
    ready(pool_dir)  # before the lock: the lock makes the pool's state directory
    with (
        serial(f"volume/{req.volume_id}"),
        serial(f"pool/{req.pool}"),
        open_pool(pool_dir, lock=True) as pool,
    ):
        ready(pool)
        not_deleting(pool, req.volume_id)
        allowed = allowed_namespaces(pool)
        if allowed is not None and req.pod_namespace not in allowed:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"pool {req.pool} is not for namespace {req.pod_namespace} "
                f"(spec.consumers.namespaces: {', '.join(sorted(allowed)) or 'none'})",
            )
        _no_conflict(config, req.pool, _record_of(req))
        try:
            with targets.parent_fd(req.target) as parent:
                n = partitions(pool)
                if n > 1:
                    _publish_share(config, pool, parent, req, n)
                    return
                files = engine_files(pool)
                scrub.before_new_holder(pool, req.pod_uid, say=faults.reached)
                record_and_bind(
                    pool,
                    parent,
                    _record_of(req),
                    lambda: bind.state(pool, parent, files),
                    lambda: bind.bind(pool, parent, files, config.stage, req.volume_id),
                )
        except beneath.WrongEntry as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"target_path: {exc}: not followed") from None
        except FileNotFoundError:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the kubelet has not made the directory of {req.target.path}",
            ) from None
        except shares.ShareRefused as exc:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except RegionError as exc:
            raise Refused(grpc.StatusCode.INTERNAL, str(exc)) from None


def _publish_share(config: CsiConfig, pool: PoolHandle, parent: int, req: Publish, n: int) -> None:
    """Reserve the pod's share, record it, bind its tree (or find it bound: a retry)."""
    before = published.find(config.root, req.volume_id)
    prefer = before[1].share if before is not None else None
    try:
        index = shares.reserve(pool, n, req.pod_uid, prefer=prefer)
    except (FileNotFoundError, beneath.WrongEntry) as exc:  # not the kubelet's directory
        raise RegionError(f"the shares of {pool.path} are not there as the node made them: {exc}") from None
    given_share(pool, index, req.pod_uid, lambda: unreserve(pool, _record_of(req, index)))
    want = _record_of(req, index)
    if before is not None and before[1] != want:
        unreserve(pool, before[1])  # recorded for another share (its reservation lost)
    files, manifest = share_view(pool, index)
    record_and_bind(
        pool,
        parent,
        want,
        lambda: bind.share_state(pool, parent, files),
        lambda: bind.bind_share(pool, parent, files, manifest, config.stage, req.volume_id),
        lambda: unreserve(pool, want),
    )


def given_share(pool: PoolHandle, index: int, holder: str, undo: Callable[[], None]) -> None:
    """Share ``index``, reserved for ``holder``, zeroed first when another had it
    (``share_scrub.before_share_holder``); held meanwhile: ``undo`` (the reservation dropped)
    and UNAVAILABLE, which the kubelet retries."""
    try:
        share_scrub.before_share_holder(pool, index, holder, say=faults.reached)
    except share_scrub.ShareBusy as exc:
        undo()
        raise Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None


def record_and_bind(
    pool: PoolHandle,
    parent: int,
    want: published.Published,
    state: Callable[[], str],
    make: Callable[[], None],
    undo: Callable[[], None] | None = None,
) -> None:
    """Record ``want`` first (a plugin killed after this finds the volume at restart), then make
    its tree unless the kubelet's retry finds it whole (``state``); a half-made tree (a plugin
    killed while binding) is made again whole. A failed bind drops the record, then ``undo``."""
    published.save(pool, want)
    faults.reached(faults.RECORDED)
    found = state()
    if found == bind.COMPLETE:
        return  # bound already: the kubelet's retry
    if found == bind.PARTIAL:
        bind.unbind(parent)
    try:
        make()
    except BaseException:
        published.drop(pool, want.volume_id)
        if undo is not None:
            undo()
        raise


def unreserve(pool: Pool, pub: published.Published) -> None:
    """Drop ``pub``'s share reservation unless another volume of its pod still holds it."""
    if pub.share is None:
        return
    with given(pool) as handle:
        others = [p for p in published.load_all(handle) if p.volume_id != pub.volume_id]
        if not any(p.pod_uid == pub.pod_uid and p.share == pub.share for p in others):
            shares.unreserve(handle, pub.share, pub.pod_uid)


def _no_conflict(config: CsiConfig, pool: str, want: published.Published) -> None:
    """AlreadyExists when the volume is published otherwise, or the target holds another."""
    found = published.find(config.root, want.volume_id)
    # a record written without the pod's name (an older plugin) is the same publication
    if found is not None and (found[0], replace(found[1], pod_name=want.pod_name, share=None)) != (
        pool,
        want,
    ):
        raise Refused(
            grpc.StatusCode.ALREADY_EXISTS,
            f"volume {want.volume_id} is published from pool {found[0]} at {found[1].target_path} "
            f"for pod {found[1].pod_uid}",
        )
    for other in all_records(config.root):
        if other[1].target_path == want.target_path and other[1].volume_id != want.volume_id:
            raise Refused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"{want.target_path} holds volume {other[1].volume_id} of pod {other[1].pod_uid}",
            )


def all_records(root: str) -> list[tuple[str, published.Published]]:
    """Every record under the root (csi volumes' and DRA claims'), with its pool's name."""
    state = os.path.join(root, places.STATE_DIR_NAME)
    try:
        names = sorted(os.listdir(state))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[tuple[str, published.Published]] = []
    for name in names:
        try:
            pool_dir = places.pool_dir(root, name)
        except ValueError:
            continue
        out.extend((name, pub) for pub in published.load_all(pool_dir))
    return out


def unpublish(config: CsiConfig, req: Unpublish) -> None:
    """Unmount the volume and drop its record; a volume this node does not know is done."""
    with serial(f"volume/{req.volume_id}"):
        found = published.find(config.root, req.volume_id)
        if found is None or found[1].target_path != req.target.path:
            _remove_empty_target(req)
            return
        pool_dir = places.pool_dir(config.root, found[0])
        with serial(f"pool/{found[0]}"), open_pool(pool_dir, lock=True) as pool:
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
            unreserve(pool, found[1])
            published.drop(pool, req.volume_id)


def _remove_empty_target(req: Unpublish) -> None:
    """The target directory a plugin killed mid-unpublish left (empty, nothing mounted)."""
    try:
        with targets.parent_fd(req.target) as parent:
            bind.remove_target(parent)
    except (OSError, beneath.WrongEntry):
        pass


def rebuild(config: CsiConfig) -> list[published.Published]:
    """At start: keep the csi volumes' records whose whole tree is still mounted at their
    target; unmount a tree a plugin killed while binding left half made, and drop its record and the records
    with no mount (a plugin killed between its record and its mount, a mount the node lost at
    a reboot): the kubelet's retry publishes them again. The published volumes that hold
    their pools now."""
    kept = []
    for pool, pub in all_records(config.root):
        if pub.is_dra:
            continue  # the DRA plugin's to settle (``offloadpool.dra``); its reservation is kept below
        pool_dir = places.pool_dir(config.root, pool)
        with (
            serial(f"volume/{pub.volume_id}"),
            serial(f"pool/{pool}"),
            open_pool(pool_dir, lock=True) as handle,
        ):
            if _bound(config, handle, pub):
                kept.append(pub)
            else:
                published.drop(handle, pub.volume_id)
    for pool in pool_names(config.root):
        pool_dir = places.pool_dir(config.root, pool)
        with serial(f"pool/{pool}"), open_pool(pool_dir, lock=True) as handle:
            reserve_again(handle)
    return kept


def pool_names(root: str) -> list[str]:
    """Every pool with a state directory under the root."""
    state = os.path.join(root, places.STATE_DIR_NAME)
    try:
        names = sorted(os.listdir(state))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        try:
            places.pool_dir(root, name)
        except ValueError:
            continue
        out.append(name)
    return out


def reserve_again(pool: PoolHandle) -> None:
    """The pool's share reservations as its kept records say: each record's share reserved
    for its pod (again, if a plugin was killed before it reserved or after it dropped it), and
    every reservation no record names dropped (a plugin killed between unreserving and
    dropping, or between reserving and recording); a hostPath pod's is not the plugins'."""
    try:
        n = partitions(pool)
    except (RegionError, TypeError, ValueError):
        return
    if n < 2:
        return
    wanted = {p.share: p.pod_uid for p in published.load_all(pool) if p.share is not None}
    try:
        for index, pod in shares.reservations(pool, n).items():
            if pod.startswith(shares.HOSTPATH_OWNER_PREFIX):
                continue  # the node's, for a hostPath pod: the agent's share service keeps it
            if wanted.get(index) != pod:
                shares.unreserve(pool, index, pod)
        for index, pod in sorted(wanted.items()):
            if index < n:
                shares.reserve(pool, n, pod, prefer=index)
    except (OSError, shares.ShareRefused, beneath.WrongEntry):
        pass  # the shares' names are not there (a pool being taken apart): nothing to hold


def _bound(config: CsiConfig, pool: PoolHandle, pub: published.Published) -> bool:
    try:
        target = targets.parse(config.kubelet_dir, pub.target_path)
        n = partitions(pool)
        if (pub.share is None) != (n == 1) or (pub.share is not None and pub.share >= n):
            return False  # recorded for another shape of the pool
        with targets.parent_fd(target) as parent:
            if pub.share is None:
                found = bind.state(pool, parent, engine_files(pool))
            else:
                found = bind.share_state(pool, parent, share_view(pool, pub.share)[0])
            if found == bind.PARTIAL:
                bind.unbind(parent)
            return found == bind.COMPLETE
    except (ValueError, TypeError, OSError, RegionError, beneath.WrongEntry):
        return False
