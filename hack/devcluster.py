"""A single-node cluster of this repository's own parts for a person: ``python3 -m hack.node up``.

``up`` builds what is missing (control plane, node, the chart's image), then starts a detached
supervisor process that holds everything the test fixtures start — the control plane (webhooks
reached at their endpoints: ``--enable-aggregator-routing``), the real node joined to it without
the test taint, the `kubernetes` Service relay — imports the image into the node's containerd,
makes the agents' host root a shared mount, and returns to the shell printing the
``export KUBECONFIG=... PATH=...`` lines and the ``helm install`` line to use. ``down`` stops
the supervisor, which undoes everything the node made (:meth:`hack.node_run.NodeRunner.stop`);
if the supervisor died without doing so, ``down`` undoes it from the record the node kept
(:class:`hack.node_run.HostChanges`). ``status`` says whether it is up and prints the lines again.

Everything lives in one directory, ``$OFFLOADPOOL_DEV_DIR`` (default /var/lib/offloadpool-dev):
``supervisor.pid``, ``supervisor.log``, ``cluster.json`` (written once the cluster is ready),
``host-changes.json``, and the control plane's and node's work directories.

One node per machine: ``up`` refuses at once, naming the holder, while another node (a test
run's) holds the host lock; it does not wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hack import controlplane_build, node_build
from hack.controlplane import ControlPlane, ControlPlaneError
from hack.node_build import GUIDE_BUSYBOX_IMAGE
from hack.node_run import HostChanges, NodeError, NodeRunner, describe_pid, host_lock, lock_holder

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "offloadpool"
DEFAULT_DIR = "/var/lib/offloadpool-dev"
#: the helm release and namespace the printed install line uses
RELEASE, NAMESPACE = "offloadpool", "offloadpool-system"
#: how long ``up`` waits for the supervisor's cluster to be ready; ``down`` for it to be gone
UP_TIMEOUT, DOWN_TIMEOUT = 600.0, 240.0

try:
    from offloadpool.api.constants import HOST_ROOT
except ImportError:  # before any virtual environment exists: the source tree's own
    sys.path.insert(0, str(REPO_ROOT / "agent"))
    from offloadpool.api.constants import HOST_ROOT


class DevClusterError(RuntimeError):
    """``up``/``down`` cannot do what was asked; the message says why and what to do."""


def state_dir() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_DEV_DIR", DEFAULT_DIR))


@dataclass(frozen=True)
class Cluster:
    """What a running dev cluster offers a person (``cluster.json``)."""

    supervisor_pid: int
    kubeconfig: str
    bin_dir: str
    server: str
    node: str
    image: str
    #: the kubelet's ``--root-dir`` (the CSI plugin's ``csi.kubeletDir``); "" in a
    #: ``cluster.json`` written before it was recorded
    kubelet_dir: str = ""
    #: the directory of CDI specs the node's containerd reads (the DRA plugin's ``dra.cdiDir``);
    #: "" in a ``cluster.json`` written before it was recorded
    cdi_dir: str = ""

    def shell_lines(self) -> list[str]:
        """What to run, as the guide's own commands need it on this cluster; comments say
        what differs from a real one (``eval``-safe: a comment line runs nothing)."""
        repository, tag = self.image.rsplit(":", 1)
        csi = f" --set csi.kubeletDir={self.kubelet_dir}" if self.kubelet_dir else ""
        cdi = f" --set dra.cdiDir={self.cdi_dir}" if self.cdi_dir else ""
        return [
            f"export KUBECONFIG={self.kubeconfig}",
            f"export PATH={self.bin_dir}:$PATH",
            f"kubectl create namespace {NAMESPACE}",
            f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=privileged",
            f"helm install {RELEASE} {CHART} -n {NAMESPACE} --set image.repository={repository} "
            # one node, where the pools are too: allow the operator there (the chart keeps it
            # off pool nodes by default)
            f"--set image.tag={tag} --set image.pullPolicy=Never "
            f"""--set-json 'operator.affinity={{"nodeAffinity":{{}}}}'{csi}{cdi}""",
            *(
                ["# csi.kubeletDir: this node's kubelet root (add --set csi.enabled=true for CSI delivery)"]
                if csi
                else []
            ),
            *(
                ["# dra.cdiDir: where this node's containerd reads CDI specs (add --set dra.enabled=true)"]
                if cdi
                else []
            ),
            f"# images: no registry; {GUIDE_BUSYBOX_IMAGE} (the guide's busybox:{_tag(GUIDE_BUSYBOX_IMAGE)}) "
            "is in the node's containerd",
            "# DNS: no cluster DNS (no CoreDNS here): pods resolve with the host's resolv.conf; "
            "the MissingClusterDNS warning each pod gets says so",
        ]


def _tag(ref: str) -> str:
    return ref.rsplit(":", 1)[1]


class StateDir:
    """The dev cluster's directory and the files in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pid_file = root / "supervisor.pid"
        self.log = root / "supervisor.log"
        self.cluster_file = root / "cluster.json"
        self.changes_file = root / "host-changes.json"
        self.down_file = root / "down.json"

    def supervisor_pid(self) -> int | None:
        """The supervisor's PID while it runs; None when there is none (or it died)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        # A recycled PID is not ours: the supervisor's command line names this directory.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return None
        return pid if str(self.root) in cmdline.split("\0") else None

    def cluster(self) -> Cluster | None:
        try:
            return Cluster(**json.loads(self.cluster_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None


# --------------------------------------------------------------------------------------------
# up / down / status: what a person runs
# --------------------------------------------------------------------------------------------


def _say(line: str) -> None:
    print(f"[dev {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def check_can_start(state: StateDir) -> None:
    """DevClusterError when a dev cluster is up, one died without ``down``, or another node
    (a test run's) holds this machine's host lock."""
    pid = state.supervisor_pid()
    if pid is not None:
        raise DevClusterError(
            f"a dev cluster is already up (supervisor pid {pid}, {state.root}); "
            "`python3 -m hack.node status` prints its lines, `python3 -m hack.node down` stops it"
        )
    if state.root.exists() and any(state.root.iterdir()):
        raise DevClusterError(
            f"{state.root} is left from a dev cluster that did not go down cleanly; "
            "run `python3 -m hack.node down` first (it undoes what that node left)"
        )
    holder = lock_holder()
    if holder is not None:
        raise DevClusterError(
            f"this machine's real node is in use by pid {describe_pid(holder)} (a test run's node?): "
            "one node per machine at a time; run `up` again once it has finished"
        )


def up(timeout: float = UP_TIMEOUT) -> Cluster:
    """Build what is missing, start the supervisor, return once its cluster is ready."""
    if os.geteuid() != 0:
        raise DevClusterError("the dev cluster needs root (mounts, cgroups, the kubelet)")
    state = StateDir(state_dir())
    check_can_start(state)
    t0 = time.monotonic()
    try:
        controlplane_build.ensure_built()
        node_build.ensure_built()
    except controlplane_build.BuildError as err:
        raise DevClusterError(f"the cluster's binaries could not be built: {err}") from None
    _say(f"binaries ready ({time.monotonic() - t0:.0f}s); the chart's image (hack/image.py) ...")
    image = _image_archive()
    _say(f"image ready ({time.monotonic() - t0:.0f}s); starting the supervisor")
    state.root.mkdir(parents=True, exist_ok=True)
    with open(state.log, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hack.devcluster", "supervise", str(state.root), str(image[0]), image[1]],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # detached: outlives this shell command
        )
    deadline = time.monotonic() + timeout
    while (cluster := state.cluster()) is None:
        if proc.poll() is not None:
            tail = state.log.read_text(errors="replace")[-6000:]
            _remove(state)
            raise DevClusterError(f"the supervisor exited (rc={proc.returncode}):\n{tail}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise DevClusterError(
                f"the cluster was not ready after {timeout:.0f}s; see {state.log}; "
                "`python3 -m hack.node down` cleans up"
            )
        time.sleep(0.5)
    _say(f"up in {time.monotonic() - t0:.1f}s (supervisor pid {cluster.supervisor_pid}, log {state.log})")
    return cluster


def _image_archive() -> tuple[Path, str]:
    """The chart's image (hack/image.py, built unless cached) as an archive, and its name."""
    from hack import image

    try:
        return image.ensure_archive(), image.image_name()
    except (OSError, subprocess.CalledProcessError, RuntimeError, SystemExit) as err:
        raise DevClusterError(f"the chart's image could not be built (hack/image.py): {err}") from None


def down(timeout: float = DOWN_TIMEOUT) -> list[str]:
    """Stop the dev cluster and undo what its node did to the host; the problems left (empty
    when everything went). DevClusterError when there is nothing to stop."""
    state = StateDir(state_dir())
    if not state.root.exists():
        raise DevClusterError(f"no dev cluster is up ({state.root} does not exist): nothing to stop")
    problems: list[str] = []
    pid = state.supervisor_pid()
    if pid is not None:
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        while state.supervisor_pid() is not None:
            if time.monotonic() - t0 > timeout:
                problems.append(f"the supervisor (pid {pid}) did not stop in {timeout:.0f}s; killed")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                time.sleep(1)
                break
            time.sleep(0.3)
        _say(f"supervisor stopped in {time.monotonic() - t0:.1f}s")
        with contextlib.suppress(OSError, ValueError):
            problems += json.loads(state.down_file.read_text())["problems"]
    if not state.down_file.exists() and state.changes_file.exists():
        # The supervisor died before it could undo (its processes died with it): undo here,
        # under the host lock, so no other node's pods, cgroups or bridge are taken for ours.
        _say("the supervisor did not undo the node's changes; undoing them from its record")
        try:
            lock = host_lock(0, _say)
        except NodeError as err:
            raise DevClusterError(f"cannot undo the dead dev cluster's node now: {err}") from None
        try:
            HostChanges.load(state.changes_file).undo(problems)
        finally:
            lock.close()
    _remove(state)
    if state.root.exists():
        problems.append(f"{state.root} could not be removed")
    return problems


def _remove(state: StateDir) -> None:
    """The state directory; never across a mount (a mount left below it is a problem to say)."""
    subprocess.run(["rm", "-rf", "--one-file-system", str(state.root)], capture_output=True)


def status() -> Cluster | None:
    state = StateDir(state_dir())
    return state.cluster() if state.supervisor_pid() is not None else None


# --------------------------------------------------------------------------------------------
# the supervisor: holds the processes and the relay thread until SIGTERM
# --------------------------------------------------------------------------------------------


def supervise(root: Path, archive: Path, image: str) -> int:
    state = StateDir(root)
    state.pid_file.write_text(f"{os.getpid()}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    bin_dir = controlplane_build.ensure_built()
    plane = ControlPlane(bin_dir, root / "controlplane", log=_say)
    runner: NodeRunner | None = None
    problems: list[str] = []
    rc = 0
    try:
        runner = NodeRunner(plane, root / "node", shared_roots=(Path(HOST_ROOT),), lock_wait=0, say=_say)
        plane.start()
        node = runner.start(record=state.changes_file)
        _say("node up: " + ", ".join(f"{k} {v:.1f}s" for k, v in node.timings.items()))
        node.import_image(archive, image)
        node.tag_image(node.images["busybox"], GUIDE_BUSYBOX_IMAGE)  # docs/user-guide.md's pods
        cluster = Cluster(
            supervisor_pid=os.getpid(),
            kubeconfig=str(plane.kubeconfig),
            bin_dir=str(bin_dir),
            server=plane.server,
            node=node.name,
            image=image,
            kubelet_dir=str(node.kubelet_dir),
            cdi_dir=str(node.cdi_dir),
        )
        tmp = state.cluster_file.with_name(".cluster.json.tmp")
        tmp.write_text(json.dumps(asdict(cluster), indent=1) + "\n")
        os.replace(tmp, state.cluster_file)
        _say("ready; waiting for SIGTERM (python3 -m hack.node down)")
        while not stop.wait(1.0):  # a timed wait: the signal handlers run between waits
            pass
        _say("stopping")
    except (ControlPlaneError, NodeError) as err:
        _say(f"error: {err}")
        rc = 1
    finally:
        if runner is not None:
            problems += runner.stop()
        plane.stop()
        state.down_file.write_text(json.dumps({"problems": problems}) + "\n")
        _say("stopped" + (": " + "; ".join(problems) if problems else ", nothing left"))
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m hack.devcluster")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("supervise", help="internal: what `python3 -m hack.node up` starts")
    p.add_argument("root", type=Path)
    p.add_argument("archive", type=Path)
    p.add_argument("image")
    args = parser.parse_args(argv)
    return supervise(args.root, args.archive, args.image)


if __name__ == "__main__":
    sys.exit(main())
