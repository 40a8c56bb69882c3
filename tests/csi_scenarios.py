"""Scenarios of the CSI node plugin, each run by tests/test_csi_node.py in a mount namespace
of its own where every mount but a scratch tmpfs is read-only (as the bad-names test of
tests/test_region_untrusted.py does): real gRPC over a real unix socket, real bind mounts, and
nothing a wrong mount could reach outside the scratch directory. Prints one JSON line."""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any

POD = "0f8e1c2a-1111-4222-8333-444455556666"
OTHER_POD = "0f8e1c2a-9999-4222-8333-444455556666"
VOLUME = "csi-0123456789abcdef"


def lock_down(scratch: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    ms_rdonly, ms_remount, ms_bind = 1, 32, 4096
    for line in open("/proc/self/mountinfo").read().splitlines():
        target = line.split()[4].encode().decode("unicode_escape")
        if libc.mount(None, target.encode(), None, ms_bind | ms_remount | ms_rdonly, None) != 0:
            sys.exit(f"cannot make {target} read-only: {os.strerror(ctypes.get_errno())}")
    if libc.mount(b"scratch", scratch.encode(), b"tmpfs", 0, b"size=64m") != 0:
        sys.exit(f"cannot mount the scratch tmpfs: {os.strerror(ctypes.get_errno())}")


class World:
    def __init__(self, scratch: str) -> None:
        import grpc

        from offloadpool.csi.config import CsiConfig
        from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc, pluginregistration_pb2
        from offloadpool.region.provision import provision
        from offloadpool.region.request import PoolRequest

        self.scratch = scratch
        self.root = f"{scratch}/root"
        self.kubelet = f"{scratch}/kubelet"
        os.makedirs(self.root)
        for pod in (POD, OTHER_POD):
            os.makedirs(f"{self.kubelet}/pods/{pod}/volumes/kubernetes.io~csi/kv-cache")
        provision(
            PoolRequest(name="kv", capacity=4 << 20, medium="Memory", consumer_namespaces="team-a,team-b"),
            self.root,
        )
        self.config = CsiConfig(
            node_id="node-a",
            endpoint=f"{scratch}/plugin/csi.sock",
            root=self.root,
            kubelet_dir=self.kubelet,
            registration=f"{scratch}/reg/r.sock",  # a socket's path is at most 107 bytes
        )
        self.pb = csi_pb2
        self.reg_pb = pluginregistration_pb2
        self.grpc = grpc
        self.stubs = csi_pb2_grpc
        self.plugin: Any = None
        self.start()

    def start(self) -> list[str]:
        from offloadpool.csi.proto import pluginregistration_pb2_grpc
        from offloadpool.csi.server import serve

        self.plugin = serve(self.config)
        channel = self.grpc.insecure_channel(f"unix://{self.config.endpoint}")
        self.identity = self.stubs.IdentityStub(channel)
        self.node = self.stubs.NodeStub(channel)
        registration = self.grpc.insecure_channel(f"unix://{self.config.registration}")
        self.registration = pluginregistration_pb2_grpc.RegistrationStub(registration)
        return [p.volume_id for p in self.plugin.kept]

    def stop(self) -> None:
        self.plugin.stop()

    def target(self, pod: str = POD) -> str:
        return f"{self.kubelet}/pods/{pod}/volumes/kubernetes.io~csi/kv-cache/mount"

    def publish_request(self, **over: Any) -> Any:
        ctx = {
            "pool": "kv",
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.namespace": "team-a",
            "csi.storage.k8s.io/pod.uid": POD,
            "csi.storage.k8s.io/pod.name": "engine-0",
        }
        ctx.update(over.pop("context", {}))
        for key in over.pop("drop_context", ()):
            ctx.pop(key)
        fields = {
            "volume_id": VOLUME,
            "target_path": self.target(),
            "volume_context": ctx,
            "volume_capability": self.pb.VolumeCapability(mount=self.pb.VolumeCapability.MountVolume()),
        }
        fields.update(over)
        return self.pb.NodePublishVolumeRequest(**{k: v for k, v in fields.items() if v is not None})

    def call(self, method: Any, request: Any) -> str:
        try:
            method(request, timeout=30)
            return "OK"
        except self.grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    def publish(self, **over: Any) -> str:
        return self.call(self.node.NodePublishVolume, self.publish_request(**over))

    def unpublish(self, volume: str = VOLUME, target: str | None = None) -> str:
        req = self.pb.NodeUnpublishVolumeRequest(volume_id=volume, target_path=target or self.target())
        return self.call(self.node.NodeUnpublishVolume, req)

    def snapshot(self) -> dict[str, Any]:
        """Mounts under the scratch directory but the pool's own, the holder records, the tree."""
        mounts = []
        for line in open("/proc/self/mountinfo").read().splitlines():
            f = line.split()
            target = f[4].encode().decode("unicode_escape")
            if target.startswith(self.kubelet) or target.startswith(f"{self.scratch}/elsewhere"):
                mounts.append({"target": target, "options": f[5].split(",")})
        from offloadpool.region import published

        records = [vars(p) for p in published.load_all(f"{self.root}/kv")]
        tree = sorted(
            os.path.relpath(os.path.join(d, n), self.scratch)
            for d, ds, fs in os.walk(self.scratch)
            for n in ds + fs
            if not d.startswith(f"{self.root}/kv/mnt") and "/mount/" not in d + "/"
        )
        return {"mounts": mounts, "records": records, "tree": tree}


def identity(w: World) -> dict[str, Any]:
    info = w.identity.GetPluginInfo(w.pb.GetPluginInfoRequest())
    caps = w.identity.GetPluginCapabilities(w.pb.GetPluginCapabilitiesRequest())
    probe = w.identity.Probe(w.pb.ProbeRequest())
    node = w.node.NodeGetInfo(w.pb.NodeGetInfoRequest())
    ncaps = w.node.NodeGetCapabilities(w.pb.NodeGetCapabilitiesRequest())
    return {
        "name": info.name,
        "version": info.vendor_version,
        "caps": len(caps.capabilities),
        "ready": probe.ready.value,
        "node_id": node.node_id,
        "node_caps": len(ncaps.capabilities),
    }


def registration(w: World) -> dict[str, Any]:
    """What the kubelet's plugin watcher does: the socket in plugins_registry, GetInfo, a dial
    of the endpoint it names, NodeGetInfo there, NotifyRegistrationStatus; then a stop."""
    import stat

    sock = w.config.registration
    listed = sorted(os.listdir(os.path.dirname(sock)))
    is_socket = stat.S_ISSOCK(os.lstat(sock).st_mode)
    info = w.registration.GetInfo(w.reg_pb.InfoRequest(), timeout=30)
    dialed = w.stubs.NodeStub(w.grpc.insecure_channel(f"unix://{info.endpoint}"))
    node_id = dialed.NodeGetInfo(w.pb.NodeGetInfoRequest(), timeout=30).node_id
    before = w.plugin.registrar.status
    w.registration.NotifyRegistrationStatus(w.reg_pb.RegistrationStatus(plugin_registered=True), timeout=30)
    registered = w.plugin.registrar.status
    w.registration.NotifyRegistrationStatus(
        w.reg_pb.RegistrationStatus(plugin_registered=False, error="no"), timeout=30
    )
    refused = w.plugin.registrar.status
    w.stop()
    after_stop = sorted(os.listdir(os.path.dirname(sock)))
    w.start()  # main() stops it once more at the end
    return {
        "listed": listed,
        "is_socket": is_socket,
        "type": info.type,
        "name": info.name,
        "endpoint": info.endpoint,
        "versions": list(info.supported_versions),
        "node_id": node_id,
        "status": [before, registered, refused],
        "after_stop": after_stop,
        "csi_socket_after_stop": os.path.exists(w.config.endpoint),
    }


def refusals(w: World) -> dict[str, Any]:
    os.makedirs(f"{w.scratch}/elsewhere/mount")
    # a pod directory whose `volumes` is a link to somewhere else on the node
    linked = "0f8e1c2a-7777-4222-8333-444455556666"
    os.makedirs(f"{w.kubelet}/pods/{linked}")
    os.makedirs(f"{w.scratch}/elsewhere/volumes/kubernetes.io~csi/kv-cache")
    os.symlink(f"{w.scratch}/elsewhere/volumes", f"{w.kubelet}/pods/{linked}/volumes")
    linked_target = f"{w.kubelet}/pods/{linked}/volumes/kubernetes.io~csi/kv-cache/mount"
    bad = {
        "volume id": {"volume_id": "../x"},
        "empty volume id": {"volume_id": ""},
        "no capability": {"volume_capability": None},
        "block": {"volume_capability": w.pb.VolumeCapability(block=w.pb.VolumeCapability.BlockVolume())},
        "mount flags": {
            "volume_capability": w.pb.VolumeCapability(
                mount=w.pb.VolumeCapability.MountVolume(mount_flags=["suid"])
            )
        },
        "readonly": {"readonly": True},
        "not ephemeral": {"context": {"csi.storage.k8s.io/ephemeral": "false"}},
        "no pool": {"drop_context": ["pool"]},
        "pool ..": {"context": {"pool": ".."}},
        "pool climbing": {"context": {"pool": "kv/../../elsewhere"}},
        "pool .state": {"context": {"pool": ".state"}},
        "no namespace": {"drop_context": ["csi.storage.k8s.io/pod.namespace"]},
        "bad namespace": {"context": {"csi.storage.k8s.io/pod.namespace": "../team-a"}},
        "no pod uid": {"drop_context": ["csi.storage.k8s.io/pod.uid"]},
        "bad pod name": {"context": {"csi.storage.k8s.io/pod.name": "engine;\nreleased"}},
        "outside pods": {"target_path": f"{w.scratch}/elsewhere/mount"},
        "dotdot target": {
            "target_path": f"{w.kubelet}/pods/{POD}/volumes/kubernetes.io~csi/../../../../../elsewhere/mount"
        },
        "other pod's dir": {"target_path": w.target(OTHER_POD)},
        "not mount": {"target_path": w.target().removesuffix("/mount") + "/other"},
        "symlinked component": {
            "target_path": linked_target,
            "context": {"csi.storage.k8s.io/pod.uid": linked},
        },
    }
    before = w.snapshot()
    out = {name: w.publish(**over) for name, over in bad.items()}
    out["absent pool"] = w.publish(context={"pool": "absent"})
    return {"before": before, "after": w.snapshot(), "results": out}


def publish(w: World) -> dict[str, Any]:
    from offloadpool.region import holders
    from offloadpool.region.lease import LeaseHeld
    from offloadpool.region.release import release

    out: dict[str, Any] = {"first": w.publish()}
    out["after_first"] = w.snapshot()
    out["manifest_via_target"] = os.path.exists(f"{w.target()}/manifest.json")
    out["segments_via_target"] = sorted(os.listdir(f"{w.target()}/mnt"))
    out["segments_in_pool"] = sorted(os.listdir(f"{w.root}/kv/mnt"))
    out["again"] = w.publish()
    out["after_again"] = w.snapshot()
    out["other_volume_same_target"] = w.publish(volume_id="csi-feedfeedfeed")
    out["count"] = holders.count(f"{w.root}/kv")
    try:
        release(w.root, "kv")
        out["release"] = "released"
    except LeaseHeld as exc:
        out["release"] = f"held: {exc}"
    out["after_release"] = w.snapshot()
    return out


def namespace(w: World) -> dict[str, Any]:
    before = w.snapshot()
    result = w.publish(context={"csi.storage.k8s.io/pod.namespace": "team-c"})
    return {"result": result, "before": before, "after": w.snapshot()}


def unpublish(w: World) -> dict[str, Any]:
    from offloadpool.region.release import release

    before = w.snapshot()
    out: dict[str, Any] = {"publish": w.publish(), "published": w.snapshot()}
    out["unpublish"] = w.unpublish()
    out["after"] = w.snapshot()
    out["again"] = w.unpublish()
    out["unknown"] = w.unpublish(volume="csi-unknown")
    out["before"] = before
    out["count_after"] = __import__("offloadpool.region.holders").region.holders.count(f"{w.root}/kv")
    out["release"] = release(w.root, "kv").existed
    return out


def restart(w: World) -> dict[str, Any]:
    from offloadpool.region import published

    out: dict[str, Any] = {
        "a": w.publish(),
        "b": w.publish(
            volume_id="csi-bbbb",
            target_path=w.target(OTHER_POD),
            context={"csi.storage.k8s.io/pod.uid": OTHER_POD},
        ),
    }
    w.stop()
    # the node lost b's mount (a reboot, an unmount by hand) while the plugin was down; and a
    # plugin killed between its record and its mount left a record with no mount at all
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.umount2(w.target(OTHER_POD).encode(), 2) == 0
    published.save(
        f"{w.root}/kv", published.Published("csi-cccc", POD, "team-a", w.target(POD)[:-5] + "x/mount")
    )
    out["records_before"] = sorted(p.volume_id for p in published.load_all(f"{w.root}/kv"))
    out["kept"] = w.start()
    out["after"] = w.snapshot()
    out["unpublish_a"] = w.unpublish()
    out["end"] = w.snapshot()
    return out


def main() -> None:
    scratch, scenario = sys.argv[1], sys.argv[2]
    lock_down(scratch)
    world = World(scratch)
    try:
        result = globals()[scenario](world)
    finally:
        world.stop()
    print(json.dumps(result))
