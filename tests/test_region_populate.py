"""The pre-fault's work split, its exclusivity, and its strategy per medium (fallocate on
hugetlbfs): pages counted, bytes zero, shortfalls clear, on real mounts."""

from __future__ import annotations

import fcntl
import functools
import os
import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.host import cli_argv, private_mounts_python
from fixtures.wait import wait_for
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.files import record as records
from offloadpool.region.files.journal import JOURNAL_NAME, units
from offloadpool.region.files.manifest import MOUNT_NAME, Segment
from offloadpool.region.files.places import state_dir
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding.lease import lease_path
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import hugepages, mounts, vm
from offloadpool.region.memory.parallel import shares
from offloadpool.region.memory.populate import STRATEGY_FOR, populate, strategy
from offloadpool.region.request import PoolRequest

MiB = 1 << 20


@settings(max_examples=300, deadline=None)
@given(
    files=st.integers(1, 32),
    file_units=st.integers(1, 64),
    workers=st.integers(1, 16),
    page=st.sampled_from([4096, 2 * MiB, 1 << 30]),
)
def test_shares_are_contiguous_balanced_and_start_in_different_files(files, file_units, workers, page):
    unit = max(page, 2 * MiB)
    segs = [Segment(f"mnt/r0-s{i:03d}", i * file_units * unit, file_units * unit) for i in range(files)]
    all_units = units(segs, page)
    parts = shares(all_units, workers)
    assert len(parts) == workers
    assert [u for p in parts for u in p] == all_units  # contiguous, in order, complete
    sizes = [sum(u.bytes for u in p) for p in parts]
    total = sum(sizes)
    assert max(sizes) - min(sizes) <= 2 * unit or total < workers * unit
    if files >= workers and all(parts):
        starts = [p[0].segment for p in parts]
        assert len(set(starts)) == len(starts), "two workers start in the same file"


