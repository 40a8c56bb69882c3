"""The node decides which share a hostPath pod's engine gets (``agent.share_service``).

Real pools (tmpfs made by the node engine), the agent's share service on its real socket,
engines in real processes placed in cgroups named as the kubelet names a pod's, real flocks.
What must hold: two pods naming one owner still get two shares (the node reads the pod from
the cgroup, never from what the engine says); a pod's workers join its share; a pod keeps its
share across its engine's restart and loses it only when it has no process left; the socket is
only ever the node's (a name a pod replaced is replaced, never followed); hostile requests get
an answer, never an exception, and an idle connection delays no one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.cgroups import Cgroups, in_cgroups
from fixtures.pinning_pools import MiB, PoolFactory
from fixtures.wait import wait_for
from offloadpool.agent.share_service import ShareService
from offloadpool.pinning import AttachError, attach
from offloadpool.region.holding import shares

ENGINE = """
import json, sys, time
from offloadpool.pinning import attach
region = attach(sys.argv[1], int(sys.argv[3]), owner=sys.argv[2])
print(json.dumps({"share": region.share}), flush=True)
time.sleep(600)
"""
POD_A, POD_B, POD_C = (f"5e1d2c3b-{n}111-4a2b-8c3d-9e8f7a6b5c4d" for n in "abc")


@pytest.fixture
def served(make_pool: PoolFactory) -> Iterator[tuple[Path, ShareService]]:
    """A pool of 3 shares (2 ranks each) and its share service, its socket bound."""
    pool = make_pool(
        "kv", capacity=24 * MiB, partitions=3, min_segment=4 * MiB, layout_type="PerRank", ranks=2
    )
    service = ShareService(pool.parent, pool.name).start()
    sock = pool / shares.SHARES_NAME / shares.SOCKET_NAME
    try:
        wait_for("the share service's socket", lambda: sock.is_socket(), timeout=10)
        yield pool, service
    finally:
        service.close()


class Pods:
    """Engines started in pod cgroups, killed at the end."""

    def __init__(self, cgroups: Cgroups, pool: Path) -> None:
        self.cgroups, self.pool = cgroups, pool
        self.groups: dict[str, Path] = {}
        self.procs: list[subprocess.Popen[str]] = []
        self.of: dict[str, list[subprocess.Popen[str]]] = {}

    def group(self, pod: str) -> Path:
        if pod not in self.groups:
            self.groups[pod] = self.cgroups.pod(pod)
        return self.groups[pod]

    def run(self, pod: str, argv: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            in_cgroups([self.group(pod)], argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.procs.append(proc)
        self.of.setdefault(pod, []).append(proc)
        return proc

    def engine(self, pod: str, owner: str, rank: int = 0) -> tuple[subprocess.Popen[str], int | str]:
        """An engine of ``pod`` naming ``owner``; its share, or its error's last line."""
        proc = self.run(
            pod, [sys.executable, "-c", textwrap.dedent(ENGINE), str(self.pool), owner, str(rank)]
        )
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if line.startswith("{"):
            return proc, int(json.loads(line)["share"])
        proc.wait(30)
        return proc, proc.stderr.read().strip().splitlines()[-1]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def pods(cgroups: Cgroups, served: tuple[Path, ShareService]) -> Iterator[Pods]:
    made = Pods(cgroups, served[0])
    try:
        yield made
    finally:
        made.stop()


def test_two_pods_naming_one_owner_get_two_shares(served: tuple[Path, ShareService], pods: Pods) -> None:
    pool, _ = served
    _, a = pods.engine(POD_A, "shared-owner")
    _, b = pods.engine(POD_B, "shared-owner")  # names the same owner: the env decides nothing
    assert isinstance(a, int) and isinstance(b, int) and a != b, (a, b)
    _, a1 = pods.engine(POD_A, "another-owner", rank=1)  # pod A's second worker: A's share
    assert a1 == a
    states = {s.index: s for s in shares.states(pool, 3)}
    assert states[a].reserved_for == f"pod/{POD_A}" and states[a].via == "HostPath"
    assert states[a].pods == (POD_A,) and len(states[a].holders) == 2 and states[a].crossed() is None
    assert states[b].reserved_for == f"pod/{POD_B}" and states[b].pods == (POD_B,)
    # the node wrote the record: the engines wrote nothing in the lease files
    for i in (a, b):
        assert (shares.share_dir(pool, i) / "lease").read_bytes() == b""

    _, c = pods.engine(POD_C, "pod-c")
    assert isinstance(c, int) and c not in (a, b)
    _, d = pods.engine("5e1d2c3b-d111-4a2b-8c3d-9e8f7a6b5c4d", "pod-d")
    assert isinstance(d, str) and "no free share" in d and f"hostPath pod '{POD_A}'" in d, d

    # a pod asking for another pod's share by number is refused it
    with_share = shares.share_dir(pool, a)
    proc = pods.run(
        "5e1d2c3b-e111-4a2b-8c3d-9e8f7a6b5c4d",
        [
            sys.executable,
            "-c",
            "import sys; from offloadpool.pinning import attach; attach(sys.argv[1])",
            str(with_share),
        ],
    )
    assert proc.wait(30) != 0
    assert proc.stderr is not None and f"hostPath pod '{POD_A}'" in proc.stderr.read()


