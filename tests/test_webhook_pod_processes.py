"""A mutated pod's containers as real processes in their own mount namespaces, on a real pool.

The pod is what the webhook's pure function returns for a stock-vLLM compat pool; a tiny
"kubelet" here starts its lease sidecar and its main container as the kubelet would: each in a
private mount namespace that follows the host (HostToContainer = rslave), every volumeMount
bind-mounted (recursively) from its hostPath on this "node", command as written. The main
container maps the region file at /dev/shm/vllm_offload_<id>.mmap and takes no lock, as stock
vLLM does. While the pod runs, ``offloadpool release`` refuses (the sidecar's lease, held from
another mount namespace); after the pod's containers stop (main first, then the sidecar, as the
kubelet stops native sidecars), the release proceeds and nothing is left.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fixtures.host import cli
from fixtures.wait import wait_for
from offloadpool.api.pods import LEASE_READY_FILE
from offloadpool.operator import admission
from offloadpool.operator.admission import InjectionSettings
from offloadpool.region.holding.lease import count_holders, lease_path

Start = Callable[..., subprocess.Popen]


def run_container(
    container: dict[str, Any],
    pod_spec: dict[str, Any],
    root: Path,
    start: Start,
    command: list[str] | None = None,
) -> subprocess.Popen:
    """Start ``container`` as a process in its own mount namespace. Container paths ``P`` live at
    ``root/P`` (no chroot: the test machine's root file system stays the image)."""
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod_spec["volumes"] if "hostPath" in v}
    script = ["set -e"]
    for mount in container.get("volumeMounts", []):
        source, target = volumes[mount["name"]], str(root) + mount["mountPath"]
        if mount.get("subPath"):  # a compat file: the kubelet binds it from beneath the volume
            source = str(Path(source) / mount["subPath"])
        make = (
            f"mkdir -p {shlex.quote(target)}"
            if Path(source).is_dir()
            else f"mkdir -p {shlex.quote(str(Path(target).parent))}; touch {shlex.quote(target)}"
        )
        script += [make, f"mount --rbind {shlex.quote(source)} {shlex.quote(target)}"]
        if mount.get("mountPropagation") == "HostToContainer":
            script.append(f"mount --make-rslave {shlex.quote(target)}")
        if mount.get("readOnly"):  # as runc: the bind itself read-only, the mounts below it not
            script.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
    argv = [
        a.replace("/offloadpool/", f"{root}/offloadpool/").replace(
            LEASE_READY_FILE, f"{root}{LEASE_READY_FILE}"
        )
        for a in (command or container["command"])
    ]
    script.append("exec " + " ".join(shlex.quote(a) for a in argv))
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return start(["unshare", "--mount", "--propagation", "slave", "sh", "-c", "\n".join(script)], env=env)


STOCK_VLLM = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_RDWR)              # no flock: stock vLLM takes none
region = mmap.mmap(fd, os.fstat(fd).st_size)
region[:4096] = b"k" * 4096                # a KV block written into the pool's memory
print("mapped", os.fstat(fd).st_size, flush=True)
time.sleep(3600)
"""


WRITE_PROBE = """
import errno, os, sys
pool, memory = sys.argv[1], sys.argv[2]
for rel in ("planted", "lease"):
    try:
        os.close(os.open(os.path.join(pool, rel), os.O_WRONLY | os.O_CREAT, 0o644))
        print("written")
    except OSError as exc:
        print(errno.errorcode[exc.errno])
fd = os.open(memory, os.O_RDWR)
os.pwrite(fd, b"probe", 4096)
print("wrote-memory")
"""


def test_a_mutated_pods_sidecar_holds_the_pool_from_its_own_mount_namespace(
    region_root: Path, processes: Start, tmp_path: Path
) -> None:
    name, engine = "podpool", "llama-tp1"
    cli(
        "provision",
        "--root",
        str(region_root),
        "--name",
        name,
        "--capacity",
        "64Mi",
        "--medium",
        "Memory",
        "--engine-id",
        engine,
        "--max-files",
        "1",
    )
    pool = {
        "metadata": {"name": name},
        "spec": {
            "capacity": "64Mi",
            "medium": "Memory",
            "segments": {"maxFiles": 1},
            "compat": {"vllm": {"engineId": engine}},
        },
    }
    pod = admission.mutate(
        {
            "metadata": {"name": "vllm", "namespace": "inference", "labels": {"offloadpool.io/pool": name}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        },
        pool,
        InjectionSettings(host_root=str(region_root)),
    )
    spec = pod["spec"]
    root = tmp_path / "pod"
    lease = lease_path(region_root / name)

    sidecar = run_container(spec["initContainers"][0], spec, root / "sidecar", processes)
    wait_for(
        "the sidecar's ready file (its startup probe)",
        (root / "sidecar" / LEASE_READY_FILE.lstrip("/")).exists,
        timeout=30,
    )
    main_container = spec["containers"][0]
    vllm = run_container(
        main_container,
        spec,
        root / "vllm",
        processes,
        command=[sys.executable, "-c", STOCK_VLLM, f"{root / 'vllm'}/dev/shm/vllm_offload_{engine}.mmap"],
    )
    assert vllm.stdout.readline().split() == ["mapped", str(64 << 20)], (
        vllm.stderr.read() if vllm.poll() else ""
    )
    assert count_holders(lease) == 1

    # a root process of the pod writes nothing in the pool directory (the host's disk), and
    # still writes the pool's memory through vLLM's file
    probe = run_container(
        main_container,
        spec,
        root / "probe",
        processes,
        command=[
            sys.executable,
            "-c",
            WRITE_PROBE,
            f"/offloadpool/{name}/",  # as the container sees it (rewritten beneath its root)
            f"{root / 'probe'}/dev/shm/vllm_offload_{engine}.mmap",
        ],
    )
    assert probe.wait(30) == 0, probe.stderr.read()
    assert probe.stdout.read().split() == ["EROFS", "EROFS", "wrote-memory"]
    assert not (region_root / name / "planted").exists()

    held = cli("release", name, "--root", str(region_root), check=False)
    assert held.returncode == 3 and "in use" in held.stderr, held.stdout + held.stderr
    assert (region_root / name / "mnt").is_mount()

    # the kubelet stops the pod's containers first, its native sidecars last
    vllm.send_signal(signal.SIGTERM)
    vllm.wait(15)
    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(15) == 0, sidecar.stdout.read()
    assert count_holders(lease) == 0

    out = cli("release", name, "--root", str(region_root))
    assert "released pool" in out.stdout
    assert not (region_root / name).exists()
