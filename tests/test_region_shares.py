"""Several engines on one node from one pool (``partitions``): real pools (tmpfs and hugetlbfs
mounts made by the node engine), real processes attaching concurrently, real flocks.

What must hold: two engines get separate shares and never see each other's bytes; the workers
of one engine get the same share; a third engine is refused naming the holders; a share is
freed when its engine's processes die; the node sees who holds each share; a pool of one
partition is exactly today's; bad partition counts are refused before memory is touched.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.cgroups import Cgroups, in_cgroups
from fixtures.pinning_pools import MiB, PoolFactory
from offloadpool.api.node import NodeShare
from offloadpool.pinning import AttachError, attach
from offloadpool.region.errors import RequestError
from offloadpool.region.files.manifest import MANIFEST_NAME, load
from offloadpool.region.holding import shares
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.request import SHAPE_FIELDS, PoolRequest

# Attach (with an owner), fill the whole region with one byte, say where, then hold.
ENGINE = """
import json, sys, time
from offloadpool.pinning import attach
pool, owner, rank, fill = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
region = attach(pool, rank, owner=owner)
view = region.memoryview()
view[:] = bytes([fill]) * len(view)
print(json.dumps({"share": region.share, "dir": str(region.pool_dir), "rank": rank,
                  "files": [s.file for s in region.region.segments]}), flush=True)
time.sleep(600)
"""


def start(pool: Path, owner: str, fill: int, rank: int = 0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ENGINE), str(pool), owner, str(rank), str(fill)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ready(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("{"):
        proc.kill()
        raise AssertionError(f"engine did not attach: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    info: dict[str, object] = json.loads(line)
    return info


def stop(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def share_bytes(pool: Path, index: int) -> bytes:
    """Every byte of share ``index``, read from its files by the node's names (no claim)."""
    m = load(shares.share_dir(pool, index))
    out = b""
    for seg in (s for r in m.regions for s in r.segments):
        with open(pool / seg.file, "rb") as fh, mmap.mmap(fh.fileno(), seg.bytes, prot=mmap.PROT_READ) as mm:
            out += mm[:]
    return out


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_two_engines_get_separate_shares_and_never_see_each_others_bytes(
    make_pool: PoolFactory, medium: str
) -> None:
    pool = make_pool("kv", capacity=16 * MiB, medium=medium, partitions=2, min_segment=4 * MiB)
    a, b = start(pool, "pod-a", 0xA1), start(pool, "pod-b", 0xB2)  # attach at the same time
    try:
        got_a, got_b = ready(a), ready(b)
        assert {got_a["share"], got_b["share"]} == {0, 1}
        assert not set(got_a["files"]) & set(got_b["files"])  # type: ignore[arg-type]
        share_a, share_b = int(got_a["share"]), int(got_b["share"])  # type: ignore[call-overload]
        # each share holds exactly its engine's pattern: neither wrote a byte of the other's
        assert share_bytes(pool, share_a) == b"\xa1" * (8 * MiB)
        assert share_bytes(pool, share_b) == b"\xb2" * (8 * MiB)

        # a third engine is refused, naming both holders; nothing of it stays held
        with pytest.raises(AttachError, match="no free share") as refused:
            attach(pool, owner="pod-c")
        assert "'pod-a'" in str(refused.value) and "'pod-b'" in str(refused.value)
        assert [s.owner for s in shares.states(pool, 2)] == [
            "pod-a" if share_a == 0 else "pod-b",
            "pod-b" if share_a == 0 else "pod-a",
        ]
        assert {s.holders for s in shares.states(pool, 2)} == {(a.pid,), (b.pid,)}

        # engine a ends: its share is free, the next engine gets it; b's bytes are untouched
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=30)
        states = {s.index: s for s in shares.states(pool, 2)}
        assert not states[share_a].claimed and states[share_b].holders == (b.pid,)
        with attach(pool, owner="pod-c") as c:
            assert c.share == share_a
            assert c.pool_dir == shares.share_dir(pool, share_a)
            view = c.memoryview()
            view[:] = b"\xc3" * len(view)
            del view
        assert share_bytes(pool, share_b) == b"\xb2" * (8 * MiB)
    finally:
        stop(a, b)


def test_workers_of_one_engine_join_its_share(make_pool: PoolFactory) -> None:
    """Every rank of an engine (one owner) lands in the same share, each in its own region."""
    pool = make_pool(
        "kv", capacity=32 * MiB, layout_type="PerRank", ranks=2, partitions=2, min_segment=4 * MiB
    )
    workers = [start(pool, "engine-1", 0x10 + r, rank=r) for r in range(2)]
    other = start(pool, "engine-2", 0x20)
    try:
        w0, w1, o = (ready(p) for p in (*workers, other))
        assert w0["share"] == w1["share"] != o["share"]
        assert w0["files"] != w1["files"]
        share = int(w0["share"])  # type: ignore[call-overload]
        m = load(shares.share_dir(pool, share))
        assert [r.rank for r in m.regions] == [0, 1] and m.share == share
        assert share_bytes(pool, share) == b"\x10" * (8 * MiB) + b"\x11" * (8 * MiB)
        assert shares.states(pool, 2)[share].holders == tuple(sorted(p.pid for p in workers))
    finally:
        stop(*workers, other)


