"""Run the real node: kubelet + containerd + runc + CNI + kube-scheduler joined to a control plane,
and undo everything it did to the host.

A node is host-wide (ports 10250/10248, the /kubepods cgroups, the bridge, sysctls, the
`kubernetes` Service's ClusterIP on the loopback device): one per machine at a time, kept so by
a host lock (:func:`host_lock`) that the test fixture (tests/fixtures/node.py) and the dev
cluster (``python3 -m hack.node up``, :mod:`hack.devcluster`) both take. Every process runs in
its own session under a parent-death signal and is stopped by its own PID. Teardown removes
everything the node made: pods, the containerd shims and container processes, every mount under
the node's directory (container roots, network namespaces, volumes, mounts propagated out of
pods to the shared host root), the /kubepods cgroups it created, the bridge, the sysctls it
changed, the ClusterIP. What to undo is recorded before anything starts (:class:`HostChanges`),
so a process that did not start the node (``hack.node down`` after a crash) can undo it too.
The binaries come from :mod:`hack.node_build`; docs/real-node.md says why each setting is there.
Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from hack import node_build
from hack.controlplane import ControlPlane
from hack.pki import PkiError
from hack.process import Process, free_ports

BRIDGE = "opnode0"
#: the kubelet's ``--root-dir``, under the node's work directory (``Node.kubelet_dir``)
KUBELET_DIR_NAME = "kubelet"
#: containerd's ``cdi_spec_dirs``, under the node's work directory (``Node.cdi_dir``)
CDI_DIR_NAME = "cdi"
POD_SUBNET = "10.244.77.0/24"
#: Sysctls the kubelet (protectKernelDefaults: false) and the bridge plugin set: restored after.
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: One node per machine: whoever runs one holds this lock (the kernel drops it when its holder
#: dies); the file says the holder's PID. ``OFFLOADPOOL_NODE_LOCK`` names another file (for the
#: tests of the refusals, which must not contend with a real node).
HOST_LOCK = Path(os.environ.get("OFFLOADPOOL_NODE_LOCK", "/run/lock/offloadpool-real-node.lock"))
HUGE_2M, HUGE_1G = 2 << 20, 1 << 30


class NodeError(RuntimeError):
    """The node did not come up; the message carries the reason and the logs' tails."""


# --------------------------------------------------------------------------------------------
# the host lock
# --------------------------------------------------------------------------------------------


