"""Prepare and unprepare a claim's device: the CSI plugin's record, mutexes and bind mounts,
handed to the container by a CDI spec (docs/dra.md).

Prepare, for each of this driver's devices the scheduler allocated to the claim (one per pool):

1. the pool is Ready here and the claim's namespace is one of its consumers
   (``spec.consumers.namespaces`` as the node recorded it), the device matches the pool's shape;
2. under the claim's and the pool's serial locks and the pool's lock (``PoolHandle.lock``, which a
   release and a reshape take too): zero the memory for a new holder when the scrub policy says
   so (``scrub.before_new_holder``), reserve exactly the allocated share for ``claim/<uid>``
   (``shares.reserve(only=...)``, the node's reservation mutex the CSI plugin and the engines'
   claims respect: one share is never given twice across HostPath, CSI and DRA);
3. write the record (``region.holding.published``, volume id ``dra-<uid>``: a holder the pool's
   release and reshape wait for, as a csi volume is), then bind the tree the CSI plugin binds
   (``csi.bind``: the pool's files, or the share's as a plain pool, ``nosuid,nodev``) at
   ``<kubelet>/plugins/offloadpool.io/claims/<uid>/mount``: every component root's, out of any
   pod's reach (the guard webhook refuses hostPaths into the kubelet's tree), so the path the
   runtime binds from names no directory a pod can change;
4. write the CDI spec ``<cdi_dir>/offloadpool.io-<uid>.json`` (atomically): one device, the
   claim's uid, whose ``containerEdits`` bind that tree (``rbind,nosuid,nodev``) at
   ``/offloadpool/<pool>`` and set ``OFFLOADPOOL_POOL_DIR``, ``OFFLOADPOOL_POOL`` and, for a
   share, ``OFFLOADPOOL_SHARE``; return its CDI id ``offloadpool.io/pool=<uid>``.

The record is the checkpoint: a second prepare finds it and the tree whole and only writes the
spec again; a tree a killed plugin left half made is unbound and made again. Unprepare undoes it
in reverse (the spec, the tree, the reservation, the record), and is done for a claim it does
not know. At start (``rebuild``) a record whose tree is still whole is kept and its spec
written again; the others are dropped with their trees and specs, every CDI spec of ours and
every claim directory no kept record names is removed, and the reservations are made what
the kept records say (the CSI plugin's ``reserve_again``, over both plugins' records); a spec's
temporary file a plugin killed mid-write left is written over and renamed by that rewrite (its
tree is whole by then).
The steps a test can stop the plugin at, to kill it there, are the CSI plugin's hook's
(``csi.faults``: ``reserved`` ... ``cdi-written``, ``cdi-removed`` ... ``unreserved``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from offloadpool.api import dra
from offloadpool.api.pods import ENV_POOL, ENV_POOL_DIR, ENV_SHARE, pod_pool_dir
from offloadpool.csi import bind, faults, publication
from offloadpool.csi.publication import serial
from offloadpool.csi.refusal import Refused
from offloadpool.csi.target import MOUNT_NAME
from offloadpool.dra.claims import CLAIM_UID_PATTERN, Allocated, ClaimError
from offloadpool.dra.config import DraConfig
from offloadpool.region.errors import RegionError
from offloadpool.region.files import beneath, places
from offloadpool.region.files.handle import PoolHandle, open_pool
from offloadpool.region.holding import published, shares
from offloadpool.region.lifecycle import scrub

#: the CDI spec's version (containerd's CDI library reads it) and the device kind
CDI_VERSION = "0.6.0"
CDI_KIND = f"{dra.DRA_DRIVER}/pool"
CDI_PREFIX = f"{dra.DRA_DRIVER}-"
CDI_SUFFIX = ".json"
#: the claims' directory and each claim's: root's alone
CLAIM_DIR_MODE = 0o700


def cdi_id(claim_uid: str) -> str:
    """The CDI device the runtime is told of: ``offloadpool.io/pool=<claim uid>``."""
    return f"{CDI_KIND}={claim_uid}"


def cdi_path(config: DraConfig, claim_uid: str) -> str:
    return os.path.join(config.cdi_dir, f"{CDI_PREFIX}{claim_uid}{CDI_SUFFIX}")


def cdi_spec(config: DraConfig, claim_uid: str, pool: str, share: int | None) -> dict[str, object]:
    """The claim's CDI spec: its tree bound at the pool's path in the container, the env set."""
    where = pod_pool_dir(pool)
    env = [f"{ENV_POOL_DIR}={where}", f"{ENV_POOL}={pool}"]
    if share is not None:
        env.append(f"{ENV_SHARE}={share}")
    mount = {
        "hostPath": f"{config.claims_dir}/{claim_uid}/{MOUNT_NAME}",
        "containerPath": where,
        "options": ["rbind", "nosuid", "nodev"],
    }
    device = {"name": claim_uid, "containerEdits": {"env": env, "mounts": [mount]}}
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": [device]}


def _write_spec(
    config: DraConfig,
    claim_uid: str,
    pool: str,
    share: int | None,
    say: Callable[[str], None] = lambda step: None,
) -> None:
    """Write the claim's spec under a temporary name and rename it into place: the runtime
    reads a spec whole or not at all. ``say``: prepare's fault hook (``csi.faults``), not
    the rebuild's, so a plugin stopped at a step stops in a kubelet's call."""
    os.makedirs(config.cdi_dir, mode=0o755, exist_ok=True)
    path = cdi_path(config, claim_uid)
    tmp = f"{path}.tmp"
    data = json.dumps(cdi_spec(config, claim_uid, pool, share), indent=2, sort_keys=True) + "\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    say(faults.CDI_STAGED)
    os.replace(tmp, path)


def _remove_spec(config: DraConfig, claim_uid: str) -> None:
    try:
        os.unlink(cdi_path(config, claim_uid))
    except FileNotFoundError:
        pass


@contextmanager
def _claim_dir(config: DraConfig, claim_uid: str, *, create: bool) -> Iterator[int | None]:
    """The claim's directory (``claims/<uid>`` beneath the plugin's, root's, 0700, no link
    followed), made when ``create``; None when it is not there."""
    os.makedirs(config.plugin_dir, mode=CLAIM_DIR_MODE, exist_ok=True)
    top = os.open(config.plugin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if create:
            beneath.mkdir(top, "claims", CLAIM_DIR_MODE)
            beneath.mkdir(top, f"claims/{claim_uid}", CLAIM_DIR_MODE)
        try:
            fd = beneath.open_dir(top, f"claims/{claim_uid}")
        except FileNotFoundError:
            yield None
            return
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, CLAIM_DIR_MODE)
            yield fd
        finally:
            os.close(fd)
    finally:
        os.close(top)


def _remove_claim_dir(config: DraConfig, claim_uid: str) -> None:
    try:
        top = os.open(config.plugin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        beneath.rmdir(top, f"claims/{claim_uid}")
    except OSError:
        pass  # not there, or not empty (a mount the unbind could not take: said by the caller)
    finally:
        os.close(top)


def _record_of(
    claim_uid: str, namespace: str, name: str, target: str, share: int | None
) -> published.Published:
    return published.Published(
        published.dra_volume_id(claim_uid), shares.claim_owner(claim_uid), namespace, target, name, share
    )


def prepare(config: DraConfig, namespace: str, name: str, claim_uid: str, device: Allocated) -> str:
    """Prepare the claim's ``device`` (idempotent) and return its CDI device id."""
    pool_dir = places.pool_dir(config.root, device.pool)
    publication.ready(pool_dir)  # before the lock: the lock makes the state directory
    owner = shares.claim_owner(claim_uid)
    vid = published.dra_volume_id(claim_uid)
    with (
        serial(f"volume/{vid}"),
        serial(f"pool/{device.pool}"),
        open_pool(pool_dir, lock=True) as pool,
    ):
        publication.ready(pool)
        publication.not_deleting(pool, vid)
        allowed = publication.allowed_namespaces(pool)
        if allowed is not None and namespace not in allowed:
            raise Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"pool {device.pool} is not for namespace {namespace} "
                f"(spec.consumers.namespaces: {', '.join(sorted(allowed)) or 'none'})",
            )
        n = publication.partitions(pool)
        if (n == 1) != (device.share is None) or (device.share is not None and device.share >= n):
            raise ClaimError(
                f"device {device.device} is not a device of pool {device.pool} as this node holds it "
                f"({n} share{'s' if n != 1 else ''}): the claim was allocated from an older slice"
            )
        found = published.find(config.root, vid)
        if found is not None and found[0] != device.pool:
            raise ClaimError(f"claim {claim_uid} is prepared from pool {found[0]} already")
        target = f"{config.claims_dir}/{claim_uid}"
        try:
            with _claim_dir(config, claim_uid, create=True) as parent:
                assert parent is not None
                if device.share is None:
                    scrub.before_new_holder(pool, owner, say=faults.reached)
                    files = publication.engine_files(pool)
                    publication.record_and_bind(
                        pool,
                        parent,
                        _record_of(claim_uid, namespace, name, target, None),
                        lambda: bind.state(pool, parent, files),
                        lambda: bind.bind(pool, parent, files, config.stage, vid),
                    )
                else:
                    index = device.share
                    shares.reserve(pool, n, owner, only=index)
                    faults.reached(faults.RESERVED)
                    want = _record_of(claim_uid, namespace, name, target, index)
                    publication.given_share(pool, index, owner, lambda: publication.unreserve(pool, want))
                    files, manifest = publication.share_view(pool, index)
                    publication.record_and_bind(
                        pool,
                        parent,
                        want,
                        lambda: bind.share_state(pool, parent, files),
                        lambda: bind.bind_share(pool, parent, files, manifest, config.stage, vid),
                        lambda: publication.unreserve(pool, want),
                    )
        except shares.ShareRefused as exc:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except (RegionError, beneath.WrongEntry) as exc:
            raise Refused(grpc.StatusCode.INTERNAL, str(exc)) from None
        _write_spec(config, claim_uid, device.pool, device.share, say=faults.reached)
        faults.reached(faults.CDI_WRITTEN)
    return cdi_id(claim_uid)