def test_a_named_share_is_claimed_too(make_pool: PoolFactory) -> None:
    """``attach(share_dir)`` claims that share: a second engine on it is refused; the pool's
    lease is held, so the node keeps the pool while the share is attached."""
    pool = make_pool("kv", capacity=16 * MiB, partitions=2, min_segment=4 * MiB)
    one = shares.share_dir(pool, 1)
    with attach(one, owner="x") as region:
        assert region.share == 1 and region.size == 8 * MiB
        with pytest.raises(AttachError, match=r"share 1 by 'x'"):
            attach(one, owner="y")
        with attach(pool, owner="y") as other:
            assert other.share == 0
        with pytest.raises(LeaseHeld):  # a reshape waits for the engine
            provision(PoolRequest(name="kv", capacity=32 * MiB, medium="Memory", partitions=2), pool.parent)
    assert not shares.states(pool, 2)[1].claimed


def test_one_partition_is_todays_pool(make_pool: PoolFactory) -> None:
    pool = make_pool("kv", capacity=16 * MiB, min_segment=4 * MiB)
    raw = json.loads((pool / MANIFEST_NAME).read_text())
    assert "shares" not in raw and "share" not in raw
    assert not (pool / shares.SHARES_NAME).exists()
    assert [s.file for s in load(pool).regions[0].segments] == [f"mnt/r0-s00{i}" for i in range(4)]
    with attach(pool) as region:
        assert region.share is None and region.size == 16 * MiB
    req = PoolRequest(name="kv", capacity=16 * MiB)
    old = {k: getattr(req, k) for k in SHAPE_FIELDS} | {"single_file": False}
    assert req.fingerprint() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert PoolRequest(name="kv", capacity=16 * MiB, partitions=2).fingerprint() != req.fingerprint()


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"partitions": 0}, "partitions must be 1-64"),
        ({"partitions": 65}, "partitions must be 1-64"),
        ({"partitions": True}, "partitions must be 1-64"),
        ({"partitions": 3}, "does not divide into 3 partitions"),
        ({"partitions": 2, "layout_type": "PerRank", "ranks": 3}, "per partition does not divide"),
        ({"partitions": 2, "compat_engine_id": "e1"}, "cannot be combined with partitions"),
    ],
)
def test_bad_partitions_are_refused_before_memory_is_touched(
    pool_root: Path, fields: dict[str, object], says: str
) -> None:
    req = PoolRequest(name="kv", capacity=16 * MiB, medium="Memory", **fields)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match=says):
        provision(req, pool_root)
    assert list(pool_root.iterdir()) == []


def test_release_takes_the_shares_apart(pool_root: Path) -> None:
    from offloadpool.region.lifecycle.release import release

    req = PoolRequest(name="kv", capacity=16 * MiB, medium="Memory", partitions=4, min_segment=4 * MiB)
    pool = provision(req, pool_root).pool_dir
    assert sorted(p.name for p in (pool / shares.SHARES_NAME).iterdir()) == ["0", "1", "2", "3"]
    assert os.readlink(shares.share_dir(pool, 3) / "mnt") == "../../mnt"
    result = release(pool_root, "kv")
    assert result.existed and not result.warnings
    assert list(pool_root.iterdir()) == []


