"""Scenarios of the CSI node plugin, each run by tests/test_csi_node.py in a mount namespace
of its own where every mount but a scratch tmpfs is read-only (as the bad-names test of
tests/test_region_untrusted.py does): real gRPC over a real unix socket, real bind mounts, and
nothing a wrong mount could reach outside the scratch directory. Prints one JSON line."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from pathlib import Path
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
        from offloadpool.region.lifecycle.provision import provision
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
            stage=f"{scratch}/stage",
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
            if target.startswith((self.kubelet, f"{self.scratch}/elsewhere", f"{self.scratch}/stage/")):
                mounts.append({"target": target, "options": f[5].split(",")})
        from offloadpool.region.holding import published

        # a pool's records name no share (a partitioned pool's do: shares())
        records = [
            {k: v for k, v in vars(p).items() if k != "share"} for p in published.load_all(f"{self.root}/kv")
        ]
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
    # root-only: a plugin of an older release left its directory 0755; a restart makes it 0700
    w.stop()
    os.chmod(os.path.dirname(w.config.endpoint), 0o755)
    w.start()

    def mode(path: str) -> str:
        return oct(os.lstat(path).st_mode & 0o7777)

    def connect_as_nobody(path: str) -> str:
        """A process that is not root dials the socket (what a pod given it would do)."""
        import socket

        r, wr = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(path)
                os.write(wr, b"connected")
            except OSError as exc:
                os.write(wr, (exc.strerror or str(exc)).encode())
            os._exit(0)
        os.close(wr)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            return f.read().decode()

    return {
        "sockets": {
            "csi": mode(w.config.endpoint),
            "csi_dir": mode(os.path.dirname(w.config.endpoint)),
            "registration": mode(w.config.registration),
            "csi_by_nobody": connect_as_nobody(w.config.endpoint),
            "registration_by_nobody": connect_as_nobody(w.config.registration),
        },
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
    from offloadpool.region.holding import holders
    from offloadpool.region.holding.lease import LeaseHeld
    from offloadpool.region.lifecycle.release import release

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


def _try(act: Any) -> str:
    try:
        act()
        return "OK"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def engine_view(w: World) -> dict[str, Any]:
    """What a pod gets at its target: the entries, each mount's flags, and which writes a pod
    (root in it, as this process is) can and cannot make; an engine attaches through it."""
    from offloadpool.pinning.attach import attach

    out: dict[str, Any] = {"publish": w.publish()}
    t = w.target()
    out["entries"] = sorted(os.listdir(t))
    out["mnt_entries"] = sorted(os.listdir(f"{t}/mnt"))
    out["pool_mnt"] = sorted(os.listdir(f"{w.root}/kv/mnt"))
    out["mounts"] = {
        os.path.relpath(m["target"], t) if m["target"] != t else ".": sorted(
            set(m["options"]) & {"ro", "rw", "nosuid", "nodev"}
        )
        for m in w.snapshot()["mounts"]
    }
    seg = f"{t}/mnt/{out['pool_mnt'][0]}"
    out["attempts"] = {
        "create in target": _try(lambda: open(f"{t}/x", "w").close()),
        "create in mnt": _try(lambda: open(f"{t}/mnt/x", "w").close()),
        "write manifest": _try(lambda: open(f"{t}/manifest.json", "r+").close()),
        "replace manifest": _try(lambda: os.rename(f"{t}/lease", f"{t}/manifest.json")),
        "write lease": _try(lambda: open(f"{t}/lease", "r+").close()),
        "unlink lease": _try(lambda: os.unlink(f"{t}/lease")),
        "unlink segment": _try(lambda: os.unlink(seg)),
        "rename segment": _try(lambda: os.rename(seg, f"{t}/mnt/y")),
        "mkdir in mnt": _try(lambda: os.mkdir(f"{t}/mnt/d")),
        "remove mnt": _try(lambda: os.rmdir(f"{t}/mnt")),
        "write segment": _try(lambda: os.pwrite(os.open(seg, os.O_RDWR), b"pod", 0)),
    }
    with open(f"{w.root}/kv/{out['pool_mnt'][0].join(['mnt/', ''])}", "rb") as fh:
        out["pool_reads"] = fh.read(3).decode()
    att = attach(t)
    out["attached"] = att.size
    att.close()
    return out


def _write(w: World, pool: str, pod: str, data: bytes) -> None:
    from offloadpool.csi import publication

    name = publication.engine_files(f"{w.root}/{pool}")[0]
    fd = os.open(f"{w.target(pod)}/mnt/{name}", os.O_RDWR)
    os.pwrite(fd, data, 0)
    os.close(fd)


def _read(w: World, pool: str, pod: str, n: int) -> str:
    from offloadpool.csi import publication

    name = publication.engine_files(f"{w.root}/{pool}")[0]
    fd = os.open(f"{w.target(pod)}/mnt/{name}", os.O_RDONLY)
    data = os.pread(fd, n, 0)
    os.close(fd)
    return data.hex() if data.strip(b"\0") == b"" else data.decode()


def _pod(pool: str, pod: str) -> dict[str, Any]:
    return {
        "volume_id": f"csi-{pool}-{pod[9:13]}",
        "target_path": None,
        "context": {"pool": pool, "csi.storage.k8s.io/pod.uid": pod},
    }


def scrub_on_new_holder(w: World) -> dict[str, Any]:
    """Per policy: pod A writes, A unpublished, B published: what B reads; B again (a retry)
    after writing; A and B at once (one tenancy)."""
    from offloadpool.region.files import record as records
    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.request import PoolRequest

    def pub(pool: str, pod: str) -> str:
        over = _pod(pool, pod)
        over["target_path"] = w.target(pod)
        return w.publish(**over)

    def unpub(pool: str, pod: str) -> str:
        return w.unpublish(_pod(pool, pod)["volume_id"], w.target(pod))

    out: dict[str, Any] = {}
    for policy in ("Always", "OnConsumerChange", "Never"):
        pool = f"kv-{policy.lower()}"
        provision(PoolRequest(name=pool, capacity=4 << 20, medium="Memory", scrub=policy), w.root)
        r: dict[str, Any] = {"a": pub(pool, POD)}
        _write(w, pool, POD, b"secret-of-a")
        r["unpublish_a"] = unpub(pool, POD)
        r["b"] = pub(pool, OTHER_POD)
        r["b_reads"] = _read(w, pool, OTHER_POD, 11)
        _write(w, pool, OTHER_POD, b"bytes-of-b!")
        r["b_again"] = pub(pool, OTHER_POD)  # the kubelet's retry: the same holder
        r["b_reads_again"] = _read(w, pool, OTHER_POD, 11)
        r["a_joins"] = pub(pool, POD)  # B still holds: one tenancy, nothing zeroed under B
        r["a_reads"] = _read(w, pool, POD, 11)
        rec = records.load(f"{w.root}/{pool}")
        assert rec is not None
        r["scrub_reason"] = rec.scrub.get("reason", "")
        r["holder"] = (rec.consumer or {}).get("holder")
        r["end"] = [unpub(pool, POD), unpub(pool, OTHER_POD)]
        out[policy] = r
    return out


def _spawn(w: World, stop_at: str = "") -> Any:
    """The plugin as its own process (``python3 -m offloadpool.csi``), stopping itself at
    ``stop_at``; the world's stubs talk to it."""
    import subprocess
    import time

    from offloadpool.csi.faults import STOP_AT_ENV

    if w.plugin is not None:
        w.stop()
        w.plugin = None
    env = {**os.environ, STOP_AT_ENV: stop_at}
    c = w.config
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadpool.csi", "--node-id", c.node_id, "--endpoint", c.endpoint]
        + ["--root", c.root, "--kubelet-dir", c.kubelet_dir, "--registration-endpoint", c.registration]
        + ["--stage", c.stage],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving ...": rebuilt, CSI served
    assert line.startswith("serving"), line
    channel = w.grpc.insecure_channel(f"unix://{c.endpoint}")
    w.node = w.stubs.NodeStub(channel)
    w.identity = w.stubs.IdentityStub(channel)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            w.identity.Probe(w.pb.ProbeRequest(), timeout=5)
            break
        except w.grpc.RpcError:
            time.sleep(0.1)
    proc.kept = line.rsplit(";", 1)[1].strip()  # type: ignore[attr-defined]
    return proc