def unprepare(config: DraConfig, claim_uid: str) -> None:
    """Undo ``prepare`` (the spec, the tree, the reservation, the record); a claim this node
    does not know is done."""
    vid = published.dra_volume_id(claim_uid)
    with serial(f"volume/{vid}"):
        _remove_spec(config, claim_uid)
        faults.reached(faults.CDI_REMOVED)
        found = published.find(config.root, vid)
        if found is None:
            _unbind(config, claim_uid)
            return
        pool, pub = found
        pool_dir = places.pool_dir(config.root, pool)
        with serial(f"pool/{pool}"), open_pool(pool_dir, lock=True) as handle:
            _unbind(config, claim_uid)
            faults.reached(faults.UNBOUND)
            publication.unreserve(handle, pub)
            faults.reached(faults.UNRESERVED)
            published.drop(handle, vid)


def _unbind(config: DraConfig, claim_uid: str) -> None:
    with _claim_dir(config, claim_uid, create=False) as parent:
        if parent is not None:
            bind.unbind(parent)
            bind.remove_target(parent)
    _remove_claim_dir(config, claim_uid)


def rebuild(config: DraConfig) -> list[published.Published]:
    """At start (see the module's docstring): the claims still prepared."""
    kept: list[published.Published] = []
    for pool, pub in publication.all_records(config.root):
        if not pub.is_dra:
            continue  # a csi volume's: the CSI plugin's to settle
        uid = pub.volume_id.removeprefix(published.DRA_PREFIX)
        pool_dir = places.pool_dir(config.root, pool)
        with (
            serial(f"volume/{pub.volume_id}"),
            serial(f"pool/{pool}"),
            open_pool(pool_dir, lock=True) as handle,
        ):
            if _whole(config, handle, uid, pub):
                _write_spec(config, uid, pool, pub.share)
                kept.append(pub)
                continue
            _remove_spec(config, uid)
            _unbind(config, uid)
            published.drop(handle, pub.volume_id)
    for pool in publication.pool_names(config.root):
        pool_dir = places.pool_dir(config.root, pool)
        with serial(f"pool/{pool}"), open_pool(pool_dir, lock=True) as handle:
            publication.reserve_again(handle)
    mine = {p.volume_id.removeprefix(published.DRA_PREFIX) for p in kept}
    try:
        names = os.listdir(config.cdi_dir)
    except FileNotFoundError:
        names = []
    for entry in names:
        if entry.startswith(CDI_PREFIX) and entry.endswith(CDI_SUFFIX):
            uid = entry[len(CDI_PREFIX) : -len(CDI_SUFFIX)]
            if uid not in mine:
                _remove_spec(config, uid)
    # a claim's directory no kept record names: one a plugin killed before its record made
    try:
        names = os.listdir(config.claims_dir)
    except FileNotFoundError:
        names = []
    for uid in names:
        if uid not in mine and CLAIM_UID_PATTERN.fullmatch(uid):
            _unbind(config, uid)
    return kept


def _whole(config: DraConfig, pool: PoolHandle, claim_uid: str, pub: published.Published) -> bool:
    """The record's tree is bound whole at its claim's directory (a half-made one is unbound)."""
    try:
        n = publication.partitions(pool)
        if (pub.share is None) != (n == 1) or (pub.share is not None and pub.share >= n):
            return False
        with _claim_dir(config, claim_uid, create=False) as parent:
            if parent is None:
                return False
            if pub.share is None:
                found = bind.state(pool, parent, publication.engine_files(pool))
            else:
                found = bind.share_state(pool, parent, publication.share_view(pool, pub.share)[0])
            if found == bind.PARTIAL:
                bind.unbind(parent)
            return found == bind.COMPLETE
    except (ValueError, TypeError, OSError, RegionError, beneath.WrongEntry):
        return False
