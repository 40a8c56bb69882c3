"""Scenarios of the DRA kubelet plugin, each run by tests/test_dra_plugin.py in a mount namespace of
its own where every mount but a scratch tmpfs is read-only (as tests/csi_scenarios.py's): real
gRPC over a real unix socket, real bind mounts, the claims read from the real API server (their
allocations written there by the test, as the scheduler writes them). Prints one JSON line.

argv: scratch, scenario, the kubeconfig, then a JSON object of the claims {label: [namespace,
name, uid]} and "consumer": [the pool's one consumer namespace]."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from csi_scenarios import _kill_when_stopped, lock_down

NODE = "node-a"


class World:
    def __init__(self, scratch: str, kubeconfig: str, consumer: str) -> None:
        import grpc

        from offloadpool.dra.config import DraConfig
        from offloadpool.dra.proto import dra_pb2, dra_pb2_grpc
        from offloadpool.region.lifecycle.provision import provision
        from offloadpool.region.request import PoolRequest

        self.scratch = scratch
        self.root = f"{scratch}/root"
        self.kubelet = f"{scratch}/kubelet"
        os.makedirs(self.root)
        os.makedirs(f"{self.kubelet}/plugins_registry")
        provision(
            PoolRequest(
                name="kv", capacity=8 << 20, medium="Memory", partitions=4, consumer_namespaces=consumer
            ),
            self.root,
        )
        provision(PoolRequest(name="whole", capacity=4 << 20, medium="Memory"), self.root)
        self.config = DraConfig(
            node_id=NODE,
            endpoint=f"{scratch}/plugin/dra.sock",
            registration=f"{scratch}/reg/r.sock",
            root=self.root,
            kubelet_dir=self.kubelet,
            cdi_dir=f"{scratch}/cdi",
            stage=f"{scratch}/stage",
            kubeconfig=kubeconfig,
        )
        self.grpc, self.pb, self.stubs = grpc, dra_pb2, dra_pb2_grpc
        self.plugin: Any = None
        self.start()

    def start(self) -> list[str]:
        from offloadpool.csi.proto import pluginregistration_pb2_grpc
        from offloadpool.dra.server import api_client, serve

        self.plugin = serve(self.config, api_client(self.config))
        self.dra = self.stubs.DRAPluginStub(self.grpc.insecure_channel(f"unix://{self.config.endpoint}"))
        reg = self.grpc.insecure_channel(f"unix://{self.config.registration}")
        self.registration = pluginregistration_pb2_grpc.RegistrationStub(reg)
        return [p.volume_id for p in self.plugin.kept]

    def stop(self) -> None:
        self.plugin.stop()

    def prepare(self, *claims: list[str]) -> dict[str, Any]:
        req = self.pb.NodePrepareResourcesRequest(
            claims=[self.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        out = self.dra.NodePrepareResources(req, timeout=60)
        return {
            uid: {
                "error": answer.error,
                "devices": [
                    {
                        "requests": list(d.request_names),
                        "pool": d.pool_name,
                        "device": d.device_name,
                        "cdi": list(d.cdi_device_ids),
                    }
                    for d in answer.devices
                ],
            }
            for uid, answer in out.claims.items()
        }

    def unprepare(self, *claims: list[str]) -> dict[str, str]:
        req = self.pb.NodeUnprepareResourcesRequest(
            claims=[self.pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        out = self.dra.NodeUnprepareResources(req, timeout=60)
        return {uid: answer.error for uid, answer in out.claims.items()}

    def snapshot(self) -> dict[str, Any]:
        """Mounts in the kubelet's tree, the records and reservations, the CDI specs."""
        from offloadpool.region.holding import published, shares

        mounts = []
        for line in open("/proc/self/mountinfo").read().splitlines():
            f = line.split()
            target = f[4].encode().decode("unicode_escape")
            if target.startswith(self.kubelet):
                mounts.append({"target": os.path.relpath(target, self.kubelet), "options": f[5].split(",")})
        try:
            specs = {
                n: json.load(open(f"{self.config.cdi_dir}/{n}"))
                for n in sorted(os.listdir(self.config.cdi_dir))
            }
        except FileNotFoundError:
            specs = {}
        return {
            "mounts": mounts,
            "records": {
                pool: [vars(p) for p in published.load_all(f"{self.root}/{pool}")] for pool in ("kv", "whole")
            },
            "reservations": {str(k): v for k, v in shares.reservations(f"{self.root}/kv", 4).items()},
            "specs": specs,
        }