def test_a_pod_keeps_its_share_across_engine_restarts_until_it_ends(
    served: tuple[Path, ShareService], pods: Pods
) -> None:
    pool, service = served
    sidecar = pods.run(POD_A, ["sleep", "600"])  # the pod lives on (its sandbox, its sidecar)
    engine, a = pods.engine(POD_A, "a")
    assert isinstance(a, int)
    engine.send_signal(signal.SIGKILL)
    engine.wait(30)
    assert shares.release_gone(pool, 3) == []  # the pod still has a process: still its share
    _, b = pods.engine(POD_B, "b")
    assert b != a
    _, again = pods.engine(POD_A, "a-restarted")
    assert again == a  # the restarted engine is given the same share

    for proc in pods.of[POD_A]:  # every process of pod A: the pod has ended
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert sidecar.poll() is not None
    dropped = wait_for("pod A's share freed", lambda: shares.release_gone(pool, 3) or None, timeout=10)
    assert dropped == [a]
    assert shares.reservations(pool, 3) == {b: f"pod/{POD_B}"}


def test_a_host_engine_claims_by_its_owner(served: tuple[Path, ShareService]) -> None:
    """A process in no pod (the host's own engine): the node leaves it its own claim."""
    pool, _ = served
    with attach(pool, owner="host-engine") as region:
        state = shares.states(pool, 3)[region.share]
        assert state.via == "Engine" and state.owner == "host-engine" and not state.reserved_for


def test_the_socket_is_only_ever_the_nodes(served: tuple[Path, ShareService], tmp_path: Path) -> None:
    pool, service = served
    name = pool / shares.SHARES_NAME / shares.SOCKET_NAME
    host_file = tmp_path / "host-file"
    host_file.write_text("host")
    host_file.chmod(0o600)
    assert stat.S_IMODE(name.lstat().st_mode) == 0o666 and name.lstat().st_uid == 0

    # a pod replaces the name with a link to a host file: the node binds again over the name
    name.unlink()
    name.symlink_to(host_file)
    wait_for("bound again", lambda: name.is_socket() and not name.is_symlink(), timeout=10)
    assert stat.S_IMODE(host_file.stat().st_mode) == 0o600 and host_file.read_text() == "host"
    assert _ask(name, b'{"only": null}\n')["share"] is None  # served (this process is in no pod)

    # while a plain file stands there (the service stopped), an engine is refused, naming it,
    # and nothing is claimed; a service started again binds over it
    service.close()
    name.unlink()
    name.write_text("not a socket")
    with pytest.raises(AttachError, match="not the node's share service"):
        attach(pool, owner="host-engine", lease_timeout=2)
    assert not any(s.claimed for s in shares.states(pool, 3))
    again = ShareService(pool.parent, pool.name).start()
    try:
        wait_for("bound again", lambda: name.is_socket(), timeout=10)
    finally:
        again.close()


def _ask(sock_path: Path, payload: bytes) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(sock_path))
        conn.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    answer: dict[str, object] = json.loads(data)
    return answer


@pytest.mark.parametrize(
    "payload, says",
    [
        (b"not json\n", "not a share request"),
        (b"[" * 1000 + b"\n", "not a share request"),
        (b'{"only": 1' + b"0" * 5000 + b"}\n", "over 1024 bytes"),
        (b'{"only": "1"}\n', "'only' is a share's number"),
        (b'{"only": true}\n', "'only' is a share's number"),
        (b"x" * 5000, "over 1024 bytes"),
    ],
)
def test_hostile_requests_get_an_answer(
    served: tuple[Path, ShareService], pods: Pods, payload: bytes, says: str
) -> None:
    """From a pod's process (the test's own is in no pod: asked as one below)."""
    pool, service = served
    sock_path = pool / shares.SHARES_NAME / shares.SOCKET_NAME
    answer = service.answer(os.getpid(), payload.split(b"\n", 1)[0][: shares.MESSAGE_LIMIT])
    if len(payload) <= shares.MESSAGE_LIMIT:
        assert "error" in answer and any(s in str(answer["error"]) for s in says.split("|")), answer
    else:
        answer = _ask(sock_path, payload)
        assert any(s in str(answer["error"]) for s in says.split("|")), answer
    _, a = pods.engine(POD_A, "a")  # the service still serves
    assert isinstance(a, int)


def test_an_idle_connection_delays_no_one(served: tuple[Path, ShareService], pods: Pods) -> None:
    """Four connections that send nothing, each given 60 s: an engine is served meanwhile."""
    pool, service = served
    service.timeout_seconds = 60
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(4)]
    try:
        for conn in idle:
            conn.connect(str(pool / shares.SHARES_NAME / shares.SOCKET_NAME))
        t0 = time.monotonic()
        _, a = pods.engine(POD_A, "a")
        assert isinstance(a, int)
        assert time.monotonic() - t0 < 30  # served one after another, it would wait 240 s
    finally:
        for conn in idle:
            conn.close()
