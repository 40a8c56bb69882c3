"""A mounted view is a holder; a directory handed to a consumer that lost the right is never reused.

Each "pod" here is a real process in a mount namespace of its own, as a container is: it mounts a
tmpfs as its new root, bind-mounts what the pod is given (the pool directory, as a hostPath
does; or the pool's memory mount alone, as a CSI or CDI bind of its files does), pivots into it
and detaches the host's tree. It then holds no lease, maps nothing and has no file of the pool
open: only its mount shows the pool. The test drives it over stdin ("ls", "write <path>") to
see what its view shows. An "agent" namespace is the same, given all of ``<root>`` (the node's
own view): it holds nothing.

What is asserted: release refuses while a pod's view exists (PoolInUse naming it, "has the pool
mounted"), so do a reshape and an owed scrub; once the pod exits, release proceeds. A release
that finds a pod's file in the pool directory sets the directory aside, out of reach, and the
next pool of that name is a new directory: a mount of the old one (kept by a pod through a
forced release) shows only what the pod left, none of the new pool's files, and does not hold
the new pool. Real mounts, namespaces, processes; nothing outside the scratch root is touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offloadpool.region.files.manifest import MANIFEST_NAME
from offloadpool.region.holding import holders
from offloadpool.region.holding.holders import PoolInUse, find_holders
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.scrub import ScrubPending
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
NAME = "kv"
#: where a release moves a pool directory a pod left files in (``LEFT``); spelled
#: out, not imported, so that this file runs against a product without it (hack/against.py)
STATE = ".state"
LEFT = ".state/.left"

# argv: the new root (an empty directory), then "bind:<src>=<dst>" or "rbind:<src>=<dst>" each
POD = r"""
import ctypes, json, os, subprocess, sys
newroot, specs = sys.argv[1], sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
subprocess.run(["mount", "-t", "tmpfs", "podroot", newroot], check=True)
for spec in specs:
    how, _, rest = spec.partition(":")
    src, _, dst = rest.partition("=")
    os.makedirs(newroot + dst)
    subprocess.run(["mount", "--" + how, src, newroot + dst], check=True)
os.mkdir(newroot + "/old")
subprocess.run(["pivot_root", newroot, newroot + "/old"], check=True)  # moves this process's root
os.chdir("/")
assert libc.umount2(b"/old", 2) == 0, os.strerror(ctypes.get_errno())  # MNT_DETACH: the host is gone
os.rmdir("/old")
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "ls":
        seen = []
        for top, dirs, files in os.walk(arg):
            seen += [os.path.relpath(os.path.join(top, n), arg) for n in dirs + files]
        print(json.dumps(sorted(seen)), flush=True)
    elif cmd == "write":
        with open(arg, "w") as fh:
            fh.write("left by the pod")
        print(json.dumps("written"), flush=True)