def _kill_when_stopped(proc: Any, call: Any) -> str:
    """Run ``call`` (an RPC) while the plugin reaches its stop; kill -9 it there; the call's
    result (the kubelet sees the connection drop)."""
    import signal
    import threading
    import time

    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(call()))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.02)
    else:
        raise AssertionError("the plugin never reached its stop")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t.join(60)
    return result[0]


def _leftovers(w: World) -> dict[str, Any]:
    snap = w.snapshot()
    return {
        "mounts": sorted(os.path.relpath(m["target"], w.scratch) for m in snap["mounts"]),
        "records": [r["volume_id"] for r in snap["records"]],
        "target_dir": os.path.isdir(w.target()),
        "pool_mnt_mounts": sum(1 for line in open("/proc/self/mountinfo") if f" {w.root}/kv/mnt" in line),
    }


def faults(w: World) -> dict[str, Any]:
    """kill -9 of the plugin process at each step of a publish and an unpublish; then a new
    plugin (the DaemonSet's restart) and the kubelet's retry of the same call."""
    from offloadpool.region.holding import holders

    out: dict[str, Any] = {}
    for step in ("recorded", "staged", "bound"):
        proc = _spawn(w, step)
        r: dict[str, Any] = {"call": _kill_when_stopped(proc, w.publish), "left": _leftovers(w)}
        proc = _spawn(w)
        r["kept"] = proc.kept
        r["after_restart"] = _leftovers(w)
        r["retry"] = w.publish()
        r["after_retry"] = _leftovers(w)
        r["holders"] = holders.count(f"{w.root}/kv")
        r["unpublish"] = w.unpublish()
        r["end"] = _leftovers(w)
        proc.kill()
        proc.wait()
        out[f"publish/{step}"] = r
    proc = _spawn(w)
    r = {"publish": w.publish()}
    proc.kill()
    proc.wait()
    proc = _spawn(w, "unbound")
    r["call"] = _kill_when_stopped(proc, w.unpublish)
    r["left"] = _leftovers(w)
    proc = _spawn(w)
    r["kept"] = proc.kept
    r["after_restart"] = _leftovers(w)
    r["retry"] = w.unpublish()
    r["end"] = _leftovers(w)
    r["holders"] = holders.count(f"{w.root}/kv")
    proc.kill()
    proc.wait()
    out["unpublish/unbound"] = r
    return out