def test_a_consumer_locking_the_shares_directory_never_delays_a_reservation(make_pool: PoolFactory) -> None:
    """The node's reservation mutex lives in the pool's root-only state directory: a consumer
    that opens ``<pool>/shares`` (it can) and flocks it holds up only engines, never the node."""
    import fcntl
    import stat
    import time

    pool = make_pool("kv", capacity=16 * MiB, partitions=2, min_segment=4 * MiB)
    fd = os.open(pool / shares.SHARES_NAME, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what a pod can do
        t0 = time.monotonic()
        index = shares.reserve(pool, 2, "a-pod", timeout=5)
        assert shares.unreserve(pool, index, "a-pod", timeout=5)
        took = time.monotonic() - t0
    finally:
        os.close(fd)
    assert took < 1, f"a reservation waited {took:.1f} s for a consumer's flock"
    mutex = pool.parent / ".state" / "kv" / shares.MUTEX_NAME
    st = os.lstat(mutex)
    assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


def test_a_reservation_and_an_engine_claim_racing_never_share_a_share(make_pool: PoolFactory) -> None:
    """Without a common mutex (the engines' is pod-reachable, the node's root-only), the share's
    lease arbitrates: of a csi reservation and an engine's claim racing for the one free share,
    exactly one wins, every time."""
    import threading

    pool = make_pool("kv", capacity=8 * MiB, partitions=2, min_segment=4 * MiB)
    held = shares.claim(pool, 2, owner="squatter")  # one share taken: the racers want the other
    try:
        for round_ in range(200):
            got: dict[str, object] = {}
            go = threading.Barrier(2)

            def reserve(go: threading.Barrier = go, got: dict[str, object] = got) -> None:
                go.wait()
                try:
                    got["pod"] = shares.reserve(pool, 2, "a-pod", timeout=5)
                except shares.ShareRefused:
                    got["pod"] = None

            def claim(go: threading.Barrier = go, got: dict[str, object] = got) -> None:
                go.wait()
                try:
                    got["engine"] = shares.claim(pool, 2, owner="engine", timeout=5)
                except shares.ShareRefused:
                    got["engine"] = None

            threads = [threading.Thread(target=reserve), threading.Thread(target=claim)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            engine = got["engine"]
            winners = [w for w in (got["pod"], engine) if w is not None]
            assert len(winners) == 1, f"round {round_}: pod {got['pod']}, engine {engine}"
            if isinstance(engine, shares.Claim):
                engine.close()
            else:
                assert shares.unreserve(pool, 1 - held.index, "a-pod")
    finally:
        held.close()


def test_an_engine_joining_another_pods_share_is_seen_by_the_node(
    make_pool: PoolFactory, cgroups: Cgroups
) -> None:
    """Over hostPath an engine names its own owner, so it can join another pod's share; the
    node cannot stop that, but it sees it: each holder's pod comes from the cgroup the kubelet
    put it in, not from what the engine wrote. Two "pods" (processes in two pod-named cgroups)
    claim with one owner: the share's state names both pods and says it is crossed; one pod
    alone is not."""
    pool = make_pool("kv", capacity=16 * MiB, partitions=2, min_segment=4 * MiB)
    pod_a, pod_b = "0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01", "0b7c4a52-2222-4c3e-9d1a-6f2b8e0c1a02"
    cg_a, cg_b = cgroups.pod(pod_a), cgroups.pod(pod_b)

    def engine(group: Path, fill: int) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", textwrap.dedent(ENGINE), str(pool), "shared-owner", "0", str(fill)]
        return subprocess.Popen(
            in_cgroups([group], argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first = engine(cg_a, 0x31)
    try:
        share = int(ready(first)["share"])  # type: ignore[call-overload]
        alone = shares.states(pool, 2)[share]
        assert alone.pods == (pod_a,) and alone.crossed() is None
        second = engine(cg_b, 0x32)
        try:
            assert ready(second)["share"] == share  # joined under the same owner
            state = shares.states(pool, 2)[share]
            assert state.pods == (pod_a, pod_b)
            assert state.crossed() == f"share {share} is held by processes of 2 pods: {pod_a}, {pod_b}"
            shown = NodeShare.of(state)
            assert shown.pods == [pod_a, pod_b] and shown.engines == 2
        finally:
            stop(second)
    finally:
        stop(first)


@pytest.mark.parametrize(
    ("path", "uid"),
    [
        (
            "/kubepods/burstable/pod0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01/4f1d",
            "0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01",
        ),
        ("/kubepods/pod0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01/4f1d", "0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01"),
        (
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0b7c4a52_1111_4c3e_9d1a_6f2b8e0c1a01"
            ".slice/cri-containerd-4f1d.scope",
            "0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01",
        ),
        # a pod that could make cgroups below its own names a second pod level: the first counts
        (
            "/kubepods/pod0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01/4f1d/pod0b7c4a52-2222-4c3e-9d1a-6f2b8e0c1a02",
            "0b7c4a52-1111-4c3e-9d1a-6f2b8e0c1a01",
        ),
        ("/system.slice/containerd.service", None),
        ("/user.slice/podman-pod0b7c.scope", None),
    ],
)
def test_the_pod_of_a_cgroup_path_is_the_kubelets_level(path: str, uid: str | None) -> None:
    from offloadpool.region.holding import pod_cgroup  # here: the module loads on older commits

    assert pod_cgroup.pod_of_path(path) == uid


def test_a_share_shows_how_it_was_given(make_pool: PoolFactory) -> None:
    """A csi volume's reservation reads ``CSI`` (holder the pod's uid), a DRA claim's ``DRA``
    (holder ``claim/<uid>``), an engine's flock ``Engine``; a free share none."""
    pool = make_pool("kv", capacity=24 * MiB, partitions=3, min_segment=4 * MiB)
    pod, claim = "0b7c4a52-5555-4c3e-9d1a-6f2b8e0c1a05", shares.claim_owner("7d0e-claim")
    shares.reserve(pool, 3, pod, only=0)
    shares.reserve(pool, 3, claim, only=1)
    engine = start(pool, "engine-1", 0x41)
    try:
        assert ready(engine)["share"] == 2
        got = [(s.via, s.holder) for s in shares.states(pool, 3)]
        assert got == [("CSI", pod), ("DRA", claim), ("Engine", "engine-1")]
    finally:
        stop(engine)
    assert shares.states(pool, 3)[2].via is None
