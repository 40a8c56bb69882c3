"""``python3 -m hack.node up``/``status``/``down`` refuse what they cannot do with one clear
message, before building or starting anything: down or status with nothing up, a second up while
one is up, up while another node holds this machine's host lock, up over a dev cluster that died
without ``down``. Real processes: the command line as a person runs it, a real supervisor-like
process, a real flock held by another process. (The cluster itself is brought up by hand, as
the README's walk-through does: docs/real-node.md, "A cluster to try it on".)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def hack_node(*args: str, dev_dir: Path, lock: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OFFLOADPOOL_DEV_DIR=str(dev_dir), OFFLOADPOOL_NODE_LOCK=str(lock))
    return subprocess.run(
        [sys.executable, "-m", "hack.node", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    """(the dev cluster's directory, the host lock file): both private to the test."""
    return tmp_path / "dev", tmp_path / "node.lock"


def _started(argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", "the helper process did not start"
    return proc


@pytest.fixture
def stand_in(paths: tuple[Path, Path]) -> Iterator[subprocess.Popen[str]]:
    """A running process whose command line names the dev directory, as the supervisor's does,
    recorded in its pid file: a dev cluster that is up."""
    dev_dir, _ = paths
    dev_dir.mkdir()
    code = "import sys, time; print('ready', flush=True); time.sleep(120)"
    proc = _started([sys.executable, "-c", code, str(dev_dir)])
    (dev_dir / "supervisor.pid").write_text(f"{proc.pid}\n")
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_down_and_status_with_nothing_up_say_so(paths: tuple[Path, Path]) -> None:
    dev_dir, lock = paths
    down = hack_node("down", dev_dir=dev_dir, lock=lock)
    assert down.returncode == 1
    assert f"no dev cluster is up ({dev_dir} does not exist): nothing to stop" in down.stderr
    status = hack_node("status", dev_dir=dev_dir, lock=lock)
    assert status.returncode == 1
    assert f"no dev cluster is up ({dev_dir})" in status.stderr
    assert status.stdout == ""


@pytest.mark.root
def test_a_second_up_while_one_is_up_is_refused_naming_it(
    paths: tuple[Path, Path], stand_in: subprocess.Popen[str]
) -> None:
    dev_dir, lock = paths
    out = hack_node("up", dev_dir=dev_dir, lock=lock)
    assert out.returncode == 1, out.stderr
    assert f"a dev cluster is already up (supervisor pid {stand_in.pid}, {dev_dir})" in out.stderr
    assert "python3 -m hack.node down" in out.stderr
    assert sorted(p.name for p in dev_dir.iterdir()) == ["supervisor.pid"]  # nothing started


@pytest.mark.root
def test_up_over_a_dev_cluster_that_died_asks_for_down_first(paths: tuple[Path, Path]) -> None:
    """A pid file whose process is gone (a recycled PID would not name the directory)."""
    dev_dir, lock = paths
    dev_dir.mkdir()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (dev_dir / "supervisor.pid").write_text(gone.stdout)
    out = hack_node("up", dev_dir=dev_dir, lock=lock)
    assert out.returncode == 1
    assert "did not go down cleanly; run `python3 -m hack.node down` first" in out.stderr


@pytest.mark.root
def test_up_while_another_node_holds_the_host_lock_fails_at_once_naming_the_holder(
    paths: tuple[Path, Path],
) -> None:
    dev_dir, lock = paths
    code = (
        "import fcntl, os, sys, time\n"
        "fh = open(sys.argv[1], 'a+'); fcntl.flock(fh, fcntl.LOCK_EX)\n"
        "fh.write(f'{os.getpid()}\\n'); fh.flush(); print('ready', flush=True); time.sleep(120)\n"
    )
    holder = _started([sys.executable, "-c", code, str(lock)])
    try:
        out = hack_node("up", dev_dir=dev_dir, lock=lock)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1
    assert f"this machine's real node is in use by pid {holder.pid} (" in out.stderr
    assert "one node per machine at a time" in out.stderr
    assert not dev_dir.exists()  # refused before anything was made
    # Once the holder is gone, the lock is free again: the refusal was the holder's doing.
    again = hack_node("status", dev_dir=dev_dir, lock=lock)
    assert again.returncode == 1


def test_status_prints_the_lines_the_guide_needs_on_this_cluster(
    paths: tuple[Path, Path], stand_in: subprocess.Popen[str]
) -> None:
    """The printed `helm install` line sets `csi.kubeletDir` to the node's kubelet root (where
    `/var/lib/kubelet` is no kubelet's: the CSI plugin's Bidirectional volume is refused
    there) and `dra.cdiDir` to the directory its containerd reads CDI specs from (not
    `/var/run/cdi`: a claim's spec written there reaches no container), and comments name the
    local busybox and why there is no cluster DNS."""
    from dataclasses import asdict

    from hack.devcluster import Cluster
    from hack.node_build import GUIDE_BUSYBOX_IMAGE

    dev_dir, lock = paths
    kubelet = "/var/lib/offloadpool-dev/node/kubelet"
    cdi = "/var/lib/offloadpool-dev/node/cdi"
    cluster = Cluster(
        supervisor_pid=stand_in.pid,
        kubeconfig=str(dev_dir / "admin.kubeconfig"),
        bin_dir="/cache/bin",
        server="https://127.0.0.1:6443",
        node="this-host",
        image="ghcr.io/offloadpool/offloadpool:0.1.0-dev",
        kubelet_dir=kubelet,
        cdi_dir=cdi,
    )
    (dev_dir / "cluster.json").write_text(json.dumps(asdict(cluster)))
    out = hack_node("status", dev_dir=dev_dir, lock=lock)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    (helm,) = [line for line in lines if line.startswith("helm install ")]
    assert helm.endswith(f" --set csi.kubeletDir={kubelet} --set dra.cdiDir={cdi}"), helm
    # one node carries both the pools and the operator: the chart's default keeps them apart
    assert """--set-json 'operator.affinity={"nodeAffinity":{}}'""" in helm, helm
    comments = "\n".join(line for line in lines if line.startswith("# "))
    assert GUIDE_BUSYBOX_IMAGE in comments and "MissingClusterDNS" in comments, out.stdout
    # eval-safe: every line is a command the guide's shell runs, or a comment
    assert all(line.split()[0] in {"export", "kubectl", "helm", "#"} for line in lines), out.stdout


def test_the_guides_pods_use_the_image_up_puts_on_the_node() -> None:
    """`kubectl run --image=...` in docs/user-guide.md names the busybox `up` tags into the
    node's containerd, with a tag (not `latest`, whose default pull policy is Always: a node
    without a registry cannot run it)."""
    from hack.node_build import GUIDE_BUSYBOX_IMAGE

    guide = (REPO / "docs" / "user-guide.md").read_text()
    images = re.findall(r"kubectl run \S+ .*?--image=(\S+)", guide)
    assert images, "the guide runs no pod with kubectl run"
    for image in images:
        name, _, tag = image.rpartition(":") if ":" in image else (image, "", "latest")
        full = name if "/" in name else f"docker.io/library/{name}"
        assert f"{full}:{tag}" == GUIDE_BUSYBOX_IMAGE, (image, GUIDE_BUSYBOX_IMAGE)