def scrub_fault(w: World) -> dict[str, Any]:
    """kill -9 while publish zeroes the memory for a new pod: the pool stays withheld until the
    agent's provision finishes the scrub; then the new pod gets zeros."""
    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.lifecycle.status import pool_state
    from offloadpool.region.request import PoolRequest

    req = PoolRequest(name="kv-always", capacity=4 << 20, medium="Memory", scrub="Always")
    provision(req, w.root)
    a, b = _pod("kv-always", POD), _pod("kv-always", OTHER_POD)
    a["target_path"], b["target_path"] = w.target(POD), w.target(OTHER_POD)
    proc = _spawn(w)
    out: dict[str, Any] = {"a": w.publish(**a)}
    _write(w, "kv-always", POD, b"secret-of-a")
    out["unpublish_a"] = w.unpublish(a["volume_id"], w.target(POD))
    proc.kill()
    proc.wait()
    proc = _spawn(w, "Scrubbing")
    out["call"] = _kill_when_stopped(proc, lambda: w.publish(**b))
    proc = _spawn(w)
    out["phase"] = pool_state(w.root, "kv-always").phase
    out["b_refused"] = w.publish(**b)
    provision(req, w.root)  # the agent's next pass finishes the pending scrub
    out["phase_after"] = pool_state(w.root, "kv-always").phase
    out["b"] = w.publish(**b)
    out["b_reads"] = _read(w, "kv-always", OTHER_POD, 11)
    out["end"] = w.unpublish(b["volume_id"], w.target(OTHER_POD))
    proc.kill()
    proc.wait()
    return out