def lifecycle(w: World, claims: dict[str, list[str]]) -> dict[str, Any]:
    """Prepare a share and the whole pool, again (the kubelet's retry), refusals, a CSI plugin's
    and a DRA plugin's restart, an engine over hostPath next to the claim, unprepare twice."""
    from offloadpool.csi.config import CsiConfig
    from offloadpool.csi.publication import rebuild as csi_rebuild
    from offloadpool.region.holding import shares

    out: dict[str, Any] = {}
    out["first"] = w.prepare(claims["a"], claims["whole"])
    out["after_first"] = w.snapshot()
    # what the runtime is handed: the tree, whole, at the CDI mount's source
    mount = out["after_first"]["specs"][f"offloadpool.io-{claims['a'][2]}.json"]["devices"][0][
        "containerEdits"
    ]["mounts"][0]
    out["tree"] = sorted(os.listdir(mount["hostPath"])) + sorted(os.listdir(f"{mount['hostPath']}/mnt"))
    out["again"] = w.prepare(claims["a"])
    out["after_again"] = w.snapshot()
    out["refused"] = w.prepare(
        claims["other_ns"], claims["same_share"], claims["wrong_uid"], claims["missing"]
    )
    out["after_refused"] = w.snapshot()
    # an engine over hostPath takes a share first come: never the claim's
    engine = shares.claim(f"{w.root}/kv", 4, owner="hostpath-pod")
    out["engine_share"] = engine.index
    engine.close()
    # the CSI plugin's restart settles its own records only: the claim's record and share stay
    csi_rebuild(
        CsiConfig(
            node_id=NODE,
            endpoint=f"{w.scratch}/csi/c.sock",
            root=w.root,
            kubelet_dir=w.kubelet,
            registration=f"{w.scratch}/csi/r.sock",
            stage=f"{w.scratch}/stage",
        )
    )
    out["after_csi_rebuild"] = w.snapshot()
    w.stop()
    out["kept"] = w.start()
    out["after_restart"] = w.snapshot()
    out["unprepare"] = w.unprepare(claims["a"], claims["whole"])
    out["after_unprepare"] = w.snapshot()
    out["unprepare_again"] = w.unprepare(claims["a"])
    info = w.registration.GetInfo(
        __import__("offloadpool.csi.proto.pluginregistration_pb2", fromlist=["x"]).InfoRequest(), timeout=30
    )
    out["registration"] = {
        "type": info.type,
        "name": info.name,
        "endpoint": info.endpoint,
        "versions": list(info.supported_versions),
    }
    return out


#: every plugin process a scenario started: killed at its end, whatever happened
_SPAWNED: list[Any] = []


def _spawn(w: World, stop_at: str = "") -> Any:
    """The plugin as its own process (``python3 -m offloadpool.dra``), stopping itself at
    ``stop_at`` (``csi.faults``); the world's stub talks to it. Its ``kept``: the claims its
    rebuild kept."""
    import subprocess

    from offloadpool.csi.faults import STOP_AT_ENV

    if w.plugin is not None:
        w.stop()
        w.plugin = None
    c = w.config
    argv = [sys.executable, "-m", "offloadpool.dra", "--node-id", c.node_id, "--endpoint", c.endpoint]
    argv += ["--registration-endpoint", c.registration, "--root", c.root, "--kubelet-dir", c.kubelet_dir]
    argv += ["--cdi-dir", c.cdi_dir, "--stage", c.stage, "--kubeconfig", c.kubeconfig]
    log = f"{w.scratch}/plugin-{len(_SPAWNED)}.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            argv, env={**os.environ, STOP_AT_ENV: stop_at}, stdout=subprocess.PIPE, stderr=err, text=True
        )
    _SPAWNED.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "serving ...; N prepared claims": rebuilt, dra.v1 served
    assert line.startswith("serving"), open(log).read()[-2000:]
    w.dra = w.stubs.DRAPluginStub(w.grpc.insecure_channel(f"unix://{c.endpoint}"))
    proc.kept = int(line.rsplit(";", 1)[1].split()[0])  # type: ignore[attr-defined]
    return proc


