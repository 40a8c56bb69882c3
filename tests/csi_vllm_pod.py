"""A stock vLLM 0.33.0 pod on a compat pool delivered through CSI, run by
tests/test_csi_vllm_compat.py in a mount namespace of its own where every mount but a scratch
tmpfs is read-only (``csi_scenarios.lock_down``). Prints one JSON line.

Each part is the real one, or does what the real one does with the same system calls:

- the node: the pool provisioned from an ``OffloadPool`` (``api.pool_request``, as the agent
  does) under a root on the scratch tmpfs;
- the webhook: ``admission.mutate`` of a labelled pod, whose volumes and mounts are used as
  they come out;
- the kubelet: ``NodePublishVolume`` of the pod's inline ``csi`` volume over the plugin's unix
  socket, with the volume handle, context and target path the kubelet's csi driver makes; then
  each ``subPath`` mount as ``pkg/volume/util/subpath`` (``doBindSubPath``) makes it: the
  subPath joined to the volume's path, opened one component at a time below it
  (``O_PATH|O_NOFOLLOW``), and ``/proc/<pid>/fd/<fd>`` bind-mounted onto a new file
  ``<pod>/volume-subpaths/<volume>/<container>/<index>`` (a subPath that does not exist is a
  directory the kubelet makes there first, ``SafeMakeDir``);
- the container runtime: the engine (tests/vllm_workers/stock_engine.py) in a mount namespace
  copied from this one, with a tmpfs of its own on /dev/shm and each subPath bind bound onto a
  file made there (runc's bind of a file mount);
- at the end, the kubelet's teardown: ``CleanSubPaths`` (unmount, remove), then
  ``NodeUnpublishVolume``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Any

from csi_scenarios import lock_down

POD_UID = "5c1d2e3f-1111-4222-8333-444455556666"
POD_NAME = "vllm-0"
NAMESPACE = "team-a"
CONTAINER = "vllm"
ENGINE_ID = "llama-tp2"
TESTS = os.path.dirname(os.path.abspath(__file__))
MS_BIND = 0x1000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def pool_object(capacity: str) -> dict[str, Any]:
    return {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPool",
        "metadata": {"name": "kv"},
        "spec": {
            "capacity": capacity,
            "medium": "Memory",
            "compat": {"vllm": {"engineId": ENGINE_ID, "rowSize": "512Ki", "numSegments": 32}},
            "consumers": {"namespaces": [NAMESPACE], "delivery": "CSI"},
        },
    }


def admitted_pod(pool: dict[str, Any]) -> dict[str, Any]:
    from offloadpool.api.pods import POD_POOL_LABEL
    from offloadpool.operator import admission

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD_NAME, "namespace": NAMESPACE, "labels": {POD_POOL_LABEL: "kv"}},
        "spec": {"containers": [{"name": CONTAINER, "image": "vllm/vllm-openai:v0.33.0"}]},
    }
    return admission.mutate(pod, pool, admission.InjectionSettings())


def safe_open(base: str, sub: str) -> int:
    """The kubelet's ``doSafeOpen``: ``base`` opened without following a link, then each
    component of ``sub`` below it with ``O_PATH|O_NOFOLLOW``, a link refused."""
    fd = os.open(base, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    for seg in sub.split("/"):
        try:
            child = os.open(seg, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        if stat.S_ISLNK(os.fstat(child).st_mode):
            os.close(child)
            raise OSError(f"unexpected symlink found {seg}")
        fd = child
    return fd


class Node:
    """The scratch node: the pool, the plugin serving on its socket, the kubelet's directory."""

    def __init__(self, scratch: str, capacity: str) -> None:
        import grpc

        from offloadpool.api import pool_request
        from offloadpool.csi.config import CsiConfig
        from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc
        from offloadpool.csi.server import serve
        from offloadpool.region.lifecycle.provision import provision

        self.scratch = scratch
        self.root = f"{scratch}/root"
        self.kubelet = f"{scratch}/kubelet"
        os.makedirs(self.root)
        self.pool = pool_object(capacity)
        self.result = provision(pool_request(self.pool), self.root)
        self.pool_dir = f"{self.root}/kv"
        self.config = CsiConfig(
            node_id="node-a",
            endpoint=f"{scratch}/plugin/csi.sock",
            root=self.root,
            kubelet_dir=self.kubelet,
            registration=f"{scratch}/reg/r.sock",
            stage=f"{scratch}/stage",
        )
        self.plugin = serve(self.config)
        self.pb = csi_pb2
        self.grpc = grpc
        self.node = csi_pb2_grpc.NodeStub(grpc.insecure_channel(f"unix://{self.config.endpoint}"))
        self.pod_dir = f"{self.kubelet}/pods/{POD_UID}"

    def call(self, method: Any, request: Any) -> str:
        try:
            method(request, timeout=60)
            return "OK"
        except self.grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    # -- the kubelet ------------------------------------------------------------------------
    def csi_volume(self, pod: dict[str, Any]) -> dict[str, Any]:
        (volume,) = [v for v in pod["spec"]["volumes"] if "csi" in v]
        return volume

    def target(self, volume: str) -> str:
        return f"{self.pod_dir}/volumes/kubernetes.io~csi/{volume}/mount"

    def publish(self, pod: dict[str, Any]) -> str:
        """What the kubelet's csi driver sends for an inline ephemeral volume of the pod."""
        volume = self.csi_volume(pod)
        os.makedirs(os.path.dirname(self.target(volume["name"])), exist_ok=True)
        context = {
            **volume["csi"]["volumeAttributes"],
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.name": POD_NAME,
            "csi.storage.k8s.io/pod.namespace": NAMESPACE,
            "csi.storage.k8s.io/pod.uid": POD_UID,
            "csi.storage.k8s.io/serviceAccount.name": "default",
        }
        request = self.pb.NodePublishVolumeRequest(
            volume_id=self.volume_handle(volume["name"]),
            target_path=self.target(volume["name"]),
            volume_context=context,
            volume_capability=self.pb.VolumeCapability(mount=self.pb.VolumeCapability.MountVolume()),
        )
        return self.call(self.node.NodePublishVolume, request)

    def unpublish(self, pod: dict[str, Any]) -> str:
        name = self.csi_volume(pod)["name"]
        request = self.pb.NodeUnpublishVolumeRequest(
            volume_id=self.volume_handle(name), target_path=self.target(name)
        )
        return self.call(self.node.NodeUnpublishVolume, request)

    @staticmethod
    def volume_handle(volume: str) -> str:
        """The kubelet's handle of an inline volume: ``csi-`` and sha256(pod uid + name)."""
        return "csi-" + hashlib.sha256(f"{POD_UID}{volume}".encode()).hexdigest()

    def subpath_binds(self, pod: dict[str, Any], *, with_subpaths: bool) -> list[list[str]]:
        """Each subPath mount of the container made as the kubelet makes it; the (host path,
        container path) pairs the runtime then binds. ``with_subpaths`` False: the container
        without its subPath mounts (what the engine does when they are missing)."""
        (container,) = pod["spec"]["containers"]
        volume = self.csi_volume(pod)["name"]
        out = []
        for index, mount in enumerate(container["volumeMounts"]):
            sub = mount.get("subPath")
            if mount["name"] != volume or not sub or not with_subpaths:
                continue
            base = os.path.realpath(self.target(volume))
            path = os.path.realpath(os.path.join(base, sub))
            if os.path.commonpath([base, path]) != base:
                raise AssertionError(f"subpath {path} not within volume path {base}")
            if not os.path.lexists(path):  # SafeMakeDir, as makeMounts does
                os.makedirs(path, 0o750)
            fd = safe_open(base, os.path.relpath(path, base))
            try:
                bind = f"{self.pod_dir}/volume-subpaths/{volume}/{CONTAINER}/{index}"
                os.makedirs(os.path.dirname(bind), 0o750, exist_ok=True)
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    os.mkdir(bind, 0o750)
                else:
                    with open(bind, "wb") as fh:
                        os.fchmod(fh.fileno(), 0o640)
                source = f"/proc/{os.getpid()}/fd/{fd}"
                if _libc.mount(source.encode(), bind.encode(), None, MS_BIND, None) != 0:
                    raise OSError(ctypes.get_errno(), f"mount {source} {bind}")
            finally:
                os.close(fd)
            out.append([bind, mount["mountPath"]])
        return out

    def clean_subpaths(self, pod: dict[str, Any]) -> None:
        """The kubelet's ``CleanSubPaths`` at the pod's teardown, before the unpublish."""
        top = f"{self.pod_dir}/volume-subpaths/{self.csi_volume(pod)['name']}"
        if not os.path.isdir(top):
            return
        for container in os.listdir(top):
            for entry in os.listdir(f"{top}/{container}"):
                path = f"{top}/{container}/{entry}"
                if _libc.umount2(path.encode(), 0) != 0:
                    raise OSError(ctypes.get_errno(), f"umount {path}")
                os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
            os.rmdir(f"{top}/{container}")
        os.rmdir(top)
        os.rmdir(os.path.dirname(top))

    # -- what the host sees -----------------------------------------------------------------
    def pool_files(self) -> list[str]:
        return [f"{self.pool_dir}/{s.file}" for s in self.result.manifest.regions[0].segments]

    def identity(self) -> list[list[int]]:
        return [[os.stat(f).st_ino, os.stat(f).st_size, os.stat(f).st_nlink] for f in self.pool_files()]

    def usage(self) -> int:
        st = os.statvfs(f"{self.pool_dir}/mnt")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def read(self, offsets: list[int]) -> list[int]:
        out = {}
        for seg in self.result.manifest.regions[0].segments:
            with open(f"{self.pool_dir}/{seg.file}", "rb") as fh:
                for off in offsets:
                    if seg.offset <= off < seg.offset + seg.bytes:
                        fh.seek(off - seg.offset)
                        out[off] = fh.read(1)[0]
        return [out[o] for o in offsets]

    def write(self, marks: dict[int, int]) -> None:
        for seg in self.result.manifest.regions[0].segments:
            fd = os.open(f"{self.pool_dir}/{seg.file}", os.O_RDWR)
            for off, value in marks.items():
                if seg.offset <= off < seg.offset + seg.bytes:
                    os.pwrite(fd, bytes([value]), off - seg.offset)
            os.close(fd)

    def holding(self) -> dict[str, Any]:
        from offloadpool.region.holding import holders
        from offloadpool.region.holding.lease import LeaseHeld
        from offloadpool.region.lifecycle.release import release

        held = holders.find_holders(self.pool_dir)
        try:
            release(self.root, "kv")
            released = "released"
        except LeaseHeld as exc:
            released = f"held: {exc}"
        return {
            "count": holders.count(self.pool_dir),
            "mapped_pids": sorted(h.pid for h in held if h.mapped),
            "volumes": [v.volume_id for v in holders.csi_holders(self.pool_dir)],
            "release": released,
        }

    def mounts_under_scratch(self) -> list[str]:
        """Every mount under the scratch directory but the plugin's own staging tmpfs."""
        out = []
        for line in open("/proc/self/mountinfo").read().splitlines():
            target = line.split()[4].encode().decode("unicode_escape")
            if target.startswith(self.scratch + "/") and target != self.config.stage:
                out.append(os.path.relpath(target, self.scratch))
        return sorted(out)