def liveness(w: World) -> dict[str, Any]:
    """The DaemonSet's exec probe against the plugin in process, a spawned one, a killed one."""
    import subprocess

    def run() -> list[Any]:
        argv = [sys.executable, "-m", "offloadpool.csi", "probe", "--endpoint", w.config.endpoint]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return [done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1]]

    out: dict[str, Any] = {"serving": run()}
    proc = _spawn(w, "recorded")
    out["spawned"] = run()
    _kill_when_stopped(proc, w.publish)  # stopped mid-publish, then killed
    out["killed"] = run()
    return out


def namespace(w: World) -> dict[str, Any]:
    before = w.snapshot()
    result = w.publish(context={"csi.storage.k8s.io/pod.namespace": "team-c"})
    return {"result": result, "before": before, "after": w.snapshot()}


def unpublish(w: World) -> dict[str, Any]:
    from offloadpool.region.lifecycle.release import release

    before = w.snapshot()
    out: dict[str, Any] = {"publish": w.publish(), "published": w.snapshot()}
    out["unpublish"] = w.unpublish()
    out["after"] = w.snapshot()
    out["again"] = w.unpublish()
    out["unknown"] = w.unpublish(volume="csi-unknown")
    out["before"] = before
    out["count_after"] = __import__("offloadpool.region.holding.holders").region.holding.holders.count(
        f"{w.root}/kv"
    )
    out["release"] = release(w.root, "kv").existed
    return out


def restart(w: World) -> dict[str, Any]:
    from offloadpool.region.holding import published

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


def _shares_seen(w: World) -> dict[str, str]:
    from offloadpool.region.holding import shares

    return {str(s.index): s.holder if s.claimed else "" for s in shares.states(Path(f"{w.root}/kvs"), 2)}


def _view(w: World, pod: str) -> dict[str, Any]:
    t = w.target(pod)
    return {"entries": sorted(os.listdir(t)), "mnt": sorted(os.listdir(f"{t}/mnt"))}


def shares(w: World) -> dict[str, Any]:
    """A pool of two shares through csi volumes and hostPath engines at once: each pod is given
    a share of its own and sees only it, as a plain pool; a retry keeps it; a hostPath engine's
    claim never takes a reserved share, nor a publish an engine's; all taken: refused naming
    the holders; a plugin restart makes the reservations again; unpublish frees the share."""
    from offloadpool.pinning.attach import attach
    from offloadpool.region.holding import published, shares
    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.request import PoolRequest

    pool = Path(f"{w.root}/kvs")
    provision(PoolRequest(name="kvs", capacity=4 << 20, medium="Memory", partitions=2), w.root)
    a = {"volume_id": "csi-aaaa", "context": {"pool": "kvs"}}
    b = {
        "volume_id": "csi-bbbb",
        "target_path": w.target(OTHER_POD),
        "context": {"pool": "kvs", "csi.storage.k8s.io/pod.uid": OTHER_POD},
    }
    out: dict[str, Any] = {"a": w.publish(**a)}
    out["a_view"] = _view(w, POD)
    out["a_again"] = w.publish(**a)
    out["a_mounts"] = len([m for m in w.snapshot()["mounts"] if m["target"] == w.target(POD)])
    att = attach(w.target(POD))
    out["a_attached"] = {"size": att.size, "share": att.share, "shares": att.manifest.shares}
    view = att.memoryview()
    view[:] = b"A" * len(view)
    del view
    out["engine_claim"] = None
    claim = shares.claim(pool, 2, owner="engine-x")
    out["engine_claim"] = claim.index
    out["seen_full"] = _shares_seen(w)
    out["b_full"] = w.publish(**b)
    out["b_full_records"] = sorted(p.volume_id for p in published.load_all(pool))
    try:
        shares.claim(pool, 2, owner="engine-y", timeout=5)
        out["engine_y"] = "claimed"
    except shares.ShareRefused as exc:
        out["engine_y"] = str(exc)
    claim.close()
    out["b"] = w.publish(**b)
    out["b_view"] = _view(w, OTHER_POD)
    att_b = attach(w.target(OTHER_POD))
    out["b_reads"] = bytes(att_b.memoryview()[:4]).hex()
    att_b.close()
    att.close()
    out["records"] = {p.volume_id: p.share for p in published.load_all(pool)}
    out["reserved"] = {str(k): v for k, v in shares.reservations(pool, 2).items()}
    w.stop()
    # a plugin killed between unreserving and dropping a record, and one killed between
    # reserving and recording: the reservations disagree with the records
    a_share = out["records"]["csi-aaaa"]
    os.unlink(f"{pool}/shares/{a_share}/csi")
    out["kept"] = sorted(w.start())
    out["reserved_after_restart"] = {str(k): v for k, v in shares.reservations(pool, 2).items()}
    out["unpublish_a"] = w.unpublish(volume="csi-aaaa")
    out["seen_after_a"] = _shares_seen(w)
    again = shares.claim(pool, 2, owner="engine-x")
    out["engine_after_a"] = again.index
    again.close()
    out["unpublish_b"] = w.unpublish(volume="csi-bbbb", target=w.target(OTHER_POD))
    out["end"] = {"mounts": w.snapshot()["mounts"], "records": published.load_all(pool) == []}
    out["end_reserved"] = shares.reservations(pool, 2) == {}
    return out