"""


class Pod:
    """A process in its own mount namespace whose only view of the node is what it was given."""

    def __init__(self, processes, tmp_path: Path, *specs: str) -> None:
        newroot = tmp_path / f"podroot-{len(list(tmp_path.glob('podroot-*')))}"
        newroot.mkdir()
        argv = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", POD, str(newroot)]
        self.proc = processes([*argv, *specs], stdin=subprocess.PIPE)
        line = self.proc.stdout.readline().split()
        assert line == ["ready", str(self.proc.pid)], (
            f"pod did not start: {line} {self.proc.stderr.read() if self.proc.poll() is not None else ''}"
        )
        assert not any(newroot.iterdir()), "the pod's mounts leaked into the host's namespace"
        self.pid = self.proc.pid

    def ask(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def ls(self, path: str) -> list[str]:
        return self.ask(f"ls {path}")

    def stop(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0, self.proc.stderr.read()


def pool_req(**over) -> PoolRequest:
    return PoolRequest(**{"name": NAME, "capacity": 8 * MiB, "medium": "Memory", **over})


def assert_intact(root: Path, req: PoolRequest) -> None:
    state = pool_state(root, req.name)
    assert state.phase == "Ready" and state.total_bytes == req.capacity
    assert (root / req.name / MANIFEST_NAME).exists()
    assert mounts.mount_at(root / req.name / "mnt") is not None


def test_a_pod_with_only_a_mount_of_the_pool_dir_holds_it(region_root, processes, tmp_path):
    req = pool_req()
    provision(req, region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir}=/pool")
    assert "manifest.json" in pod.ls("/pool")  # what a hostPath of the pool shows

    assert holders.open_anywhere(pool_dir) is False  # nothing open or mapped: only the view
    with pytest.raises(PoolInUse, match=rf"pid {pod.pid} \(python[^)]*\) has the pool mounted") as exc:
        release(region_root, NAME)
    assert [(h.pid, h.mounted, h.mapped, h.open, h.lease) for h in exc.value.holders] == [
        (pod.pid, True, False, False, False)
    ]
    assert_intact(region_root, req)
    assert holders.count(pool_dir) == 1  # status's engines count it
    assert pool_state(region_root, NAME).engines_attached == 1

    # a reshape waits for it like for a mapping, and leaves the pool as it was
    with pytest.raises(PoolInUse, match=rf"pid {pod.pid} .*has the pool mounted"):
        provision(pool_req(capacity=16 * MiB), region_root)
    assert_intact(region_root, req)

    pod.stop()
    assert holders.count(pool_dir) == 0
    result = release(region_root, NAME)
    assert result.existed and result.warnings == ()
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []


def test_a_mount_of_the_memory_alone_holds_the_pool(region_root, processes, tmp_path):
    req = pool_req()
    provision(req, region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir / 'mnt'}=/data")
    assert pod.ls("/data") == ["r0-s000"]

    with pytest.raises(PoolInUse, match=rf"pid {pod.pid} \(python[^)]*\) has the pool mounted"):
        release(region_root, NAME)
    assert_intact(region_root, req)

    pod.stop()
    release(region_root, NAME)
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []


def test_an_owed_scrub_waits_for_a_mounted_view(region_root, processes, tmp_path):
    first = pool_req(uid=1001, gid=1001, scrub="OnConsumerChange")
    provision(first, region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir}=/pool")

    said = rf"consumers changed .*pid {pod.pid} .*has the pool mounted"
    with pytest.raises(ScrubPending, match=said) as exc:
        provision(pool_req(uid=1002, gid=1002, scrub="OnConsumerChange"), region_root)
    assert [h.pid for h in exc.value.holders] == [pod.pid]
    assert not (pool_dir / MANIFEST_NAME).exists()  # withheld: nothing new attaches
    assert "manifest.json" not in pod.ls("/pool")

    pod.stop()
    provision(pool_req(uid=1002, gid=1002, scrub="OnConsumerChange"), region_root)
    assert pool_state(region_root, NAME).phase == "Ready"


def test_a_namespace_seeing_all_of_the_root_is_the_nodes_own(region_root, processes, tmp_path):
    req = pool_req()
    provision(req, region_root)
    pool_dir = region_root / NAME
    # an agent or CSI plugin: <root> itself, with the pools' mounts under it (rbind)
    agent = Pod(processes, tmp_path, f"rbind:{region_root}=/var/lib/offloadpool")
    assert "r0-s000" in agent.ls(f"/var/lib/offloadpool/{NAME}/mnt")
    assert find_holders(pool_dir) == []
    assert holders.count(pool_dir) == 0
    result = release(region_root, NAME)
    assert result.existed and result.warnings == ()
    assert not pool_dir.exists()


def test_a_release_sets_a_pods_directory_aside_and_the_next_pool_is_new(region_root, processes, tmp_path):
    """The pod leaves a file and exits (its view gone): release moves the directory aside; the
    next pool of the name has a new directory without the pod's file."""
    provision(pool_req(), region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir}=/pool")
    assert pod.ask("write /pool/notes") == "written"
    old = pool_dir.stat()
    pod.stop()

    result = release(region_root, NAME)
    assert len(result.warnings) == 1 and "'notes'" in result.warnings[0], result.warnings
    assert "out of every pod's reach" in result.warnings[0]
    assert not pool_dir.exists()
    aside = list((region_root / LEFT).iterdir())
    assert [p.name.split(".")[0] for p in aside] == [NAME] and os.listdir(aside[0]) == ["notes"]
    assert (aside[0].stat().st_dev, aside[0].stat().st_ino) == (old.st_dev, old.st_ino)
    assert (region_root / STATE).stat().st_mode & 0o777 == 0o700
    assert (region_root / LEFT).stat().st_mode & 0o777 == 0o700

    provision(pool_req(), region_root)
    assert (pool_dir.stat().st_dev, pool_dir.stat().st_ino) != (old.st_dev, old.st_ino)
    assert sorted(os.listdir(pool_dir)) == ["lease", "manifest.json", "mnt"]

    # the next release names the set-aside directory while it holds the pod's file, and removes
    # it once it is empty
    again = release(region_root, NAME)
    assert any(str(aside[0]) in w and "remove them once no pod uses them" in w for w in again.warnings)
    os.unlink(aside[0] / "notes")
    provision(pool_req(), region_root)
    assert release(region_root, NAME).warnings == ()
    assert not (region_root / STATE).exists()


def test_a_kept_mount_of_a_released_directory_sees_nothing_of_the_next_pool(region_root, processes, tmp_path):
    """A forced release (the operator's, through the pod's view) and a re-create: the pod's
    mount still shows the old directory, holding only the pod's file; the new pool's files never
    appear in it, what the pod writes never appears in the new pool, and it holds nothing."""
    provision(pool_req(uid=1001, gid=1001), region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir}=/pool")
    assert pod.ask("write /pool/notes") == "written"

    forced = release(region_root, NAME, force=True)  # the operator's, past the pod's view
    provision(pool_req(uid=1002, gid=1002), region_root)
    assert sorted(os.listdir(pool_dir / "mnt")) == ["r0-s000"]

    assert pod.ls("/pool") == ["notes"]  # none of the new pool: no manifest, lease or memory
    assert pod.ask("write /pool/more") == "written"
    assert "more" not in os.listdir(pool_dir) and "notes" not in os.listdir(pool_dir)
    assert any("moved to" in w and "'notes'" in w for w in forced.warnings), forced.warnings
    assert find_holders(pool_dir) == []  # a view of the set-aside directory holds no pool
    result = release(region_root, NAME)
    assert result.existed and not pool_dir.exists()
    assert any("still hold a pod's files" in w for w in result.warnings)
    pod.stop()