def test_no_engine_can_attach_while_populating(region_root, processes):
    """The provision holds the lease exclusively for the whole pre-fault: a shared lease (what
    an engine takes on attach) cannot be had until the pool is Ready."""
    proc = processes(
        cli_argv(
            "provision",
            "--root",
            str(region_root),
            "--name",
            "busy",
            "--capacity",
            "128Mi",
            "--medium",
            "HugePages-2Mi",
            "--rate-limit",
            "32Mi",
        )
    )
    pool_dir = region_root / "busy"
    wait_for(
        "the pre-fault to start",
        lambda: (
            (state_dir(pool_dir) / JOURNAL_NAME).exists()
            and 1 in (state_dir(pool_dir) / JOURNAL_NAME).read_bytes()
        ),
        60,
        interval=0.01,
    )
    fd = os.open(lease_path(pool_dir), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        assert not (pool_dir / "manifest.json").exists()
        assert proc.wait(timeout=120) == 0, proc.communicate()
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # Ready: attach is possible
        assert (pool_dir / "manifest.json").exists()
    finally:
        os.close(fd)


# -- the strategy per medium, and fallocate on hugetlbfs ----------------------------------------

HUGE = 2 * MiB


def _plan(medium: str, capacity: int, min_segment: int):
    return make_plan(PoolRequest(name="p", capacity=capacity, medium=medium, min_segment=min_segment))


@pytest.mark.parametrize(
    "medium, numa_policy, files, workers, chosen",
    [
        ("HugePages-2Mi", "None", 4, 2, "fallocate"),
        ("HugePages-1Gi", "None", 2, 2, "fallocate"),
        ("MemoryTHP", "None", 4, 2, "madvise"),
        ("Memory", "None", 4, 2, "fallocate+madvise"),
        ("Memory", "Interleave", 4, 2, "madvise"),
        ("Memory", "None", 1, 2, "madvise"),
        ("Memory", "None", 1, 1, "fallocate+madvise"),
        # mbind steers the faults of a mapping; fallocate would ignore the placement
        ("HugePages-2Mi", "0", 4, 2, "madvise"),
        ("HugePages-2Mi", "Interleave", 4, 2, "madvise"),
        # fallocate holds the file's inode lock: two workers in one file would take turns
        ("HugePages-2Mi", "None", 1, 2, "madvise"),
        ("HugePages-2Mi", "None", 1, 1, "fallocate"),
    ],
)
def test_each_medium_gets_its_measured_strategy(medium, numa_policy, files, workers, chosen):
    page = 1 << 30 if medium == "HugePages-1Gi" else HUGE
    p = _plan(medium, files * 4 * page, 4 * page)
    assert len(p.segments) == files
    assert strategy(p, "auto", numa_policy, workers) == chosen
    measured = {"HugePages-2Mi": "fallocate", "HugePages-1Gi": "fallocate", "MemoryTHP": "madvise"}
    assert STRATEGY_FOR[medium] == measured.get(medium, "fallocate+madvise")
    assert strategy(p, "madvise", numa_policy, workers) == "madvise"  # an explicit mode is kept


@pytest.mark.parametrize(
    "medium, mode", [("Memory", "fallocate"), ("MemoryTHP", "fallocate"), ("Memory", "fast")]
)
def test_a_mode_that_cannot_clear_the_medium_fails_before_any_page_is_touched(region_root, medium, mode):
    """fallocate alone leaves tmpfs pages uncleared until their first fault: refused, like an
    unknown mode, before the files are even opened (no page used, no journal made)."""
    p = _plan(medium, 8 * MiB, 4 * MiB)
    pool_dir = region_root / "p"
    mnt = pool_dir / MOUNT_NAME
    mnt.mkdir(parents=True)
    mounts.mount("tmpfs", mnt, f"size={8 * MiB},huge={p.medium.huge},mode=0700")
    try:
        for seg in p.segments:
            with open(pool_dir / seg.file, "wb") as fh:
                fh.truncate(seg.bytes)
        with pytest.raises(RegionError, match=repr(mode)):
            populate(pool_dir, p, workers=2, mode=mode)
        st = os.statvfs(mnt)
        assert st.f_blocks == st.f_bfree, "pages were allocated before the mode was refused"
        assert not (state_dir(pool_dir) / JOURNAL_NAME).exists()
    finally:
        mounts.umount(mnt)


def _hugepage_counts() -> tuple[int, int, int]:
    c = hugepages.counters(HUGE)
    return c.total, c.free, c.reserved


def _snapshot(seen: dict[str, tuple[int, int, int]], phase: str) -> None:
    seen.setdefault(phase, _hugepage_counts())


def _blocks(pool_dir, segs) -> list[int]:
    """Bytes of huge pages each file holds (hugetlbfs counts a file's pages in st_blocks)."""
    return [os.stat(pool_dir / s.file).st_blocks * 512 for s in segs]


def test_fallocate_prefault_takes_exactly_the_pool_pages_and_engines_read_zeros(region_root, processes):
    """A provision on hugetlbfs pre-faults by fallocate: HugePages_Free drops by exactly the
    pool's pages (nothing reserved is left over), every file holds all its pages, an engine
    mapping the files reads zeros and takes no further page."""
    capacity, pages = 64 * MiB, 64 * MiB // HUGE
    req = PoolRequest(name="fa", capacity=capacity, medium="HugePages-2Mi", min_segment=16 * MiB, workers=2)
    drops = []
    # Other tenants of this shared machine mount, fill and free pools at any moment, which
    # moves the global counters too: they are read right before and after the pre-fault (the
    # provision's phase calls), and the drop must be exact in one of five tries (code that
    # allocated no page, or too many, never is). The min_size mount reserved the pages, so
    # each page the pre-fault takes leaves both HugePages_Free and HugePages_Rsvd.
    for _attempt in range(5):
        seen: dict[str, tuple[int, int, int]] = {}
        result = provision(req, region_root, on_phase=functools.partial(_snapshot, seen))
        before, after = seen["Populating"], seen["Ready"]
        drops.append((before[1] - after[1], before[2] - after[2]))
        if drops[-1] == (pages, pages):
            break
        release(region_root, "fa", force=True)
    assert drops[-1] == (pages, pages), (
        f"(HugePages_Free, HugePages_Rsvd) drops over the pre-fault {drops}, pool of {pages} pages"
    )
    assert records.load(result.pool_dir).populate["mode"] == "fallocate"
    segs = result.manifest.regions[0].segments
    assert len(segs) == 4
    assert _blocks(result.pool_dir, segs) == [s.bytes for s in segs], "pages missing from the files"
    engine = processes(
        [
            sys.executable,
            "-c",
            "import mmap, os, sys\n"
            "nonzero = 0\n"
            "for path in sys.argv[1:]:\n"
            "    fd = os.open(path, os.O_RDWR)\n"
            "    m = mmap.mmap(fd, os.fstat(fd).st_size)\n"
            "    nonzero += len(m) - m[:].count(0)\n"
            "    m[-4:] = b'data'\n"  # a write fault too: it must find the page, not take another
            "    m.close(); os.close(fd)\n"
            "print(nonzero)\n",
            *[str(result.pool_dir / s.file) for s in segs],
        ]
    )
    out, err = engine.communicate(timeout=120)
    assert engine.returncode == 0, err
    assert int(out) == 0, f"{out.strip()} bytes of a fresh pool are not zero"
    assert _blocks(result.pool_dir, segs) == [s.bytes for s in segs], "the engine's faults took more pages"
    st = os.statvfs(result.pool_dir / MOUNT_NAME)
    assert st.f_blocks - st.f_bfree == pages, "the pool's mount holds other than its pages"


def test_prefault_on_hugetlbfs_maps_nothing(region_root):
    """The strategy is really fallocate, not a mapping: with the address space capped below
    the pool's size, ``auto`` still pre-faults it all; madvise (a mapping) cannot."""
    capacity = 128 * MiB
    script = textwrap.dedent(
        f"""
        import resource, sys
        from pathlib import Path
        from offloadpool.region.memory import mounts
        from offloadpool.region.files.planner import plan
        from offloadpool.region.memory.populate import populate
        from offloadpool.region.request import PoolRequest
        from offloadpool.region.files.manifest import MOUNT_NAME
        pool = Path(sys.argv[1]); mode = sys.argv[2]
        p = plan(PoolRequest(name="p", capacity={capacity}, medium="HugePages-2Mi", min_segment={32 * MiB}))
        (pool / MOUNT_NAME).mkdir(parents=True)
        mounts.mount("hugetlbfs", pool / MOUNT_NAME, "pagesize=2097152,size={capacity},mode=0700")
        for seg in p.segments:
            open(pool / seg.file, "wb").close()
            (pool / seg.file).open("r+b").truncate(seg.bytes)
        used = int(open("/proc/self/statm").read().split()[0]) * 4096
        resource.setrlimit(resource.RLIMIT_AS, (used + {48 * MiB}, resource.RLIM_INFINITY))
        try:
            stats = populate(pool, p, workers=1, mode=mode)
        except Exception as exc:
            print("failed:", exc)
        else:
            print(stats.mode, stats.populated_bytes)
        """
    )
    for mode, expect in (("auto", f"fallocate {capacity}\n"), ("madvise", "failed: mapping")):
        pool = region_root / mode
        out = subprocess.run(
            private_mounts_python(script, str(pool)) + [mode], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(expect), out.stdout + out.stderr


def test_a_shortfall_during_fallocate_is_a_capacity_error_that_leaks_nothing(region_root):
    """A hugetlbfs mount that can hold only half the files' pages (no min_size reservation, as
    on a node where someone shrank the pool): the fallocate pre-fault stops with a
    CapacityError naming the pool, keeps no descriptor open, journals only what it made, and
    unmounting gives every page back."""
    p = _plan("HugePages-2Mi", 32 * MiB, 16 * MiB)  # 2 files, 16 pages
    pool_dir = region_root / "short"
    mnt = pool_dir / MOUNT_NAME
    mnt.mkdir(parents=True)
    total_before, free_before, _ = _hugepage_counts()
    mounts.mount("hugetlbfs", mnt, f"pagesize={HUGE},size={16 * MiB},mode=0700")  # 8 pages
    try:
        for seg in p.segments:
            with open(pool_dir / seg.file, "wb") as fh:
                fh.truncate(seg.bytes)
        fds_before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(CapacityError, match=r"HugePages-2Mi pool.*fallocate.*No space left"):
            populate(pool_dir, p, workers=2, chunk_bytes=4 * MiB)
        assert len(os.listdir("/proc/self/fd")) == fds_before, "the pre-fault left a descriptor open"
        journaled = (state_dir(pool_dir) / JOURNAL_NAME).read_bytes().count(1) * HUGE
        held = sum(os.stat(pool_dir / s.file).st_blocks * 512 for s in p.segments)
        assert 0 < journaled <= held == 16 * MiB, (journaled, held)
    finally:
        mounts.umount(mnt)
    total_after, free_after, _ = _hugepage_counts()
    if total_after == total_before:
        assert free_after >= free_before, "pages of the failed pre-fault were not given back"


@pytest.mark.root  # mounts its own tmpfs
@pytest.mark.parametrize("huge", ["always", "never"])
def test_huge_page_bytes_from_the_page_tables_equal_smaps(tmp_path, huge):
    """``vm.pmd_mapped_bytes`` (PAGEMAP_SCAN) must give what smaps' ShmemPmdMapped gives for
    the same range, over all of a mapping and over a part starting mid-way, on a tmpfs whose
    pages are huge and on one whose pages are not."""
    size = 256 << 20
    mounts.mount("tmpfs", tmp_path, f"huge={huge},size={2 * size}")
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    addr = 0
    try:
        os.ftruncate(fd, size)
        addr = vm.map_shared(fd, size)
        vm.populate_write(addr, size)
        smaps = open("/proc/self/smaps").read()
        section = smaps[smaps.index(f"{addr:x}-") :]
        section = section[: section.index("VmFlags:")]
        expected = int(re.search(r"ShmemPmdMapped:\s+(\d+) kB", section).group(1)) * 1024
        assert vm.pmd_mapped_bytes(addr, size) == expected
        assert (expected > 0) == (huge == "always")
        half = size // 2
        assert vm.pmd_mapped_bytes(addr + half, half) <= expected
        assert vm.pmd_mapped_bytes(addr, half) + vm.pmd_mapped_bytes(addr + half, half) == expected
    finally:
        if addr:
            vm.unmap(addr, size)
        os.close(fd)
        mounts.umount(tmp_path)