THIRD_POD = "0f8e1c2a-3333-4222-8333-444455556666"


def _share_io(w: World, pod: str, data: bytes | None = None, n: int = 12) -> str:
    """Write ``data`` at the start of the pod's share (its target's first file), or read ``n``
    bytes there (hex when all zero)."""
    t = w.target(pod)
    name = sorted(os.listdir(f"{t}/mnt"))[0]
    fd = os.open(f"{t}/mnt/{name}", os.O_RDWR)
    try:
        if data is not None:
            os.pwrite(fd, data, 0)
            return "written"
        got = os.pread(fd, n, 0)
    finally:
        os.close(fd)
    return got.hex() if got.strip(b"\0") == b"" else got.decode(errors="replace")


def _share_pub(w: World, pool: str, pod: str) -> dict[str, Any]:
    os.makedirs(os.path.dirname(w.target(pod)), exist_ok=True)
    return {
        "volume_id": f"csi-{pool}-{pod[9:13]}",
        "target_path": w.target(pod),
        "context": {"pool": pool, "csi.storage.k8s.io/pod.uid": pod},
    }


def _share_of(w: World, pool: str, pod: str) -> int | None:
    from offloadpool.region.holding import published

    found = [p.share for p in published.load_all(f"{w.root}/{pool}") if p.pod_uid == pod]
    return found[0] if found else None