def test_a_view_of_a_removed_directory_holds_no_later_pool(region_root, processes, tmp_path):
    """Forced release of an empty pool directory removes it; the pod's mount then shows a
    removed directory (mountinfo: ``//deleted``), which is no view of the pool made next."""
    provision(pool_req(), region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{pool_dir}=/pool")
    release(region_root, NAME, force=True)
    assert not pool_dir.exists()
    provision(pool_req(), region_root)
    assert pod.ls("/pool") == []
    assert find_holders(pool_dir) == []
    release(region_root, NAME)
    pod.stop()


def test_a_mount_table_over_the_bound_is_taken_as_holding(region_root, processes, tmp_path, monkeypatch):
    """A namespace whose table is longer than the scan reads, with no view of all of <root> in
    what was read, holds every pool, saying why; one that showed all of <root> first does not."""
    from offloadpool.region.holding import views

    provision(pool_req(), region_root)
    pool_dir = region_root / NAME
    pod = Pod(processes, tmp_path, f"bind:{tmp_path / 'podroot-0'}=/elsewhere")  # no view of the pool
    assert find_holders(pool_dir) == []
    table = Path(f"/proc/{pod.pid}/mountinfo").read_bytes()
    monkeypatch.setattr(views, "MAX_TABLE_BYTES", len(table) - 1)
    with pytest.raises(PoolInUse, match=rf"pid {pod.pid} .*mount table over .*taken as having the pool"):
        release(region_root, NAME)
    pod.stop()
    release(region_root, NAME)


def test_a_directory_found_without_the_nodes_record_is_replaced(region_root):
    """What an older release left (the pod's file kept the directory, the record gone): the next
    provision builds in a new directory, the old one set aside with the pod's file."""
    pool_dir = region_root / NAME
    pool_dir.mkdir()
    (pool_dir / "notes").write_text("left by a pod")
    old = pool_dir.stat()

    provision(pool_req(), region_root)
    assert (pool_dir.stat().st_dev, pool_dir.stat().st_ino) != (old.st_dev, old.st_ino)
    assert sorted(os.listdir(pool_dir)) == ["lease", "manifest.json", "mnt"]
    aside = list((region_root / LEFT).iterdir())
    assert len(aside) == 1 and os.listdir(aside[0]) == ["notes"]
    assert aside[0].stat().st_ino == old.st_ino


#: mount tables opened by this process, by path (``_count_mountinfo``; off until a test turns it on)
_MOUNTINFO_OPENS: list[str] | None = None


def _count_mountinfo(event: str, args: tuple) -> None:
    if _MOUNTINFO_OPENS is not None and event == "open" and str(args[0]).endswith("/mountinfo"):
        _MOUNTINFO_OPENS.append(str(args[0]))


sys.addaudithook(_count_mountinfo)


def test_the_engine_count_of_many_pools_reads_each_mount_table_once(region_root, processes, tmp_path):
    """``count`` is a report made at every heartbeat of every pool; the simulated nodes of
    bench/scale.py run a thousand pools in one process, and each count reading every
    namespace's table (and this process's own, to find ``<root>``) made their steps grow with
    the count. Counts share one snapshot of the node's namespaces for a few seconds; a process
    that starts or leaves shows at once; a decision (release) reads afresh."""
    global _MOUNTINFO_OPENS
    from offloadpool.region.holding import views

    names = ["kv", "kv2", "kv3"]
    for name in names:
        provision(pool_req(name=name), region_root)
    pod = Pod(processes, tmp_path, f"bind:{region_root / 'kv'}=/pool")
    views._snapshot = None  # what an earlier test left
    _MOUNTINFO_OPENS = []
    try:
        counts = [holders.count(region_root / name) for name in names * 2]
        first = list(_MOUNTINFO_OPENS)
        assert counts == [1, 0, 0, 1, 0, 0]
        assert first.count(f"/proc/{pod.pid}/mountinfo") == 1, first
        assert first.count("/proc/self/mountinfo") == 1, first
        _MOUNTINFO_OPENS.clear()
        with pytest.raises(PoolInUse):  # a decision: the tables read again
            release(region_root, "kv")
        assert f"/proc/{pod.pid}/mountinfo" in _MOUNTINFO_OPENS, _MOUNTINFO_OPENS
        other = Pod(processes, tmp_path, f"bind:{region_root / 'kv2'}=/pool")
        assert holders.count(region_root / "kv2") == 1  # started inside the window: seen at once
        other.stop()
        pod.stop()
        assert [holders.count(region_root / name) for name in names] == [0, 0, 0]  # left: at once
    finally:
        _MOUNTINFO_OPENS = None