def run_engine(node: Node, cfg: dict[str, Any], engine: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The engine in a mount namespace copied from the node's (the container's), held attached
    until the host has looked at it; (the engine's JSON, what the host saw)."""
    hold_dir = f"{node.scratch}/hold"
    os.makedirs(hold_dir)
    cfg = {**cfg, "hold_dir": hold_dir}
    argv = ["unshare", "--mount", "--propagation", "private", engine["python"]]
    argv += [f"{TESTS}/vllm_workers/stock_engine.py", json.dumps(cfg)]
    done: dict[str, Any] = {}

    def run() -> None:
        done["proc"] = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=engine["env"])

    t = threading.Thread(target=run)
    t.start()
    seen: Any = None
    try:
        deadline = time.monotonic() + 300
        while len([n for n in os.listdir(hold_dir) if n.startswith("ready.")]) < cfg["world_size"]:
            if not t.is_alive() or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        else:
            pids = sorted(int(open(f"{hold_dir}/{n}").read()) for n in os.listdir(hold_dir) if "." in n)
            seen = {"pids": pids, **node.holding()}
    finally:
        open(f"{hold_dir}/go", "w").close()
        t.join()
    proc = done["proc"]
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(
            f"stock_engine.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1]), seen


def main() -> None:
    scratch, spec = sys.argv[1], json.loads(sys.argv[2])
    lock_down(scratch)
    node = Node(scratch, spec["capacity"])
    out: dict[str, Any] = {}
    try:
        pod = admitted_pod(node.pool)
        out["volume"] = node.csi_volume(pod)
        out["mounts"] = pod["spec"]["containers"][0]["volumeMounts"]
        marks = {int(k): v for k, v in spec["marks"].items()}
        node.write(marks)
        out["before"] = {"identity": node.identity(), "usage": node.usage()}
        out["publish"] = node.publish(pod)
        binds = node.subpath_binds(pod, with_subpaths=spec["subpaths"])
        out["binds"] = binds
        total = node.result.manifest.total_bytes
        cfg = {
            "mounts": binds,
            "shm_size": total + (64 << 20),
            "engine_id": ENGINE_ID,
            "world_size": 2,
            "worker_kv_bytes_per_block": 256 << 10,
            "cpu_bytes_to_use": total,
            "read_offsets": list(marks),
            "own_shm": True,
        }
        out["run"], out["held"] = run_engine(node, cfg, spec["engine"])
        out["after"] = {"identity": node.identity(), "usage": node.usage()}
        row = 512 << 10
        last = (total // row - 1) * row
        out["pool_reads"] = node.read([0, 256 << 10, last, last + (256 << 10)])
        out["exited"] = node.holding()  # the engine gone, the pod's volume still published
        node.clean_subpaths(pod)
        out["unpublish"] = node.unpublish(pod)
        out["unpublished"] = node.holding()
        out["left"] = node.mounts_under_scratch()
        out["pool_dir_left"] = os.path.exists(node.pool_dir)
    finally:
        node.plugin.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
