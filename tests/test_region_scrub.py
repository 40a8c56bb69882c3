"""No bytes cross consumers: a pool's memory is zeroed before another consumer can map it.

Real processes on real mounts: tenant A (its own uid) maps the segment files, writes a pattern
and exits; the pool is provisioned again (the real CLI) for tenant B; B, as its own uid, maps the
files and reads. Under ``OnConsumerChange`` and ``Always`` B reads zeros, under ``Never`` A's
bytes; the memory stays populated (the mount's used blocks), the mount and files are the same
ones. A scrub never runs under a holder, and a kill in the middle of one leaves the pool withheld
(no manifest, root-only files) until the next provision finishes it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fixtures.host import cli
from offloadpool.region.files import record as records
from offloadpool.region.files.manifest import MANIFEST_NAME
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.scrub import Due, scrub_needed
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
NAME = "tenants"
A, B = 1001, 1002
CRASH_AT = str(Path(__file__).parent / "fixtures" / "crash_at.py")

#: A tenant as its own uid and gid: ``write`` a pattern at the start, middle and end of every
#: segment; ``read`` every byte back (all zero? how many patterns?); ``hold`` the files mapped
#: until stdin closes.
TENANT = r"""
import json, mmap, os, sys
op, paths, uid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)  # the interpreter started as root (it lives where other uids may not run it)
pat = b"TENANT-A" * 8192
maps, out = [], []
for p in paths:
    try:
        fd = os.open(p, os.O_RDWR if op != "read" else os.O_RDONLY)
    except PermissionError:
        out.append({"denied": True})
        continue
    size = os.fstat(fd).st_size
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if op != "read" else 0)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    os.close(fd)
    offsets = (0, size // 2, size - len(pat))
    if op == "write":
        for o in offsets:
            m[o:o + len(pat)] = pat
    elif op == "read":
        found = sum(m[o:o + len(pat)] == pat for o in offsets)
        out.append({"zero": m[:].count(0) == size, "patterns": found})
    maps.append(m)
if op == "hold":
    print("held", flush=True)
    sys.stdin.read()
print(json.dumps(out))
"""


def tenant(op: str, pool_dir: Path, uid: int, **kw):
    """Run one tenant operation as ``uid:uid`` on every segment file of the pool."""
    paths = sorted(str(p) for p in (pool_dir / "mnt").iterdir() if not p.name.startswith("vllm"))
    argv = [sys.executable, "-c", TENANT, op, json.dumps(paths), str(uid)]
    if op == "hold":
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture
def shared_root(hugepage_baseline: dict) -> Iterator[Path]:
    """A pool root other uids can reach. Not under pytest's temporary tree: pytest makes
    ``/tmp/pytest-of-root`` 0700 again whenever a session starts (another run on the machine)."""
    base = Path(tempfile.mkdtemp(prefix="offloadpool-scrub-"))
    os.chmod(base, 0o711)
    root = base / "root"
    root.mkdir(mode=0o755)
    try:
        yield root
    finally:
        for child in root.iterdir():
            try:
                release(root, child.name, force=True)
            except Exception:  # the raw cleanup below
                pass
        for m in reversed(mounts.mounts_under(base)):
            mounts.umount(m.target, lazy=True)
        shutil.rmtree(base, ignore_errors=True)


def provision_argv(root: Path, medium: str, uid: int, *extra: str) -> list[str]:
    """``offloadpool provision``'s arguments for the test pool, its files ``uid``:``uid``'s."""
    return [
        "provision",
        "--root",
        str(root),
        "--name",
        NAME,
        "--capacity",
        "64Mi",
        "--min-size",
        "16Mi",
        "--medium",
        medium,
        "--uid",
        str(uid),
        "--gid",
        str(uid),
        *extra,
    ]


def provision(root: Path, medium: str, uid: int, scrub: str, *extra: str, check: bool = True):
    return cli(*provision_argv(root, medium, uid, "--scrub", scrub, "--json", *extra), check=check)


def used_bytes(mnt: Path) -> int:
    """Bytes the mount's file system holds (tmpfs pages, hugetlbfs pages in use)."""
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def files(pool_dir: Path) -> dict[str, tuple[int, int, int, int, int]]:
    """name -> (device, inode, size, uid, mode) of every segment file."""
    out = {}
    for p in sorted((pool_dir / "mnt").iterdir()):
        st = os.stat(p)
        out[p.name] = (st.st_dev, st.st_ino, st.st_size, st.st_uid, st.st_mode & 0o7777)
    return out


MEDIA = ("Memory", "HugePages-2Mi", "MemoryTHP")


@pytest.mark.parametrize(
    ("policy", "next_uid", "zeroed"),
    [
        ("OnConsumerChange", B, True),
        ("Always", B, True),
        ("Never", B, True),  # Never keeps the memory only for the same consumer
        ("Never", A, False),
        ("OnConsumerChange", A, False),  # the same consumer keeps its memory
        ("Always", A, True),  # ... unless every hand-out after its holders left is zeroed
    ],
)
@pytest.mark.parametrize("medium", MEDIA)
def test_what_the_next_consumer_reads(shared_root, medium, policy, next_uid, zeroed):
    pool_dir = shared_root / NAME
    provision(shared_root, medium, A, policy)
    tenant("write", pool_dir, A)  # A attaches, writes, exits
    assert all(r["patterns"] == 3 for r in tenant("read", pool_dir, A))
    before, used = files(pool_dir), used_bytes(pool_dir / "mnt")
    assert used >= 64 * MiB

    result = json.loads(provision(shared_root, medium, next_uid, policy).stdout)

    assert result["reused"], "the region is reused, never rebuilt, for a consumer change"
    seen = tenant("read", pool_dir, next_uid)
    assert len(seen) == len(before) >= 4
    if zeroed:
        assert all(r["zero"] for r in seen), f"{medium}/{policy}: uid {next_uid} read another's bytes"
    else:
        assert all(r["patterns"] == 3 for r in seen), f"{medium}/{policy}: the memory was not kept"
    # still populated (no fault moved to the engine), the same mount and files, owned by the consumer
    assert used_bytes(pool_dir / "mnt") == used
    after = files(pool_dir)
    assert {n: v[:3] for n, v in after.items()} == {n: v[:3] for n, v in before.items()}
    assert {v[3] for v in after.values()} == {next_uid}
    assert {v[4] for v in after.values()} == {0o660}
    rec = records.load(pool_dir)
    assert rec is not None and rec.scrub_pending == "" and rec.consumer["uid"] == next_uid
    assert load_manifest(pool_dir).uid == next_uid
    assert bool(rec.scrub) == zeroed and pool_state(shared_root, NAME).phase == "Ready"


@pytest.mark.parametrize("medium", ("Memory", "HugePages-2Mi"))
def test_scrub_waits_for_holders_and_withholds_the_pool(shared_root, medium):
    pool_dir = shared_root / NAME
    provision(shared_root, medium, A, "OnConsumerChange")
    tenant("write", pool_dir, A)
    holder = tenant("hold", pool_dir, A)
    assert holder.stdout.readline().strip() == "held"

    refused = provision(shared_root, medium, B, "OnConsumerChange", check=False)

    assert refused.returncode == 3, refused.stderr  # held: nothing touched, the change pending
    assert "consumers changed (uid 1001 -> 1002" in refused.stderr
    # the memory is untouched under its holder, and nothing new can attach
    assert all(r["patterns"] == 3 for r in tenant("read", pool_dir, 0))
    assert not (pool_dir / MANIFEST_NAME).exists()
    assert {v[3:] for v in files(pool_dir).values()} == {(0, 0o600)}
    assert all(r.get("denied") for r in tenant("read", pool_dir, B)), "B opened A's memory"
    assert all(r.get("denied") for r in tenant("read", pool_dir, A)), "withheld from new opens"
    state = pool_state(shared_root, NAME)
    assert state.phase == "Scrubbing" and "consumers changed" in state.message
    rec = records.load(pool_dir)
    assert rec is not None and rec.scrub_pending.startswith("consumers changed")

    # the holder leaves: the next provision zeroes and hands the pool to B
    holder.stdin.close()
    holder.wait(timeout=30)
    provision(shared_root, medium, B, "OnConsumerChange")
    assert all(r["zero"] for r in tenant("read", pool_dir, B))
    assert load_manifest(pool_dir).uid == B
    assert records.load(pool_dir).scrub_pending == ""


def test_always_leaves_an_attached_tenancy_alone(shared_root):
    """Always zeroes between holders, never under one: a provision while A is attached keeps A's data."""
    pool_dir = shared_root / NAME
    provision(shared_root, "Memory", A, "Always")
    tenant("write", pool_dir, A)
    holder = tenant("hold", pool_dir, A)
    assert holder.stdout.readline().strip() == "held"
    provision(shared_root, "Memory", A, "Always")
    assert all(r["patterns"] == 3 for r in tenant("read", pool_dir, A))
    assert (pool_dir / MANIFEST_NAME).exists()
    holder.stdin.close()
    holder.wait(timeout=30)
    provision(shared_root, "Memory", A, "Always")
    assert all(r["zero"] for r in tenant("read", pool_dir, A))


@pytest.mark.parametrize("point", ["scrub:zeroed-run", "scrub:zeroed"])
@pytest.mark.parametrize("medium", ("Memory", "HugePages-2Mi"))
def test_kill_mid_scrub_leaves_the_pool_withheld_until_the_next_provision(shared_root, medium, point):
    pool_dir = shared_root / NAME
    provision(shared_root, medium, A, "OnConsumerChange")
    tenant("write", pool_dir, A)
    args = provision_argv(shared_root, medium, B, "--workers", "1")
    killed = subprocess.run(
        [sys.executable, CRASH_AT, point, "1", "offloadpool.cli", *args], capture_output=True, text=True
    )
    assert killed.returncode == -9 and f"CRASH-POINT {point}" in killed.stderr, killed.stderr

    # withheld: no manifest, root-only files, the record says why; B cannot open anything
    assert not (pool_dir / MANIFEST_NAME).exists()
    assert {v[3:] for v in files(pool_dir).values()} == {(0, 0o600)}
    assert all(r.get("denied") for r in tenant("read", pool_dir, B))
    rec = records.load(pool_dir)
    assert rec is not None and rec.scrub_pending.startswith("consumers changed")
    if point == "scrub:zeroed-run":  # killed after one of four files: A's bytes are still there
        assert sum(r["patterns"] for r in tenant("read", pool_dir, 0)) == 9
    assert pool_state(shared_root, NAME).phase == "Scrubbing"

    result = json.loads(cli(*args, "--json").stdout)
    assert result["reused"] and not result["rebuilt"]
    assert all(r["zero"] for r in tenant("read", pool_dir, B))
    assert load_manifest(pool_dir).uid == B and records.load(pool_dir).scrub_pending == ""


@pytest.mark.parametrize("policy", ["OnConsumerChange", "Never"])
def test_a_pool_re_created_over_a_retained_region_is_zeroed(shared_root, tmp_path, policy):
    """Same name, same consumer, another OffloadPool (metadata.uid): the memory is not its,
    whatever ``scrub`` says (``Never`` keeps it only for the same pool coming back)."""
    pool_dir = shared_root / NAME

    def pool_file(uid: str) -> str:
        path = tmp_path / f"{uid}.yaml"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "offloadpool.io/v1alpha1",
                    "kind": "OffloadPool",
                    "metadata": {"name": NAME, "uid": uid},
                    "spec": {
                        "capacity": "64Mi",
                        "medium": "Memory",
                        "segments": {"minSize": "16Mi"},
                        "consumers": {"uid": A, "gid": A, "scrub": policy},
                    },
                }
            )
        )
        return str(path)

    cli("provision", "--root", str(shared_root), "-f", pool_file("3f0c-old"))
    tenant("write", pool_dir, A)
    cli("provision", "--root", str(shared_root), "-f", pool_file("3f0c-old"))
    assert all(r["patterns"] == 3 for r in tenant("read", pool_dir, A)), "the same pool keeps its memory"
    cli("provision", "--root", str(shared_root), "-f", pool_file("9a1d-new"))
    reads = tenant("read", pool_dir, A)
    assert all(r["zero"] for r in reads), f"the new pool reads the old one's memory: {reads}"
    rec = records.load(pool_dir)
    assert rec is not None and "re-created over a retained region" in rec.scrub["reason"]