def lock_holder() -> int | None:
    """The PID holding the host lock, or None when nobody does."""
    if not HOST_LOCK.exists():
        return None
    with open(HOST_LOCK, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            text = fh.read().strip()
            return int(text) if text.isdigit() else -1
        return None  # free (closing the file lets go again)


def describe_pid(pid: int) -> str:
    """``pid (command line)`` for messages; the command line says whose node it is."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return str(pid)
    return f"{pid} ({cmdline.strip()[:200]})"


def host_lock(wait: float, say: Callable[[str], None] = print) -> IO[str]:
    """Take the host lock, waiting up to ``wait`` seconds for its holder to go; the open file
    holds it (close it to let go). NodeError naming the holder when the wait runs out."""
    HOST_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fh = open(HOST_LOCK, "a+")
    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                fh.seek(0)
                holder = fh.read().strip()
                fh.close()
                who = describe_pid(int(holder)) if holder.isdigit() else "an unknown process"
                waited = f" for {wait:.0f}s" if wait > 0 else ""
                raise NodeError(
                    f"this machine's real node is in use{waited} by pid {who} ({HOST_LOCK}): one node "
                    "per machine at a time; let it finish (a test run) or stop it (python3 -m hack.node down)"
                ) from None
            if not said:
                say(f"real node: waiting for another node on this machine to go ({HOST_LOCK})")
                said = True
            time.sleep(1)
            continue
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        return fh


# --------------------------------------------------------------------------------------------
# host state: mounts, cgroups, processes
# --------------------------------------------------------------------------------------------


def nr_hugepages(size: int) -> int:
    """The kernel's persistent pool of ``size`` huge pages (0 where the size is not supported)."""
    path = Path(f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/nr_hugepages")
    return int(path.read_text()) if path.exists() else 0


def mount_points() -> list[str]:
    """Every mount point of this mount namespace, octal escapes decoded."""
    with open("/proc/self/mountinfo") as fh:
        return [line.split()[4].encode().decode("unicode_escape") for line in fh]


def unmount_under(root: Path) -> list[str]:
    """Detach every mount at or below ``root``, deepest first; return what was unmounted."""
    prefix = str(root).rstrip("/") + "/"
    done = []
    for _ in range(5):  # mounts stacked on one path need several passes
        points = sorted(
            {p for p in mount_points() if p == str(root) or p.startswith(prefix)},
            key=lambda p: p.count("/"),
            reverse=True,
        )
        if not points:
            break
        for point in points:
            if subprocess.run(["umount", "-l", point], capture_output=True).returncode == 0:
                done.append(point)
    return done


def cgroup_dirs(name: str) -> list[Path]:
    """/sys/fs/cgroup/<hierarchy>/<name> for every mounted hierarchy (v1 and the unified one)."""
    found = []
    for hierarchy in sorted(CGROUP_ROOT.iterdir()):
        if (hierarchy / name).is_dir():
            found.append(hierarchy / name)
    if (CGROUP_ROOT / name / "cgroup.procs").exists():
        found.append(CGROUP_ROOT / name)
    return found


def kill_cgroup_tree(top: Path) -> None:
    """SIGKILL every process in ``top`` and below, then remove the cgroups bottom-up."""
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()
        if not top.exists() or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def pids_with_arg(needle: str) -> list[int]:
    """Processes whose command line contains ``needle`` (the containerd shims name its socket)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry))
    return found


class ServiceProxy:
    """The `kubernetes` Service for pods, without kube-proxy: what in-cluster clients dial.

    Why: pods (the operator, the agents) find the API server at KUBERNETES_SERVICE_HOST, the
    Service's ClusterIP (10.96.0.1:443), which only kube-proxy's rules make reachable, and they
    check its certificate for that IP. There is no kube-proxy (nor iptables) here, so the
    ClusterIP is put on the host's loopback device (pods reach it through their gateway, the
    bridge) and this relay terminates TLS there with a certificate for the ClusterIP issued by
    the control plane's CA, and relays the bytes to the API server over TLS. Authentication
    passes through untouched: in-cluster clients send their ServiceAccount token as a header.
    """

    def __init__(self, plane: ControlPlane, cluster_ip: str, port: int) -> None:
        # RSA: the busybox TLS 1.2 client of the node tests' probe pod offers no ECDSA suite.
        try:
            crt, key = plane.pki.issue(
                "kubernetes-service",
                "/CN=kubernetes",
                f"subjectAltName=IP:{cluster_ip}\nextendedKeyUsage=serverAuth\n",
                key=("-newkey", "rsa:2048"),
                days=2,
            )
        except PkiError as err:
            raise NodeError(f"the kubernetes Service relay's certificate: {err}") from None
        self.server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server_ctx.load_cert_chain(str(crt), str(key))
        # busybox's TLS 1.2 client (the node tests' probe pod) offers only RSA suites with
        # SHA-1 signatures, which OpenSSL's default security level refuses; a test relay on the
        # host's loopback may accept them (the operator's OpenSSL client negotiates TLS 1.3).
        self.server_ctx.set_ciphers("ALL:@SECLEVEL=0")
        self.upstream_ctx = ssl.create_default_context(cafile=str(plane.pki.ca_crt))
        host, _, upstream_port = plane.server.removeprefix("https://").rpartition(":")
        self.upstream = (host, int(upstream_port))
        # The kernel here has no dummy interfaces (no modules): the loopback device holds it.
        self.address = f"{cluster_ip}/32"
        # `replace`: a run killed before its teardown may have left it.
        out = subprocess.run(
            ["ip", "addr", "replace", self.address, "dev", "lo"], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise NodeError(f"ip addr replace {self.address} dev lo failed: {out.stderr}")
        self.errors: list[str] = []  # handshake failures, for failure messages
        # One event loop in a thread of its own: asyncio's TLS is single-threaded and correct
        # for full-duplex streams (an SSLSocket read and written from two threads is not).
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="service-relay", daemon=True)
        self.thread.start()
        try:
            self.server = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._serve, cluster_ip, port, ssl=self.server_ctx), self.loop
            ).result(30)
        except OSError as err:
            self._stop_loop()
            raise NodeError(
                f"the kubernetes Service relay cannot listen on {cluster_ip}:{port}: {err}"
            ) from None

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(
                *self.upstream, ssl=self.upstream_ctx, server_hostname=self.upstream[0]
            )
        except (OSError, ssl.SSLError) as err:
            self.errors.append(repr(err))
            client_w.close()
            return
        await asyncio.gather(self._pump(client_r, up_w), self._pump(up_r, client_w))

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()

    def _stop_loop(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def stop(self) -> None:
        """Stop listening (the port is free at once), drop every relayed connection, and take
        the ClusterIP off the loopback device."""
        self.server.close()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.server.wait_closed(), self.loop).result(5)
        self._stop_loop()
        subprocess.run(["ip", "addr", "del", self.address, "dev", "lo"], capture_output=True)


def containerd_config(w: Path, cni_bin: Path, pause: str) -> str:
    """containerd config version 3 (docs/real-node.md, "The test node", says why each line)."""
    return f"""version = 3
root = "{w}/containerd/root"
state = "{w}/containerd/state"
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{w}/containerd/containerd.sock"

[ttrpc]
  address = "{w}/containerd/containerd.sock.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/containerd/opt"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause}"

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  enable_cdi = true
  cdi_spec_dirs = ["{w}/{CDI_DIR_NAME}"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      snapshotter = "overlayfs"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{w}/cni/conf"
    max_conf_num = 1
"""


def cni_config(w: Path) -> dict:
    """One bridge network for the pods; the bridge is the host's route to them."""
    return {
        "cniVersion": "1.0.0",
        "name": "offloadpool-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "dataDir": str(w / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(w: Path, socket_path: Path, taints: list[dict[str, str]]) -> dict:
    """The kubelet's configuration: loopback only, cgroupfs, no eviction (docs/real-node.md)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "registerWithTaints": taints,
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "containerRuntimeEndpoint": f"unix://{socket_path}",
        "address": "127.0.0.1",
        "healthzBindAddress": "127.0.0.1",
        "readOnlyPort": 0,
        "podLogsDir": str(w / "pod-logs"),
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "rotateCertificates": False,
        "serializeImagePulls": False,
        # A development machine's disk and memory are what they are: no eviction, no GC.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "0%",
            "imagefs.available": "0%",
            "nodefs.inodesFree": "0%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
    }


# --------------------------------------------------------------------------------------------
# what the node changes on the host, and undoing it
# --------------------------------------------------------------------------------------------


@dataclass
class HostChanges:
    """What a node changes on the host, recorded before it starts (JSON, :meth:`save`), so
    that the process that started it, or any later one, can undo it all (:meth:`undo`)."""

    workdir: Path
    sysctls: dict[str, str]
    had_kubepods: list[str]
    had_bridge: bool
    #: directories bind-mounted onto themselves and made shared, and whether we created them
    shared_roots: dict[str, bool] = field(default_factory=dict)
    #: the `kubernetes` Service's ClusterIP on the loopback device (``10.96.0.1/32``)
    service_address: str = ""

    @classmethod
    def before(cls, workdir: Path) -> HostChanges:
        return cls(
            workdir=workdir,
            sysctls={k: Path("/proc/sys", k).read_text() for k in SYSCTLS if Path("/proc/sys", k).exists()},
            had_kubepods=[str(d) for d in cgroup_dirs("kubepods")],
            had_bridge=Path(f"/sys/class/net/{BRIDGE}").exists(),
        )

    def save(self, path: Path) -> None:
        data = asdict(self) | {"workdir": str(self.workdir)}
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> HostChanges:
        data = json.loads(path.read_text())
        return cls(**(data | {"workdir": Path(data["workdir"])}))

    def share(self, root: Path, remember: Callable[[], None]) -> None:
        """Make ``root`` a shared mount (bind onto itself): a Bidirectional hostPath volume
        propagates to the host only from a shared mount, and `/` is private here.
        ``remember`` is called once the change is recorded, before the mount is made."""
        if str(root) in mount_points():
            raise NodeError(f"{root} is a mount point already (another node's, or left by one?)")
        created = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        self.shared_roots[str(root)] = created
        remember()
        for argv in (["mount", "--bind", str(root), str(root)], ["mount", "--make-shared", str(root)]):
            out = subprocess.run(argv, capture_output=True, text=True)
            if out.returncode != 0:
                raise NodeError(f"{' '.join(argv)} failed: {out.stderr}")

    def kill_leftovers(self) -> None:
        """Whatever the kubelet left running: the pods' processes (by their cgroups), then the
        containerd shims (their command line names the node's containerd directory)."""
        for top in cgroup_dirs("kubepods"):
            if str(top) not in self.had_kubepods:
                kill_cgroup_tree(top)
        for pid in pids_with_arg(str(self.workdir / "containerd")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def undo(self, problems: list[str]) -> None:
        """Everything but the node's own processes (stopped first by whoever holds them):
        leftovers killed, mounts detached, cgroups, bridge, ClusterIP and sysctls as they were,
        the work directory removed. Problems found are appended to ``problems``."""
        w = self.workdir
        self.kill_leftovers()
        if self.service_address:
            subprocess.run(["ip", "addr", "del", self.service_address, "dev", "lo"], capture_output=True)
        unmount_under(w)
        left = [p for p in mount_points() if p.startswith(str(w))]
        if left:
            problems.append(f"mounts still under {w}: {left}")
        for root, created in self.shared_roots.items():
            unmount_under(Path(root))
            if root in mount_points():
                problems.append(f"{root} is still a mount point")
            elif created:
                subprocess.run(["rm", "-rf", "--one-file-system", root], capture_output=True)
        for top in cgroup_dirs("kubepods"):
            if str(top) not in self.had_kubepods:
                kill_cgroup_tree(top)
                if top.exists():
                    problems.append(f"cgroup {top} could not be removed")
        if not self.had_bridge and Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        for key, value in self.sysctls.items():
            with contextlib.suppress(OSError):
                if Path("/proc/sys", key).read_text() != value:
                    Path("/proc/sys", key).write_text(value)
        shutil.rmtree(w, ignore_errors=True)
        if w.exists():
            problems.append(f"{w} could not be removed")


# --------------------------------------------------------------------------------------------
# bring-up and teardown
# --------------------------------------------------------------------------------------------


@dataclass
class Node:
    """A running node: its name, its shared host root, ctr, the logs."""

    name: str
    workdir: Path
    host_root: Path
    containerd_socket: Path
    bin_dir: Path
    hugepages_at_start: dict[int, int]
    images: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)
    service: ServiceProxy | None = None

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin_dir / "ctr"), "--address", str(self.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} failed: {proc.stderr}")
        return proc

    @property
    def kubelet_dir(self) -> Path:
        """The kubelet's ``--root-dir`` (the CSI plugin's ``csi.kubeletDir``); the kubelet
        makes it a shared mount itself, as Bidirectional volumes beneath it need."""
        return self.workdir / KUBELET_DIR_NAME

    @property
    def cdi_dir(self) -> Path:
        """The directory of CDI specs containerd reads (``cdi_spec_dirs``): the DRA plugin's
        ``dra.cdiDir``."""
        return self.workdir / CDI_DIR_NAME

    def tag_image(self, ref: str, alias: str) -> None:
        """Give the image ``ref`` of the node's containerd a second name, ``alias``."""
        self.ctr("images", "tag", "--force", ref, alias)
        if alias not in self.ctr("images", "ls", "-q").stdout.split():
            raise NodeError(f"{alias} is not in containerd after tagging {ref} so")

    def import_image(self, archive: Path, ref: str) -> None:
        """``ctr images import`` of an OCI archive that names ``ref``; NodeError unless it is
        then in the node's image store (a pod with pullPolicy Never can use it)."""
        self.ctr("images", "import", "--platform", "linux/amd64", str(archive))
        listed = self.ctr("images", "ls", "-q").stdout.split()
        if ref not in listed:
            raise NodeError(f"{ref} is not in containerd after importing {archive} (have {listed})")

    def service_errors(self) -> list[str]:
        """TLS failures the kubernetes Service relay saw (for failure messages)."""
        return list(self.service.errors) if self.service is not None else []

    def logs(self, chars: int = 4000) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log_tail(chars)}" for p in self.procs)


class NodeRunner:
    """Starts the node's processes and undoes everything they did to the host.

    ``taints``: what the kubelet registers the Node with (the test suite keeps its other pods
    off the real node with one). ``shared_roots``: directories made shared mounts for the node's
    lifetime (the agent's host root for Bidirectional hostPath volumes). ``lock_wait``: how long
    to wait for another node on this machine to go (0: fail at once, naming its holder).
    ``workdir`` (default: a new temporary directory) is the node's and removed at the end.
    """

    def __init__(
        self,
        plane: ControlPlane,
        workdir: Path | None = None,
        taints: list[dict[str, str]] | None = None,
        shared_roots: tuple[Path, ...] = (),
        lock_wait: float = 0.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.plane = plane
        self.taints = list(taints or [])
        self.shared_roots = shared_roots
        self.lock = host_lock(lock_wait, say)
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="offloadpool-node-"))
        self.w = workdir
        self.w.mkdir(parents=True, exist_ok=True)
        self.procs: list[Process] = []
        self.changes = HostChanges.before(self.w)
        self.node: Node | None = None
        self.service: ServiceProxy | None = None

    def _spawn(self, name: str, argv: list[str], path: str | None = None) -> Process:
        """One process in its own session under pdeathsig; `env` execs the binary in place,
        so the PID stopped is the binary's own."""
        if path is not None:
            argv = ["env", f"PATH={path}", *argv]
        proc = Process(name, argv, self.w / f"{name}.log")
        self.procs.append(proc)
        return proc

    def _wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs:
                if not p.alive():
                    raise NodeError(
                        f"{p.name} exited (rc={p.proc.returncode}) while waiting for {what}:\n"
                        f"{p.log_tail(6000)}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                raise NodeError(
                    f"timed out after {timeout:.0f}s waiting for {what}:\n"
                    + "\n".join(f"--- {p.name} ---\n{p.log_tail(4000)}" for p in self.procs)
                )
            time.sleep(0.3)

    def _kubectl_ok(self, *args: str) -> bool:
        return self.plane.kubectl(*args).returncode == 0

    def start(self, record: Path | None = None) -> Node:
        """Bring the node up until its Node is Ready; ``record``: where to keep
        :class:`HostChanges` up to date (saved before each change it lists)."""
        plane, w = self.plane, self.w

        def remember() -> None:
            if record is not None:
                self.changes.save(record)

        timings: dict[str, float] = {}
        t0 = time.monotonic()
        try:
            lay = node_build.ensure_built()
        except node_build.BuildError as err:
            raise NodeError(f"the node's binaries could not be built: {err}") from None
        timings["build check"] = time.monotonic() - t0
        name = socket.gethostname().lower()
        try:
            addr = socket.gethostbyname(name)
        except OSError as err:
            raise NodeError(
                f"the host name {name!r} does not resolve ({err}); the API server reaches "
                "the kubelet by it: add it to /etc/hosts as 127.0.0.1"
            ) from None
        if not addr.startswith("127."):
            raise NodeError(
                f"the host name {name!r} resolves to {addr}, not to loopback where the kubelet listens"
            )
        remember()
        for d in (
            "containerd",
            "cni/conf",
            "cni/ipam",
            KUBELET_DIR_NAME,
            "pod-logs",
            "scheduler",
            "host",
            CDI_DIR_NAME,
        ):
            (w / d).mkdir(parents=True, exist_ok=True)
        host_root = w / "host"
        for root in (host_root, *self.shared_roots):
            self.changes.share(root, remember)
        sock = w / "containerd" / "containerd.sock"
        (w / "containerd" / "config.toml").write_text(
            containerd_config(w, lay.cni_bin_dir, node_build.PAUSE_IMAGE)
        )
        (w / "cni" / "conf" / "10-offloadpool.conflist").write_text(json.dumps(cni_config(w), indent=1))
        path = f"{lay.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"

        t = time.monotonic()
        self._spawn(
            "containerd",
            [str(lay.binary("containerd")), "--config", str(w / "containerd" / "config.toml")],
            path,
        )
        ctr = [str(lay.binary("ctr")), "--address", str(sock), "-n", "k8s.io"]
        self._wait(
            "containerd's socket",
            lambda: subprocess.run([*ctr, "version"], capture_output=True).returncode == 0,
            60,
        )
        timings["containerd ready"] = time.monotonic() - t
        t = time.monotonic()
        images = {}
        for key, ref in node_build.IMAGE_ARCHIVES.items():
            out = subprocess.run(
                [*ctr, "images", "import", "--platform", "linux/amd64", str(lay.image_archive(key))],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if out.returncode != 0:
                raise NodeError(f"ctr images import {ref} failed:\n{out.stdout}\n{out.stderr}")
            images[key] = ref
        listed = subprocess.run([*ctr, "images", "ls", "-q"], capture_output=True, text=True).stdout.split()
        missing = [ref for ref in images.values() if ref not in listed]
        if missing:
            raise NodeError(f"images not in containerd after the import: {missing} (have {listed})")
        timings["images imported"] = time.monotonic() - t

        out = plane.kubectl("get", "service", "kubernetes", "-n", "default", "-o", "json")
        if out.returncode != 0:
            raise NodeError(f"cannot read the kubernetes Service: {out.stderr}")
        svc = json.loads(out.stdout)
        cluster_ip = svc["spec"]["clusterIP"]
        self.changes.service_address = f"{cluster_ip}/32"
        remember()
        self.service = ServiceProxy(plane, cluster_ip, svc["spec"]["ports"][0]["port"])

        # kube-scheduler: the admin credentials for everything; a free loopback port for its own.
        port = free_ports(1)[0]
        kc = str(plane.kubeconfig)
        self._spawn(
            "kube-scheduler",
            [
                str(lay.binary("kube-scheduler")),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={w / 'scheduler'}",
            ],
        )

        hugepages = {HUGE_2M: nr_hugepages(HUGE_2M), HUGE_1G: nr_hugepages(HUGE_1G)}
        (w / "kubelet-config.json").write_text(json.dumps(kubelet_config(w, sock, self.taints), indent=1))
        t = time.monotonic()
        self._spawn(
            "kubelet",
            [
                str(lay.binary("kubelet")),
                f"--config={w / 'kubelet-config.json'}",
                f"--kubeconfig={kc}",
                f"--root-dir={w / KUBELET_DIR_NAME}",
                f"--cert-dir={w / KUBELET_DIR_NAME / 'pki'}",
                f"--hostname-override={name}",
                "--v=2",
            ],
            path,
        )
        node = Node(
            name=name,
            workdir=w,
            host_root=host_root,
            containerd_socket=sock,
            bin_dir=lay.bin_dir,
            hugepages_at_start=hugepages,
            images=images,
            timings=timings,
            procs=self.procs,
            service=self.service,
        )
        self.node = node

        def ready() -> bool:
            out = plane.kubectl("get", "node", name, "-o", "json")
            if out.returncode != 0:
                return False
            conds = {c["type"]: c["status"] for c in json.loads(out.stdout)["status"].get("conditions", [])}
            return conds.get("Ready") == "True"

        self._wait(f"Node {name} Ready", ready, 180)
        timings["node Ready after kubelet start"] = time.monotonic() - t
        self._wait(
            "the default ServiceAccount",
            lambda: self._kubectl_ok("get", "serviceaccount", "default", "-n", "default"),
            60,
        )
        return node

    # -- teardown ---------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Undo everything; return the problems found (empty when all went). A step that
        raises is reported and the rest still run; the host lock is released last."""
        problems: list[str] = []
        try:
            self._undo(problems)
        except Exception as err:  # reported; the lock must still go
            problems.append(f"teardown step failed: {err!r}")
            if self.service is not None:
                self.service.stop()
        finally:
            self.lock.close()  # the next node on this machine may start
        return problems

    def _undo(self, problems: list[str]) -> None:
        plane = self.plane
        kubelet = next((p for p in self.procs if p.name == "kubelet"), None)
        if kubelet is not None and kubelet.alive() and self.node is not None:
            # Pods first, through the kubelet, so it unmounts their volumes itself.
            on_node = f"spec.nodeName={self.node.name}"
            plane.kubectl("delete", "pods", "-A", "--field-selector", on_node, "--wait=false")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                out = plane.kubectl("get", "pods", "-A", "--field-selector", on_node, "-o", "name")
                if out.returncode == 0 and not out.stdout.strip():
                    break
                time.sleep(0.5)
            plane.kubectl("delete", "node", self.node.name, "--wait=false")
        for p in reversed(self.procs):
            if p.name != "containerd":
                p.stop()
        self.changes.kill_leftovers()
        for p in self.procs:
            if p.name == "containerd":
                p.stop()
        if self.service is not None:
            self.service.stop()
        self.changes.undo(problems)
