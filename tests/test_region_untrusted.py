"""Every name in a pool directory is a pod's to write: the node side never follows one.

A pod given a pool sees ``<root>/<pool>`` read-write and, as uid 0, can replace any name in it.
Each case here does what such a pod would: it puts a symbolic link to a root-owned file outside
the pool, a dangling link, a fifo or a hard link at a name the agent or the CLI touches, then
provisions the pool for another uid (what the agent does on every start and every ``consumers``
change) or releases it, and checks that the file outside is untouched (content, owner, mode),
that nothing was created outside the pool, and the outcome: the pool rebuilt when nothing holds
it, Failed naming the entry and why when something does. Real mounts, files and processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.host import hugepage_totals, private_mounts_python
from offloadpool.region.errors import RegionError
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
SEG = 4 * MiB
NAME = "kv"

#: the names of a plain two-segment pool and of a stock-vLLM compat pool the node side touches
PLAIN_NAMES = ["lease", "manifest.json", "mnt/r0-s000", "mnt/r0-s001"]
COMPAT_NAMES = ["mnt/vllm_offload_eng.mmap"]
#: where an older offloadpool kept its record and journal: a pod can plant them there
OLD_NAMES = ["state.json", "populate.journal"]
KINDS = ["symlink", "dangling", "fifo", "hardlink"]


def plain(uid: int) -> PoolRequest:
    return PoolRequest(
        name=NAME, capacity=2 * SEG, medium="Memory", min_segment=SEG, max_files=2, uid=uid, gid=uid
    )


def compat(uid: int) -> PoolRequest:
    return PoolRequest(name=NAME, capacity=SEG, medium="Memory", uid=uid, gid=uid, compat_engine_id="eng")


class Outside:
    """A root-owned 0644 file outside the pool, as big as a segment (so no size check gives a
    link away), and the path a dangling link points at."""

    def __init__(self, where: Path) -> None:
        where.mkdir()
        self.file = where / "precious"
        self.file.write_bytes(b"not the pool's " * (SEG // 15) + b"x" * (SEG % 15))
        os.chown(self.file, 0, 0)
        os.chmod(self.file, 0o644)
        self.missing = where / "created-by-the-node"
        self.before = self.facts()

    def facts(self) -> tuple[str, int, int, int]:
        st = os.stat(self.file)
        return (
            hashlib.sha256(self.file.read_bytes()).hexdigest(),
            st.st_uid,
            st.st_gid,
            stat.S_IMODE(st.st_mode),
        )

    def untouched(self) -> None:
        assert self.facts() == self.before, "the file outside the pool was changed"
        assert not os.path.lexists(self.missing), "the node created a file outside the pool"


@pytest.fixture
def outside(tmp_path: Path) -> Outside:
    return Outside(tmp_path / "elsewhere")


def plant(pool: Path, rel: str, kind: str, outside: Outside) -> None:
    """Replace ``rel`` in the pool as a pod running as root could."""
    path = pool / rel
    if os.path.lexists(path):
        path.unlink()
    if kind == "symlink":
        path.symlink_to(outside.file)
    elif kind == "dangling":
        path.symlink_to(outside.missing)
    elif kind == "fifo":
        os.mkfifo(path)
    elif rel.startswith("mnt/"):
        # a hard link cannot leave the pool's own mount: alias another file of it
        other = pool / "mnt" / ("r0-s000" if rel != "mnt/r0-s000" else "r0-s001")
        if not other.exists():
            other = pool / "mnt" / "alias"
            other.write_bytes(b"\0" * SEG)
        os.link(other, path)
    else:
        os.link(outside.file, path)  # the pool directory and the outside file share a file system


def kind_of(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "file" if stat.S_ISREG(mode) else "other"


def cases(names: list[str], kinds: list[str] = KINDS) -> list[tuple[str, str]]:
    return [(n, k) for n in names for k in kinds]


@pytest.mark.parametrize(("rel", "kind"), cases(PLAIN_NAMES))
def test_a_replaced_name_is_never_followed_and_the_pool_is_rebuilt(region_root, outside, rel, kind):
    first = provision(plain(1001), region_root)
    pool = first.pool_dir
    plant(pool, rel, kind, outside)
    again = provision(plain(1003), region_root)
    outside.untouched()
    assert again.rebuilt and not again.reused, again
    for name in PLAIN_NAMES:
        assert kind_of(pool / name) == "file", name
        st = os.lstat(pool / name)
        assert st.st_nlink == 1, name
        if name in ("manifest.json", "lease"):  # root's: no consumer writes them
            assert (st.st_uid, st.st_gid) == (0, 0), name
        else:
            assert (st.st_uid, st.st_gid) == (1003, 1003), name
    assert pool_state(region_root, NAME).phase == "Ready"


@pytest.mark.parametrize(("rel", "kind"), cases(COMPAT_NAMES, ["symlink", "dangling", "fifo"]))
def test_a_replaced_compat_name_is_never_followed_and_relinked_in_place(region_root, outside, rel, kind):
    """vLLM's name is only a second link of a segment: whatever a pod made of it is removed as a
    name and linked again, the memory kept (the pool reused, not rebuilt)."""
    pool = provision(compat(1001), region_root).pool_dir
    plant(pool, rel, kind, outside)
    again = provision(compat(1003), region_root)
    outside.untouched()
    assert again.reused and not again.rebuilt, again
    seg, link = os.lstat(pool / "mnt/r0-s000"), os.lstat(pool / rel)
    assert stat.S_ISREG(link.st_mode) and (link.st_dev, link.st_ino) == (seg.st_dev, seg.st_ino)
    assert seg.st_nlink == 2 and (seg.st_uid, seg.st_gid) == (1003, 1003)


@pytest.mark.parametrize("kind", ["symlink", "dangling", "fifo", "file"])
def test_what_a_pod_changed_of_a_held_pool_is_named_at_the_check_and_repaired(
    region_root, outside, processes, kind
):
    """Issue 36: the agent checks a Ready pool's entries at every heartbeat
    (``handed_out_problem``, the check a provision makes) and provisions again when a pod
    changed one: a compat name replaced by a link to a host file, in a pool an engine maps, is
    named, relinked to its segment in place and the engine's memory kept; the file is untouched."""
    from offloadpool.region.files import layout_files
    from offloadpool.region.files.planner import plan as make_plan

    req = compat(1001)
    pool = provision(req, region_root).pool_dir
    holder = processes([sys.executable, "-c", HOLDER, str(pool / "mnt/r0-s000")], stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "mapped"
    assert layout_files.handed_out_problem(pool, make_plan(req), req) is None
    rel = COMPAT_NAMES[0]
    if kind == "file":  # a file of the pod's own under the name
        (pool / rel).unlink()
        (pool / rel).touch()  # the pool's mount is full: an empty one
    else:
        plant(pool, rel, kind, outside)
    problem = layout_files.handed_out_problem(pool, make_plan(req), req)
    assert problem is not None and f"{pool / rel} is " in problem and "not a link of segment" in problem
    again = provision(req, region_root)
    outside.untouched()
    assert again.reused and not again.rebuilt, again
    seg, link = os.lstat(pool / "mnt/r0-s000"), os.lstat(pool / rel)
    assert (link.st_dev, link.st_ino) == (seg.st_dev, seg.st_ino)
    assert layout_files.handed_out_problem(pool, make_plan(req), req) is None
    assert pool_state(region_root, NAME).phase == "Ready"
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "kept!"


@pytest.mark.parametrize(("rel", "kind"), cases(OLD_NAMES))
def test_old_record_and_journal_names_in_the_pool_are_never_read_or_written(region_root, outside, rel, kind):
    pool = provision(plain(1001), region_root).pool_dir
    plant(pool, rel, kind, outside)
    again = provision(plain(1003), region_root)  # a consumers change: applied in place
    outside.untouched()
    assert again.reused, again
    released = release(region_root, NAME)
    outside.untouched()
    assert released.existed and not pool.exists()


@pytest.mark.parametrize(("rel", "kind"), cases(PLAIN_NAMES + OLD_NAMES))
def test_release_removes_names_as_names(region_root, outside, rel, kind):
    pool = provision(plain(1001), region_root).pool_dir
    plant(pool, rel, kind, outside)
    result = release(region_root, NAME)
    outside.untouched()
    assert result.existed and not os.path.lexists(pool)
    assert mounts.mounts_under(region_root) == []
    assert not (region_root / ".state").exists()


@pytest.mark.parametrize("kind", ["symlink", "dangling", "fifo"])
def test_a_replaced_mount_point_is_neither_followed_nor_mounted_over(region_root, outside, kind):
    """After a reboot (the mount gone), ``mnt`` itself is a plain name a pod can replace."""
    pool = provision(plain(1001), region_root).pool_dir
    mounts.umount(pool / "mnt")
    (pool / "mnt").rmdir()
    if kind == "symlink":
        (pool / "mnt").symlink_to(outside.file.parent)
    else:
        plant(pool, "mnt", kind, outside)
    again = provision(plain(1003), region_root)
    outside.untouched()
    assert again.rebuilt
    assert mounts.mount_at(outside.file.parent) is None, "the pool was mounted over a directory outside it"
    assert sorted(p.name for p in outside.file.parent.iterdir()) == ["precious"]
    assert stat.S_ISDIR(os.lstat(pool / "mnt").st_mode) and mounts.mount_at(pool / "mnt") is not None


HOLDER = r"""
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_SHARED)
m[:5] = b"kept!"
print("mapped", flush=True)
sys.stdin.readline()
print(m[:5].decode(), flush=True)
"""


@pytest.mark.parametrize(
    ("rel", "kind"),
    [
        ("lease", "symlink"),
        ("lease", "fifo"),
        ("lease", "hardlink"),
        ("manifest.json", "symlink"),
        ("manifest.json", "fifo"),
        ("mnt/r0-s001", "symlink"),
        ("mnt/r0-s001", "fifo"),
        ("mnt/r0-s001", "hardlink"),
    ],
)
def test_a_replaced_name_in_a_held_pool_fails_it_naming_the_entry(region_root, outside, processes, rel, kind):
    pool = provision(plain(1001), region_root).pool_dir
    holder = processes([sys.executable, "-c", HOLDER, str(pool / "mnt/r0-s000")], stdin=subprocess.PIPE)
    assert holder.stdout.readline().strip() == "mapped"
    plant(pool, rel, kind, outside)
    with pytest.raises(RegionError) as info:
        provision(plain(1003), region_root)
    assert not isinstance(info.value, LeaseHeld)
    message = str(info.value)
    assert str(pool) in message and "not followed" in message and "held" in message, message
    outside.untouched()
    state = pool_state(region_root, NAME)
    assert state.phase == "Failed" and "not followed" in state.message, state
    assert mounts.mount_at(pool / "mnt") is not None  # the memory was left as it was
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "kept!"


def record_path(root: Path) -> Path:
    """The node's record: in the state directory (or, in an older offloadpool, the pool's)."""
    new = root / ".state" / NAME / "state.json"
    return new if new.exists() else root / NAME / "state.json"


def test_a_forged_record_in_the_pool_directory_cannot_shrink_the_huge_page_pool(
    region_root, hugepage_baseline
):
    req = PoolRequest(name=NAME, capacity=4 * MiB, medium="HugePages-2Mi")
    provision(req, region_root)
    real = json.loads(record_path(region_root).read_text())
    forged = dict(real, hugepages_added=real["hugepages_added"] + 100, hugepage_size=2 * MiB)
    (region_root / NAME / "state.json").write_text(json.dumps(forged))
    before = hugepage_totals()[2 * MiB]
    provision(req, region_root)
    result = release(region_root, NAME)
    assert result.hugepages_returned == real["hugepages_added"]
    assert hugepage_totals()[2 * MiB] == before - real["hugepages_added"]


def make_old_layout(root: Path) -> None:
    """The pool as an older offloadpool left it: record and journal in the pool directory."""
    state = root / ".state" / NAME
    for name in ("state.json", "populate.journal"):
        os.rename(state / name, root / NAME / name)
    state.rmdir()
    (root / ".state").rmdir()


def test_an_old_layout_pool_that_re_validates_is_adopted_with_its_memory(region_root, hugepage_baseline):
    req = PoolRequest(name=NAME, capacity=4 * MiB, medium="HugePages-2Mi")
    pool = provision(req, region_root).pool_dir
    fd = os.open(pool / "mnt/r0-s000", os.O_RDWR)
    try:
        with mmap.mmap(fd, 2 * MiB) as m:
            m[:6] = b"cached"
    finally:
        os.close(fd)
    old = json.loads((region_root / ".state" / NAME / "state.json").read_text())
    make_old_layout(region_root)
    again = provision(req, region_root)
    assert again.reused and not again.rebuilt
    assert (pool / "mnt/r0-s000").read_bytes()[:6] == b"cached"
    adopted = json.loads((region_root / ".state" / NAME / "state.json").read_text())
    assert adopted["phase"] == "Ready" and adopted["hugepages_added"] == 0
    assert adopted["request"] == old["request"]
    assert not (pool / "state.json").exists() and not (pool / "populate.journal").exists()


def test_an_old_layout_record_that_does_not_re_validate_is_not_trusted(region_root, hugepage_baseline):
    req = PoolRequest(name=NAME, capacity=4 * MiB, medium="HugePages-2Mi")
    pool = provision(req, region_root).pool_dir
    make_old_layout(region_root)
    forged = json.loads((pool / "state.json").read_text())
    forged["request"]["capacity"] = 8 * MiB  # not what the mount holds
    forged["hugepages_added"] = 100
    forged["hugepage_size"] = 2 * MiB
    (pool / "state.json").write_text(json.dumps(forged))
    before = hugepage_totals()[2 * MiB]
    again = provision(req, region_root)
    assert again.rebuilt and not again.reused
    assert hugepage_totals()[2 * MiB] >= before, "a forged record shrank the huge page pool"
    result = release(region_root, NAME)
    assert result.hugepages_returned == again.hugepages_added


def test_a_manifest_with_sizes_as_strings_is_refused_and_rewritten(region_root):
    """Sizes must be JSON integers: "4194304" is not coerced into one (and trusted)."""
    pool = provision(plain(1001), region_root).pool_dir
    manifest = json.loads((pool / "manifest.json").read_text())
    for region in manifest["regions"]:
        region["bytes"] = str(region["bytes"])
    (pool / "manifest.json").unlink()
    (pool / "manifest.json").write_text(json.dumps(manifest))
    again = provision(plain(1001), region_root)
    assert again.rebuilt
    assert json.loads((pool / "manifest.json").read_text())["regions"][0]["bytes"] == 2 * SEG


@pytest.mark.parametrize(
    ("where", "value", "said"),
    [
        (("regions", 0, "segments", 0, "file"), "mnt/../../etc/passwd", "plain name in mnt/"),
        (("regions", 0, "segments", 0, "file"), "lease", "plain name in mnt/"),
        (("regions", 0, "segments", 0, "file"), "/etc/passwd", "plain name in mnt/"),
        (("regions", 0, "segments", 1, "file"), "mnt/r0-s000", "listed twice"),
        (("regions", 0, "segments", 0, "bytes"), "4194304", "wrong type"),
        (("regions", 0, "segments", 0, "offset"), False, "wrong type"),
        (("compat_file",), "../../etc/shadow", "plain name in mnt/"),
        (("uid",), -1, "out of range"),
        (("mode",), 0o17777, "out of range"),
        (("generation",), 1.5, "wrong type"),
        (("regions",), "mnt/r0-s000", "malformed"),
    ],
)
def test_manifest_content_is_checked_before_use(region_root, where, value, said):
    from offloadpool.region.files.manifest import ManifestError
    from offloadpool.region.files.manifest import load as load_manifest

    pool = provision(plain(1001), region_root).pool_dir
    manifest = json.loads((pool / "manifest.json").read_text())
    node = manifest
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    (pool / "manifest.json").unlink()
    (pool / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=said):
        load_manifest(pool)


def test_pool_and_mount_directories_are_root_owned_and_not_writable_by_consumers(region_root):
    pool = provision(plain(1001), region_root).pool_dir
    os.chmod(pool, 0o777)
    os.chown(pool / "mnt", 1001, 1001)
    provision(plain(1003), region_root)
    for path in (pool, pool / "mnt"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755), path
    state = os.lstat(region_root / ".state" / NAME)
    assert (state.st_uid, stat.S_IMODE(state.st_mode)) == (0, 0o700)
    assert stat.S_IMODE(os.lstat(region_root / ".state").st_mode) == 0o700


def test_a_pod_locking_its_pool_directory_does_not_stop_the_node(region_root):
    pool = provision(plain(1001), region_root).pool_dir
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert provision(plain(1003), region_root).reused
        assert time.monotonic() - t0 < 60
    finally:
        os.close(fd)


BAD_NAMES = ["..", "x/../..", "/", ".state", "", "KV", "p" * 41, "kv/../other"]

#: Runs in a mount namespace of its own (``private_mounts_python``) in which every mount is made
#: read-only first: only the scratch tmpfs mounted afterwards can be written, so a command that
#: climbs out of its root (``release /`` once ran ``rmtree("/")``) can harm nothing but the
#: scratch directory. Prints what each command and library call did, and the scratch tree
#: before and after, as JSON.
BAD_NAMES_SCRIPT = r"""
import ctypes, json, os, subprocess, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
scratch, names = sys.argv[1], json.loads(sys.argv[2])
for line in open("/proc/self/mountinfo").read().splitlines():
    target = line.split()[4].encode().decode("unicode_escape")
    if libc.mount(None, target.encode(), None, MS_BIND | MS_REMOUNT | MS_RDONLY, None) != 0:
        sys.exit(f"cannot make {target} read-only: {os.strerror(ctypes.get_errno())}")
try:
    open("/tmp/.offloadpool-must-not-exist", "w")
    sys.exit("the namespace's /tmp is still writable")
except OSError:
    pass
if libc.mount(b"scratch", scratch.encode(), b"tmpfs", 0, b"size=16m") != 0:
    sys.exit(f"cannot mount the scratch tmpfs: {os.strerror(ctypes.get_errno())}")
root = os.path.join(scratch, "base", "root")
for d in ("base/root/x", "base/root/kv/mnt", "base/root/other/mnt", "base/root/.state/kv"):
    os.makedirs(os.path.join(scratch, d))
kept = ("keep", "base/keep", "base/root/kv/lease", "base/root/other/mnt/r0-s000",
        "base/root/.state/kv/state.json")
for f in kept:
    with open(os.path.join(scratch, f), "w") as fh:
        fh.write("keep\n")

def tree():
    return sorted(os.path.relpath(os.path.join(d, n), scratch) for d, ds, fs in os.walk(scratch)
                  for n in ds + fs)

before = tree()
env = dict(os.environ, COLUMNS="400", PYTHONDONTWRITEBYTECODE="1")
runs = []
for name in names:
    for args in (
        ["release", name], ["release", name, "--force"], ["status", name],
        ["provision", "--name", name, "--capacity", "4Mi", "--medium", "Memory"],
    ):
        p = subprocess.run([sys.executable, "-m", "offloadpool.cli", *args, "--root", root],
                           capture_output=True, text=True, env=env, timeout=120)
        runs.append({"args": args, "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr})
from offloadpool.region.errors import RequestError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.request import PoolRequest
from offloadpool.region.lifecycle.status import pool_state
calls = []
for name in names:
    for what, call in (
        ("release", lambda: release(root, name, force=True)),
        ("pool_state", lambda: pool_state(root, name)),
        ("provision", lambda: provision(PoolRequest(name=name, capacity=4 << 20, medium="Memory"), root)),
    ):
        try:
            call()
            calls.append([what, name, "accepted"])
        except RequestError as exc:
            calls.append([what, name, "refused: " + str(exc)])
        except Exception as exc:
            calls.append([what, name, f"other: {exc!r}"])
print(json.dumps({"before": before, "after": tree(), "runs": runs, "calls": calls}))
"""


def test_bad_names_are_refused_at_every_entry_point_before_any_path_is_made(tmp_path):
    """``release``/``status``/``provision`` (CLI and library) refuse a name that is no pool
    name with one message (exit 2) and touch nothing, even one that would climb out of the
    root: run only in a private mount namespace where nothing but a scratch tmpfs is writable."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = subprocess.run(
        private_mounts_python(BAD_NAMES_SCRIPT, str(scratch), json.dumps(BAD_NAMES)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["after"] == report["before"], "a refused name changed the scratch tree"
    assert len(report["runs"]) == 4 * len(BAD_NAMES)
    for run in report["runs"]:
        lines = [line for line in run["stderr"].splitlines() if line.strip()]
        assert run["rc"] == 2, run
        assert len(lines) == 1 and lines[0].startswith("invalid: pool name"), run
    assert len(report["calls"]) == 3 * len(BAD_NAMES)
    for what, name, outcome in report["calls"]:
        assert outcome.startswith("refused: pool name"), (what, name, outcome)


# -- bounded inputs: nothing a pod writes wedges status, release or a publish ------------------

#: What a pod can write into a JSON file of its pool that a parser catching only decode errors
#: does not survive: an integer beyond Python's int-string limit (ValueError) and nesting deeper
#: than the decoder's recursion (RecursionError).
HOSTILE_JSON = {
    "5000-digit integer": b'{"format": "offloadpool.io/region-manifest", "version": 1, "generation": '
    + b"9" * 5000
    + b"}",
    "deep nesting": b'{"extra": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
}


def write_as_a_pod(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``, as a root consumer can through its pool mount."""
    if os.path.lexists(path):
        path.unlink()
    path.write_bytes(data)


@pytest.mark.parametrize("force", [False, True], ids=["release", "release --force"])
@pytest.mark.parametrize("payload", list(HOSTILE_JSON))
def test_a_hostile_manifest_never_wedges_status_or_release(region_root, payload, force):
    from offloadpool.cli.main import main as cli_main

    pool = provision(plain(1001), region_root).pool_dir
    write_as_a_pod(pool / "manifest.json", HOSTILE_JSON[payload])

    state = pool_state(region_root, NAME)
    assert state.phase == "Failed" and "manifest" in state.message, state
    assert cli_main(["status", NAME, "--root", str(region_root)]) in (0, 1)
    result = release(region_root, NAME, force=force)
    assert result.existed and not mounts.mounts_under(region_root), "the memory is still mounted"
    assert not pool.exists() and not (region_root / ".state" / NAME).exists()


@pytest.mark.parametrize("payload", list(HOSTILE_JSON))
def test_a_hostile_manifest_is_reported_and_rebuilt(region_root, payload):
    from offloadpool.region.files.manifest import load as load_manifest

    pool = provision(plain(1001), region_root).pool_dir
    write_as_a_pod(pool / "manifest.json", HOSTILE_JSON[payload])
    again = provision(plain(1001), region_root)
    assert again.rebuilt
    assert load_manifest(pool).total_bytes == 2 * SEG


def test_a_hostile_old_record_in_the_pool_directory_is_not_adopted(region_root, hugepage_baseline):
    req = PoolRequest(name=NAME, capacity=4 * MiB, medium="HugePages-2Mi")
    pool = provision(req, region_root).pool_dir
    make_old_layout(region_root)
    write_as_a_pod(pool / "state.json", HOSTILE_JSON["deep nesting"])
    again = provision(req, region_root)
    assert again.rebuilt and not again.reused
    assert not (pool / "state.json").exists()
    release(region_root, NAME)


def test_a_hostile_share_claim_record_never_wedges_status_or_a_reservation(region_root):
    """An engine writes its claim record into the share's lease: 1 KiB of ``[`` is deeper than
    the decoder's recursion. The node still sees the share held, status answers, a csi
    reservation takes the other share, and release takes the pool apart."""
    from offloadpool.region.holding import shares

    req = PoolRequest(name=NAME, capacity=2 * SEG, medium="Memory", min_segment=SEG, partitions=2)
    pool = provision(req, region_root).pool_dir
    fd = os.open(pool / "shares" / "0" / "lease", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # an engine holding share 0
        os.pwrite(fd, b"[" * shares.RECORD_LIMIT, 0)
        state = pool_state(region_root, NAME)
        assert [(s.index, bool(s.holders), s.owner) for s in state.shares] == [(0, True, ""), (1, False, "")]
        assert shares.reserve(pool, 2, "a-pod", timeout=5) == 1
        assert shares.unreserve(pool, 1, "a-pod")
    finally:
        os.close(fd)
    assert release(region_root, NAME).existed
    assert not mounts.mounts_under(region_root)


def test_the_bounded_reader_refuses_each_unbounded_input_as_malformed():
    from offloadpool.region.files import bounded

    assert bounded.loads(b'{"a": [1, 2.5e-05, "x[[["], "b": {"c": null}}') == {
        "a": [1, 2.5e-05, "x[[["],
        "b": {"c": None},
    }
    for data, said in [
        (b"[" * 17 + b"]" * 17, "deeper than 16"),
        (b"1" * 33, "number of 33 characters"),
        (b'{"n": NaN}', "NaN"),
        (b'{"n": -Infinity}', "Infinity"),
        (b"x" * 65, "more than 64 bytes"),
        (b"\xff", "not valid JSON"),
        (b"{", "not valid JSON"),
    ]:
        with pytest.raises(bounded.Malformed, match=said):
            bounded.loads(data, limit=64)