# -- the decision, case by case (pure) --------------------------------------------------------


def _record(req: PoolRequest, **fields) -> records.Record:
    rec = records.Record.new(req)
    rec.phase = "Ready"
    for k, v in fields.items():
        setattr(rec, k, v)
    return rec


BASE = PoolRequest(name="p", capacity=64 * MiB, uid=A, gid=A, consumer_namespaces="team-a", pool_uid="u1")


@pytest.mark.parametrize(
    ("change", "policy", "owed"),
    [
        ({"uid": B}, "OnConsumerChange", True),
        ({"gid": B}, "OnConsumerChange", True),
        ({"mode": 0o666}, "OnConsumerChange", True),  # others may read now
        ({"mode": 0o600}, "OnConsumerChange", None),  # narrowing: no one new gets it
        ({"consumer_namespaces": "team-b"}, "OnConsumerChange", True),
        ({"consumer_namespaces": "team-a,team-b"}, "OnConsumerChange", True),
        ({"consumer_namespaces": None}, "OnConsumerChange", True),  # any namespace now
        ({"pool_uid": "u2"}, "OnConsumerChange", True),
        ({"uid": B}, "Always", True),
        ({}, "Always", False),
        ({}, "OnConsumerChange", None),
        ({"pool_uid": ""}, "OnConsumerChange", None),  # a pool file without a uid: not compared
        ({"uid": B}, "Never", True),  # Never: not when the same consumer comes back, only
        ({"pool_uid": "u2"}, "Never", True),  # another pool over a retained region
        ({"consumer_namespaces": "team-a,team-b"}, "Never", True),
        ({"mode": 0o600}, "Never", None),
        ({}, "Never", None),
        ({"workers": 7, "generation": 9}, "OnConsumerChange", None),
    ],
)
def test_scrub_needed(change, policy, owed):
    last = {"uid": A, "gid": A, "mode": 0o660, "namespaces": "team-a", "pool_uid": "u1"}
    rec = _record(BASE, consumer=last)
    due = scrub_needed(rec, replace(BASE, scrub=policy, **change))
    assert (None if due is None else due.owed) == owed, due


def test_scrub_needed_pending_and_old_records():
    # an interrupted scrub stays owed whatever the policy says now
    pending = _record(BASE, scrub_pending="consumers changed (uid 1001 -> 1002)")
    assert scrub_needed(pending, replace(BASE, scrub="Never")) == Due("consumers changed (uid 1001 -> 1002)")
    # a record of an older release (no consumer): its request says who had the memory
    old = _record(BASE)
    assert old.consumer is None
    assert scrub_needed(old, replace(BASE, uid=B)) is not None
    assert scrub_needed(old, replace(BASE, pool_uid="u2")) is None  # unknown then: not compared
    # fewer namespaces than before: the same consumers
    wide = _record(BASE, consumer={"namespaces": "team-a,team-b"})
    assert scrub_needed(wide, BASE) is None
    assert scrub_needed(_record(BASE, consumer={"namespaces": None}), BASE) is None
    # memory never handed out (an interrupted first build) is fresh
    fresh = _record(BASE, phase="Populating")
    assert scrub_needed(fresh, replace(BASE, uid=B, scrub="Always")) is None