def share_scrub(w: World) -> dict[str, Any]:
    """``scrub: Always`` per share of a two-share pool: pod A writes its share and leaves while
    pod C holds the other share; pod B is given A's share and reads zeros, C's bytes untouched;
    B's retry keeps B's bytes; a hostPath engine's claim of the share is a holder too."""
    from offloadpool.region.files import record as records
    from offloadpool.region.holding import shares
    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.request import PoolRequest

    pool = "kvs-always"
    provision(PoolRequest(name=pool, capacity=4 << 20, medium="Memory", partitions=2, scrub="Always"), w.root)
    a, b, c = (_share_pub(w, pool, p) for p in (POD, OTHER_POD, THIRD_POD))
    out: dict[str, Any] = {"a": w.publish(**a), "c": w.publish(**c)}
    out["a_share"], out["c_share"] = _share_of(w, pool, POD), _share_of(w, pool, THIRD_POD)
    _share_io(w, POD, b"secret-of-a!")
    _share_io(w, THIRD_POD, b"secret-of-c!")
    out["unpublish_a"] = w.unpublish(a["volume_id"], w.target(POD))
    out["b"] = w.publish(**b)  # C still holds the other share: the pool is never free
    out["b_share"] = _share_of(w, pool, OTHER_POD)
    out["b_reads"] = _share_io(w, OTHER_POD)
    out["c_reads"] = _share_io(w, THIRD_POD)
    rec = records.load(f"{w.root}/{pool}")
    assert rec is not None
    out["scrub"] = {k: rec.scrub.get(k) for k in ("reason", "share")}
    _share_io(w, OTHER_POD, b"bytes-of-b!!")
    out["b_again"] = w.publish(**b)  # the kubelet's retry: the same holder, nothing zeroed
    out["b_reads_again"] = _share_io(w, OTHER_POD)
    out["unpublish_b"] = w.unpublish(b["volume_id"], w.target(OTHER_POD))
    # a hostPath engine claims the free share, writes and exits; pod A is given it next
    claim = shares.claim(Path(f"{w.root}/{pool}"), 2, owner="engine-x")
    out["engine_share"] = claim.index
    name = sorted(n for n in os.listdir(f"{w.root}/{pool}/mnt") if n.startswith(f"p{claim.index}-"))[0]
    fd = os.open(f"{w.root}/{pool}/mnt/{name}", os.O_RDWR)
    os.pwrite(fd, b"engine-bytes", 0)
    os.close(fd)
    claim.close()
    out["a_again"] = w.publish(**a)
    out["a_again_share"] = _share_of(w, pool, POD)
    out["a_reads"] = _share_io(w, POD)
    out["c_reads_end"] = _share_io(w, THIRD_POD)
    out["end"] = [
        w.unpublish(a["volume_id"], w.target(POD)),
        w.unpublish(c["volume_id"], w.target(THIRD_POD)),
    ]
    return out


def share_scrub_fault(w: World) -> dict[str, Any]:
    """kill -9 while publish zeroes one share for a new pod: that share stays withheld (its
    manifest gone, its files root's, the record pending) while the pool stays Ready and the
    other share's pod keeps its bytes; the kubelet's retry finishes the zeroing."""
    from offloadpool.region.files import record as records
    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.lifecycle.status import pool_state
    from offloadpool.region.request import PoolRequest

    pool = "kvs-always"
    req = PoolRequest(name=pool, capacity=4 << 20, medium="Memory", partitions=2, scrub="Always")
    provision(req, w.root)
    a, b, c = (_share_pub(w, pool, p) for p in (POD, OTHER_POD, THIRD_POD))
    proc = _spawn(w)
    out: dict[str, Any] = {"a": w.publish(**a), "c": w.publish(**c)}
    share = _share_of(w, pool, POD)
    _share_io(w, POD, b"secret-of-a!")
    _share_io(w, THIRD_POD, b"secret-of-c!")
    out["unpublish_a"] = w.unpublish(a["volume_id"], w.target(POD))
    proc.kill()
    proc.wait()
    proc = _spawn(w, "Scrubbing")
    out["call"] = _kill_when_stopped(proc, lambda: w.publish(**b))
    proc = _spawn(w)
    rec = records.load(f"{w.root}/{pool}")
    assert rec is not None
    out["pending"] = bool(rec.shares.get(str(share), {}).get("pending"))
    out["phase"] = pool_state(w.root, pool).phase
    sdir = f"{w.root}/{pool}/shares/{share}"
    out["share_manifest"] = os.path.exists(f"{sdir}/manifest.json")
    mnt = f"{w.root}/{pool}/mnt"
    out["modes"] = sorted(
        {oct(os.stat(f"{mnt}/{n}").st_mode & 0o777) for n in os.listdir(mnt) if n.startswith(f"p{share}-")}
    )
    out["c_reads"] = _share_io(w, THIRD_POD)
    provision(req, w.root)  # the agent's pass in between: the share is still held by nobody: done
    rec = records.load(f"{w.root}/{pool}")
    assert rec is not None
    out["pending_after_provision"] = bool(rec.shares.get(str(share), {}).get("pending"))
    out["b"] = w.publish(**b)
    out["b_share"] = _share_of(w, pool, OTHER_POD)
    out["b_reads"] = _share_io(w, OTHER_POD)
    out["c_reads_end"] = _share_io(w, THIRD_POD)
    out["end"] = [
        w.unpublish(b["volume_id"], w.target(OTHER_POD)),
        w.unpublish(c["volume_id"], w.target(THIRD_POD)),
    ]
    proc.kill()
    proc.wait()
    return out


