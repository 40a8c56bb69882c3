"""The agent reports, in the OffloadPoolNode's status, a stock-vLLM engine that was given a compat
pool but runs under another engine id — the one mistake vLLM itself never reports.

The engine here is a process in its own mount namespace that does what vLLM 0.33.0 does in that
case (tests/test_vllm_compat.py proves it with vLLM's own code, and that the same detector names
vLLM's workers): its pod /dev/shm is a private tmpfs holding the pool's file bind-mounted under
the pool's id, yet it creates, maps and unlinks ``vllm_offload_<its id>.mmap`` there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.host import private_mounts_python
from fixtures.wait import wait_for
from offloadpool.api.pods import compat_files
from test_agent_process import create, env, start_agent, status  # noqa: F401  (env: the fixture)

pytestmark = pytest.mark.controlplane

# argv: pod /dev/shm dir, the pool's compat file on the host, its name in the pod, the engine's id
MISMATCHED_ENGINE = r"""
import mmap, os, subprocess, sys
shm, pool_file, pool_name, engine_id = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "pod-shm", shm], check=True)
open(os.path.join(shm, pool_name), "w").close()
subprocess.run(["mount", "--bind", pool_file, os.path.join(shm, pool_name)], check=True)
own = os.path.join(shm, f"vllm_offload_{engine_id}.mmap")
try:  # vLLM's create-or-join
    fd = os.open(own, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
except FileExistsError:  # the pool's file, under the engine's id: joined, as it should be
    fd = os.open(own, os.O_RDWR)
    region = mmap.mmap(fd, os.fstat(fd).st_size)
else:  # another id: a region of its own, pre-faulted, its name unlinked once all workers joined
    os.ftruncate(fd, 4 << 20)
    region = mmap.mmap(fd, 4 << 20)
    region[:] = b"\x01" * (4 << 20)
    os.unlink(own)
os.close(fd)
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""


def start_engine(
    state: dict[str, Any], shm: Path, pool_file: Path, pool_name: str, engine_id: str
) -> subprocess.Popen[str]:
    shm.mkdir(parents=True)
    proc = subprocess.Popen(
        private_mounts_python(MISMATCHED_ENGINE, str(shm), str(pool_file), pool_name, engine_id),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    state["engines"].append(proc)
    assert proc.stdout is not None and proc.stdout.readline().split() == ["ready", str(proc.pid)]
    return proc


def test_an_engine_under_another_id_is_named_in_status_until_it_exits(
    env: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    pool, node = "agent-dpid", "node-d"
    create(
        env,
        pool,
        node,
        {
            "capacity": "64Mi",
            "medium": "Memory",
            "segments": {"maxFiles": 1},
            "compat": {"vllm": {"engineId": "llama"}},
        },
    )
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    st = wait_for("Ready", lambda: (s := status(env, name)).get("phase") == "Ready" and s, timeout=90)
    assert "engineIdMismatch" not in st or st["engineIdMismatch"] is None

    ((host_rel, pod_path),) = compat_files("llama", 1)
    pool_dir = env["root"] / pool
    right = start_engine(env, tmp_path / "pod-ok", pool_dir / host_rel, Path(pod_path).name, "llama")
    wrong = start_engine(env, tmp_path / "pod-dp", pool_dir / host_rel, Path(pod_path).name, "llama_dp0")

    st = wait_for(
        "engineIdMismatch", lambda: (s := status(env, name)).get("engineIdMismatch") and s, timeout=30
    )
    message = st["engineIdMismatch"]
    assert f"pid {wrong.pid} " in message and f"pid {right.pid} " not in message, message
    assert 'engine_id "llama_dp0"' in message and 'compat.vllm.engineId is "llama"' in message
    assert st["phase"] == "Ready" and st["enginesAttached"] == 1, st  # the right one maps the pool
    events = env["cp"].kubectl("get", "events", "-n", "default", "-o", "jsonpath={.items[*].reason}")
    assert "EngineIdMismatch" in events.stdout.split()

    assert wrong.stdin is not None
    wrong.stdin.close()
    assert wrong.wait(30) == 0
    wait_for("mismatch cleared", lambda: not status(env, name).get("engineIdMismatch"), timeout=30)
    assert right.stdin is not None
    right.stdin.close()
    assert right.wait(30) == 0
