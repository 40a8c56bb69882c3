"""The agent reports a partitioned pool's shares in its OffloadPoolNode: each share claimed or
free, how (an engine's flock, a csi volume's reservation) and by whom, and "claimed/total" in
the ``kubectl get offloadpoolnodes`` Shares column; a share is shown free again once the engine
holding it is killed. Real agent process, real API server, real flocks; the CLI's ``status``
reads the same from the node."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fixtures.cgroups import Cgroups, in_cgroups
from fixtures.host import cli
from fixtures.wait import wait_for
from offloadpool.region.holding import shares
from test_agent_process import create, env, start_agent, status  # noqa: F401  (env: the fixture)

pytestmark = pytest.mark.controlplane

# An engine: attach the pool for an owner (hostile text, as a pod may write), say the share, hold.
ENGINE = """
import sys, time
from offloadpool.pinning import attach
region = attach(sys.argv[1], owner=sys.argv[2])
print(region.share, flush=True)
time.sleep(600)
"""
HOSTILE = "pod-a\x1b[31m[bold]" + "x" * 300
CSI_POD = "0f8e1c2a-1111-4222-8333-444455556666"


def start_engine(state: dict[str, Any], pool_dir: Path, owner: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ENGINE), str(pool_dir), owner],
        stdout=subprocess.PIPE,
        text=True,
    )
    state["engines"].append(proc)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def column(state: dict[str, Any], name: str) -> str:
    """The Shares column of ``kubectl get offloadpoolnodes <name>``."""
    out = state["cp"].kubectl("get", "offloadpoolnodes", name, "--no-headers").stdout
    header = state["cp"].kubectl("get", "offloadpoolnodes", name).stdout.splitlines()[0]
    heads = header.split()
    return out.split()[heads.index("SHARES")]


def test_agent_reports_each_share_claimed_by_whom_and_frees_it_when_the_engine_dies(
    env: dict[str, Any],  # noqa: F811
) -> None:
    pool, node = "agent-shares", "node-s"
    create(env, pool, node, {"capacity": "8Mi", "medium": "Memory", "partitions": 4})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    st = wait_for("Ready", lambda: (s := status(env, name)).get("phase") == "Ready" and s, timeout=90)
    assert st["sharesClaimed"] == "0/4", st
    assert st["shares"] == [{"index": i, "claimed": False, "engines": 0} for i in range(4)], st["shares"]
    assert column(env, name) == "0/4"

    pool_dir = env["root"] / pool
    engine, index = start_engine(env, pool_dir, HOSTILE)
    shares.reserve(pool_dir, 4, CSI_POD)  # what the csi plugin does for a pod's volume
    st = wait_for("claimed", lambda: (s := status(env, name)).get("sharesClaimed") == "2/4" and s, timeout=30)
    by_index = {s["index"]: s for s in st["shares"]}
    mine = by_index[index]
    assert mine["claimed"] and mine["via"] == "Engine" and mine["engines"] == 1, mine
    holder = mine["holder"]
    assert holder.startswith("pod-a?[31m[bold]x") and len(holder) == 128 and holder.isprintable(), holder
    (csi,) = [s for s in st["shares"] if s.get("via") == "CSI"]
    assert csi == {"index": csi["index"], "claimed": True, "via": "CSI", "holder": CSI_POD, "engines": 0}
    assert csi["index"] != index
    assert column(env, name) == "2/4"
    assert st["enginesAttached"] >= 1, st  # the engine holds the pool's lease too

    node_view = json.loads(cli("status", pool, "--root", str(env["root"]), "--json").stdout)
    (pool_state,) = node_view["pools"]
    assert [s["claimed"] for s in pool_state["shares"]] == [i in (index, csi["index"]) for i in range(4)]
    text = cli("status", pool, "--root", str(env["root"])).stdout
    assert "2/4" in text and CSI_POD in text, text

    engine.kill()
    engine.wait(10)
    st = wait_for("freed", lambda: (s := status(env, name)).get("sharesClaimed") == "1/4" and s, timeout=30)
    assert {s["index"] for s in st["shares"] if s["claimed"]} == {csi["index"]}, st["shares"]
    assert shares.unreserve(pool_dir, csi["index"], CSI_POD)
    wait_for("all free", lambda: status(env, name).get("sharesClaimed") == "0/4", timeout=30)
    assert column(env, name) == "0/4"


def test_agent_shows_a_share_held_from_two_pods_and_warns(
    cgroups: Cgroups,  # first: removed after ``env`` has stopped the engines in them
    env: dict[str, Any],  # noqa: F811
) -> None:
    """Two pods' engines naming one owner are given two shares by the agent (it reads each pod
    from the cgroup the kubelet put it in); a process of pod B that takes pod A's share anyway,
    by flocking its lease itself (over hostPath every share's files are open to it), is named
    in the share's status next to pod A — from the cgroups, not from anything written — and
    the agent posts a ``ShareSharedAcrossPods`` Warning."""
    pool, node = "agent-crossed", "node-c"
    create(env, pool, node, {"capacity": "8Mi", "medium": "Memory", "partitions": 2})
    name = f"{pool}.{node}"
    start_agent(env, pool, node)
    wait_for("Ready", lambda: status(env, name).get("phase") == "Ready", timeout=90)
    pool_dir = env["root"] / pool
    wait_for(
        "the share service", lambda: (pool_dir / shares.SHARES_NAME / shares.SOCKET_NAME).is_socket(), 30
    )
    pods = ["0b7c4a52-3333-4c3e-9d1a-6f2b8e0c1a03", "0b7c4a52-4444-4c3e-9d1a-6f2b8e0c1a04"]
    groups = [cgroups.pod(pod, "besteffort") for pod in pods]

    def run(group: Path, argv: list[str]) -> str:
        proc = subprocess.Popen(in_cgroups([group], argv), stdout=subprocess.PIPE, text=True)
        env["engines"].append(proc)
        assert proc.stdout is not None
        return proc.stdout.readline().strip()

    engine = [sys.executable, "-c", textwrap.dedent(ENGINE), str(pool_dir), "one-owner"]
    index, other = int(run(groups[0], engine)), int(run(groups[1], engine))
    assert index != other  # the node decided: the owner both named gave B nothing of A's
    rogue = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(600)"
    )
    lease = shares.share_dir(pool_dir, index) / "lease"
    assert run(groups[1], [sys.executable, "-c", rogue, str(lease)]) == "held"

    def shown() -> Any:
        st = status(env, name)
        return next((s for s in st.get("shares", []) if s["index"] == index and s.get("pods") == pods), None)

    share = wait_for("both pods in the share's status", shown, timeout=30)
    assert share["engines"] == 2 and share["holder"] == f"pod/{pods[0]}" and share["via"] == "HostPath", share
    core = client.CoreV1Api(env["custom"].api_client)

    def warned() -> Any:
        events = core.list_namespaced_event("default", field_selector=f"involvedObject.name={name}").items
        return next((e for e in events if e.reason == "ShareSharedAcrossPods"), None)

    event = wait_for("a ShareSharedAcrossPods Event", warned, timeout=30)
    assert event.type == "Warning" and all(p in event.message for p in pods), event