def deleting(w: World) -> dict[str, Any]:
    """The agent's note that the pool is being deleted: a new volume is refused
    FAILED_PRECONDITION naming the deletion; the volume given before keeps working and is
    unpublished as ever."""
    out: dict[str, Any] = {"a": w.publish()}
    _write(w, "kv", POD, b"still-here")
    # the agent's note as it writes it (tests/test_agent_process.py shows the agent writing it)
    state = Path(f"{w.root}/.state/kv/state.json")
    rec = json.loads(state.read_text())
    rec["deleting"] = "its OffloadPool was deleted; the node is draining it for release"
    state.write_text(json.dumps(rec))
    out["marked"] = True
    b = _pod("kv", OTHER_POD)
    b["target_path"] = w.target(OTHER_POD)
    out["b"] = w.publish(**b)
    out["a_again"] = w.publish()  # the kubelet's retry of the volume given before
    out["a_reads"] = _read(w, "kv", POD, 10)
    out["after"] = w.snapshot()["records"]
    out["unpublish_a"] = w.unpublish()
    out["end"] = w.snapshot()
    return out


def locks(w: World) -> dict[str, Any]:
    """No publish waits on a lock a pod can take, nor on another pool's lock: a consumer's
    flock on a partitioned pool's ``shares`` directory, and a publish of pool ``kv`` stuck
    behind kv's lock (a provision, a scrub or a release holds it), leave a publish of ``kv2``
    as fast as ever."""
    import fcntl
    import threading
    import time

    from offloadpool.region.lifecycle.provision import provision
    from offloadpool.region.request import PoolRequest

    try:
        from offloadpool.region.files.handle import open_pool

        def pool_lock(pool: str) -> Any:
            return open_pool(pool, lock=True)
    except ImportError:  # a commit before the pool handle (hack/against.py): the same lock, as it was
        from offloadpool.region.places import lock as pool_lock

    provision(PoolRequest(name="kv2", capacity=4 << 20, medium="Memory", partitions=2), w.root)
    other = {
        "volume_id": "csi-kv2",
        "target_path": w.target(OTHER_POD),
        "context": {"pool": "kv2", "csi.storage.k8s.io/pod.uid": OTHER_POD},
    }
    out: dict[str, Any] = {}
    fd = os.open(f"{w.root}/kv2/shares", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a consumer of kv2 holding the engines' claim mutex
    held, release_kv = threading.Event(), threading.Event()

    def hold_kv() -> None:  # the agent provisioning (or scrubbing) kv meanwhile
        with pool_lock(f"{w.root}/kv"):
            held.set()
            release_kv.wait(20)

    holder = threading.Thread(target=hold_kv)
    holder.start()
    held.wait(10)
    stuck: dict[str, str] = {}
    kv = threading.Thread(target=lambda: stuck.setdefault("kv", w.publish()))
    kv.start()
    time.sleep(0.5)  # kv's publish is waiting for kv's lock now
    t0 = time.monotonic()
    out["kv2"] = w.publish(**other)
    out["kv2_seconds"] = time.monotonic() - t0
    out["kv_while_held"] = stuck.get("kv", "waiting")
    release_kv.set()
    holder.join(30)
    kv.join(30)
    out["kv"] = stuck.get("kv", "waiting")
    os.close(fd)
    out["unpublish_kv2"] = w.unpublish(other["volume_id"], w.target(OTHER_POD))
    out["unpublish_kv"] = w.unpublish()
    return out


def main() -> None:
    scratch, scenario = sys.argv[1], sys.argv[2]
    lock_down(scratch)
    world = World(scratch)
    try:
        result = globals()[scenario](world)
    finally:
        if world.plugin is not None:
            world.stop()
    print(json.dumps(result))
