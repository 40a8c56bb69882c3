"""Stock vLLM 0.33.0 adopts a compat pool delivered through CSI: the webhook's ``subPath`` mounts
of the published volume put the pool's files under vLLM's names in the pod's own /dev/shm.

Each test runs tests/csi_vllm_pod.py in a mount namespace of its own over a scratch tmpfs (every
other mount read-only): a compat pool provisioned from an ``OffloadPool`` with
``consumers.delivery: CSI``, the pod as ``admission.mutate`` leaves it, the real plugin
publishing its ``csi`` volume over its socket, the kubelet's subPath binds (safe open, bind of
``/proc/<pid>/fd/<fd>``), and the engine's processes (tests/vllm_workers/stock_engine.py,
vLLM's own code) in a mount namespace of their own with a tmpfs on /dev/shm, each subPath bind
bound onto a file there as the runtime does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.host import private_mounts_python
from fixtures.vllm_env import OVERRIDE

pytestmark = [pytest.mark.vllm, pytest.mark.root]

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import csi_vllm_pod; csi_vllm_pod.main()"
MiB, GiB = 1 << 20, 1 << 30
TP, RANK_BLOCK = 2, 256 << 10
NAMES = ["vllm_offload_llama-tp2.mmap", "vllm_offload_llama-tp2.mmap.1"]


def pod_run(tmp_path: Path, vllm_python: Path, **spec: Any) -> dict[str, Any]:
    inherited = os.environ.get("PYTHONPATH", "") if os.environ.get(OVERRIDE) else ""
    engine_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "agent"), inherited])),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "HOME": str(tmp_path / "scratch" / "home"),
        "TMPDIR": str(tmp_path / "scratch"),
        "VLLM_NO_USAGE_STATS": "1",
    }
    spec["engine"] = {"python": str(vllm_python), "env": engine_env}
    spec["marks"] = {str(k): v for k, v in spec["marks"].items()}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = subprocess.run(
        private_mounts_python(RUN, str(scratch), json.dumps(spec)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-5000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_csi_stock_vllm_adopts_a_compat_pool_through_the_webhooks_subpath_mounts(
    tmp_path: Path, vllm_python: Path
) -> None:
    """2 GiB in vLLM's two files (CPUOffloadingSpec's split): both reach /dev/shm through the
    kubelet's subPath binds of the published tree, vLLM joins them (creates no file, takes no
    memory), reads what the node wrote, its writes land in the pool's files; the pod's /dev/shm
    stays vLLM's for its own shared memory; the volume and the engine hold the pool as
    documented, and the kubelet's teardown leaves nothing."""
    marks = {0: 0x11, GiB - 1: 0x22, GiB: 0x33, 2 * GiB - 1: 0x44}  # each side of the file boundary
    r = pod_run(tmp_path, vllm_python, capacity="2Gi", subpaths=True, marks=marks)
    # the webhook's mounts: the volume whole, and each of vLLM's names as a subPath of it
    vol = r["volume"]["name"]
    assert r["mounts"] == [
        {"name": vol, "mountPath": "/offloadpool/kv"},
        *({"name": vol, "mountPath": f"/dev/shm/{n}", "subPath": f"mnt/{n}"} for n in NAMES),
    ]
    assert r["publish"] == "OK"
    assert [pod for _, pod in r["binds"]] == [f"/dev/shm/{n}" for n in NAMES]
    run = r["run"]
    # before any worker started: only the mount points the runtime made for the subPath binds
    assert sorted(run["shm_before"]["files"]) == NAMES and run["shm_before"]["used_bytes"] < MiB
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert [s[0] for s in w["segments"]] == [f"/dev/shm/{n}" for n in NAMES]
        assert w["creator_at_cleanup"] is False, "vLLM created its region instead of joining"
        assert sorted(w["shm_attached"]["files"]) == NAMES, w["shm_attached"]
        assert w["shm_attached"]["used_bytes"] < MiB, "vLLM made memory of its own in the pod's /dev/shm"
        assert {int(k): v for k, v in w["read"].items()} == marks, "the node's bytes, read through vLLM"
        assert w["seen_markers"] == [0x40 + rank for rank in range(TP)]
        # vLLM's own shared memory beside the region: its message queue's ring buffer
        own = w["own_shm"]
        assert own["name"].startswith("psm_") and own["listed"] and not own["left"], own
        assert own["seen"] == f"{0x70 + w['rank']:02x}" * 4
    # the pool's files: never replaced, truncated, unlinked or grown; vLLM's writes are in them
    assert r["after"] == r["before"]
    assert r["pool_reads"] == [0x40, 0x41, 0x40, 0x41]
    # while attached: the published volume and each engine process hold the pool
    held = r["held"]
    assert held["volumes"] and set(held["mapped_pids"]) >= set(held["pids"]) and len(held["pids"]) == TP
    assert held["count"] == 1 + len(held["mapped_pids"])
    assert held["release"].startswith("held: ") and "pod team-a/vllm-0 (uid" in held["release"]
    assert all(f"{pid}" in held["release"] for pid in held["pids"]), held["release"]
    # the engine gone, the pod's volume alone still holds it; unpublished, nothing does
    assert r["exited"]["count"] == 1 and r["exited"]["mapped_pids"] == []
    assert r["exited"]["release"].startswith("held: ") and "pod team-a/vllm-0" in r["exited"]["release"]
    assert r["unpublish"] == "OK"
    assert r["unpublished"]["count"] == 0 and r["unpublished"]["release"] == "released"
    assert r["left"] == [] and r["pool_dir_left"] is False, r["left"]


def test_csi_without_the_subpath_mounts_stock_vllm_builds_a_region_of_its_own(
    tmp_path: Path, vllm_python: Path
) -> None:
    """The same pod and publish, the container without the subPath mounts (the volume only at
    /offloadpool/kv): vLLM finds no file under its name, creates, populates and unlinks a
    region of its own in the pod's /dev/shm, with no error; the pool is never written."""
    r = pod_run(tmp_path, vllm_python, capacity="64Mi", subpaths=False, marks={5: 0x55})
    assert r["publish"] == "OK" and r["binds"] == []
    run = r["run"]
    assert run["shm_before"]["files"] == {}
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert w["mmap_path"] == "/dev/shm/vllm_offload_llama-tp2.mmap"
        assert w["shm_attached"]["used_bytes"] >= 64 * MiB // TP, "vLLM's own region, in the pod's memory"
        assert w["read"] == {"5": 0}, "vLLM read its own zeroes, not the pool's bytes"
        assert "vllm_offload_llama-tp2.mmap" not in w["shm_attached"]["files"]  # unlinked after the barrier
    assert r["after"] == r["before"]
    assert r["pool_reads"] == [0, 0, 0, 0], "the pool was never written"
    assert r["held"]["mapped_pids"] == [] and r["held"]["count"] == 1
    assert r["unpublish"] == "OK" and r["unpublished"]["release"] == "released" and r["left"] == []