def _end(proc: Any) -> None:
    proc.kill()
    proc.wait()


def _answer(w: World, call: Any) -> Any:
    """The call's answer, or the gRPC code the kubelet sees (the plugin killed mid-call)."""
    try:
        return call()
    except w.grpc.RpcError as exc:
        return exc.code().name


def _state(w: World) -> dict[str, Any]:
    """What the node holds of the claims: ``snapshot`` with each spec by name only, the claims'
    directories, and the mounts left in the plugin's stage or beneath the pool's mount."""
    snap = w.snapshot()
    snap["specs"] = sorted(snap["specs"])
    try:
        snap["claim_dirs"] = sorted(os.listdir(w.config.claims_dir))
    except FileNotFoundError:
        snap["claim_dirs"] = []
    points = [line.split()[4] for line in open("/proc/self/mountinfo").read().splitlines()]
    snap["staged"] = [p for p in points if p.startswith(f"{w.config.stage}/")]
    snap["beneath_pool"] = [p for p in points if p.startswith(f"{w.root}/kv/mnt/")]
    return snap


def faults(w: World, claims: dict[str, list[str]]) -> dict[str, Any]:
    """kill -9 of the plugin process at each step of a prepare of a share and of an unprepare
    (``csi.faults``); then a new plugin (the DaemonSet's restart) and the kubelet's retry of the
    same call. First a prepare that is not interrupted: what every prepare must end as."""
    from offloadpool.csi import faults as steps

    a = claims["a"]
    out: dict[str, Any] = {}
    proc = _spawn(w)
    out["clean"] = {"prepare": w.prepare(a), "prepared": _state(w), "unprepare": w.unprepare(a)}
    out["clean"]["end"] = _state(w)
    _end(proc)
    for step in steps.DRA_PREPARE_STEPS:
        proc = _spawn(w, step)
        r: dict[str, Any] = {"call": _kill_when_stopped(proc, lambda: _answer(w, lambda: w.prepare(a)))}
        r["left"] = _state(w)
        proc = _spawn(w)
        r["kept"] = proc.kept
        r["after_restart"] = _state(w)
        r["retry"] = w.prepare(a)
        r["after_retry"] = _state(w)
        r["unprepare"] = w.unprepare(a)
        r["end"] = _state(w)
        _end(proc)
        out[f"prepare/{step}"] = r
    for step in steps.DRA_UNPREPARE_STEPS:
        proc = _spawn(w, step)
        r = {"prepare": w.prepare(a)}
        r["call"] = _kill_when_stopped(proc, lambda: _answer(w, lambda: w.unprepare(a)))
        r["left"] = _state(w)
        proc = _spawn(w)
        r["kept"] = proc.kept
        r["after_restart"] = _state(w)
        r["retry"] = w.unprepare(a)
        r["end"] = _state(w)
        _end(proc)
        out[f"unprepare/{step}"] = r
    return out


def main() -> None:
    scratch, scenario, kubeconfig, claims = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    lock_down(scratch)
    world = World(scratch, kubeconfig, claims.pop("consumer")[0])
    try:
        result = globals()[scenario](world, claims)
    finally:
        if world.plugin is not None:
            world.stop()
        for proc in _SPAWNED:
            if proc.poll() is None:
                _end(proc)
    print(json.dumps(result))
