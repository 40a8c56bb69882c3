"""Huge pages on a machine whose memory has a history: the suite's reservation, growth, shortfall.

The suite draws on a reservation taken before anything fragments memory (hack/hugepages.py);
the engine grows the kernel pool only when free pages run out, gives back exactly what it
added, and, when the kernel cannot add pages, says whether memory is fragmented or taken.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fixtures.host import REPO, hugepage_totals, other_tenant_holds_free_hugepages, reservation_tool
from offloadpool.region.errors import CapacityError
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import hugepage_intent, hugepages, mounts
from offloadpool.region.memory.capacity import meminfo
from offloadpool.region.request import PoolRequest

MiB, GiB = 1 << 20, 1 << 30
TOOL = [sys.executable, "-m", "hack.hugepages"]
# /sys and /proc/sys read-only in a private mount namespace, as an unprivileged container has them
READ_ONLY_SYS = (
    "mount --bind /sys /sys && mount -o remount,bind,ro /sys && "
    'mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec "$@"'
)


def run_tool(*args: str, cache: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, **env}
    if cache is not None:
        environ["OFFLOADPOOL_CACHE"] = cache
    return subprocess.run([*TOOL, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=environ)


def test_the_suite_draws_on_its_reservation(region_root, hugepage_baseline, hugepage_reservation):
    """A 2 GiB HugePages-1Gi pool takes reserved pages: the kernel pool does not grow."""
    assert hugepage_reservation[GiB] >= 2 and hugepages.counters(GiB).available >= hugepage_reservation[GiB]
    result = provision(
        PoolRequest(name="one-gi", capacity=2 * GiB, medium="HugePages-1Gi", min_segment=GiB), region_root
    )
    assert result.hugepages_added == 0
    assert hugepage_totals() == hugepage_baseline
    assert release(region_root, "one-gi").hugepages_returned == 0
    assert hugepages.counters(GiB).available >= hugepage_reservation[GiB]


def test_grows_when_free_pages_are_taken_and_gives_back_exactly_that(
    region_root, hugepage_baseline, tmp_path
):
    with other_tenant_holds_free_hugepages(tmp_path / "tenant") as held:
        assert held >= 1
        result = provision(
            PoolRequest(name="grown", capacity=64 * MiB, medium="HugePages-2Mi", min_segment=16 * MiB),
            region_root,
        )
        assert result.hugepages_added == 32
        assert hugepage_totals()[2 * MiB] == hugepage_baseline[2 * MiB] + 32
        assert release(region_root, "grown").hugepages_returned == 32
        assert hugepage_totals() == hugepage_baseline
    assert mounts.mounts_under(region_root) == []


BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      1      2      4      2      5      4      3      3      4      2    752
Node 0, zone   Normal    990   1173    864    430    243    110     47     26     13     10     23
"""


def test_buddy_state_is_summed_over_zones(tmp_path):
    (tmp_path / "buddyinfo").write_text(BUDDYINFO)
    assert hugepages.free_blocks_by_order(str(tmp_path / "buddyinfo")) == [
        991,
        1175,
        868,
        432,
        248,
        114,
        50,
        29,
        18,
        13,
        778,
    ]
    live = hugepages.free_blocks_by_order()  # this machine's, in the same format
    assert len(live) == 11 and all(n >= 0 for n in live) and sum(live) > 0


def test_shortfall_reason_tells_fragmentation_from_memory_taken():
    buddy = r"free blocks by order 0\.\.10 \(/proc/buddyinfo\): (\d+ ){10}\d+; largest free block \d+ KiB"
    fragmented = hugepages.shortfall_reason(GiB, 2, avail=8 * GiB)
    assert fragmented.startswith("memory too fragmented, not taken: 8192 MiB available")
    assert "2 physically contiguous 1024 MiB blocks even after compaction" in fragmented
    assert re.search(buddy, fragmented), fragmented
    assert fragmented.endswith("reserve these pages earlier (at boot) and keep them")

    taken = hugepages.shortfall_reason(2 * MiB, 100, avail=100 * MiB)
    assert taken.startswith("memory taken: 100 MiB available, 200 MiB needed")
    assert re.search(buddy + r"; \d+ free blocks of 2048 KiB or more\)$", taken), taken


def test_engine_shortfall_after_growing_names_the_reason(region_root, hugepage_baseline, tmp_path):
    """The pool cannot grow (a read-only sysfs, as an unprivileged container has it, while another
    tenant holds the free pages): the pool fails, names the shortfall and that the pool is fixed
    (neither fragmentation nor memory taken), and leaves nothing."""
    script = (
        "import sys\n"
        "from offloadpool.region.errors import CapacityError\n"
        "from offloadpool.region.lifecycle.provision import provision\n"
        "from offloadpool.region.request import PoolRequest\n"
        "try:\n"
        "    provision(PoolRequest(name='short', capacity=64 << 20, medium='HugePages-2Mi',"
        " min_segment=16 << 20),"
        f" {str(region_root)!r})\n"
        "except CapacityError as exc:\n"
        "    print(exc); sys.exit(3)\n"
    )
    with other_tenant_holds_free_hugepages(tmp_path / "tenant"):
        out = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "sh",
                "-c",
                READ_ONLY_SYS,
                "engine",
                sys.executable,
                "-c",
                script,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 3, out.stdout + out.stderr
    message = out.stdout
    assert message.startswith("HugePages-2Mi pool needs 32 huge pages of 2.00 MiB"), message
    assert (
        "the huge page pool is fixed here (cannot grow /sys/kernel/mm/hugepages/hugepages-2048kB/"
        "nr_hugepages: Read-only file system)" in message
    ), message
    assert "short by 32 pages" in message and "fragmented" not in message, message
    # nothing left: no pool, and no pending intent (the refused grow announced one and settled
    # it), so teardown removed the emptied state directory too
    assert [p.name for p in region_root.iterdir()] == []
    assert not hugepage_intent.pending(region_root) and mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


def test_capacity_error_before_anything_when_pages_and_memory_are_short(region_root, hugepage_baseline):
    with pytest.raises(CapacityError, match="short by"):
        provision(
            PoolRequest(
                name="huge", capacity=(2 * meminfo()["MemTotal"] // GiB + 1) * GiB, medium="HugePages-1Gi"
            ),
            region_root,
        )
    assert hugepage_totals() == hugepage_baseline


def test_reservation_tool_is_idempotent_and_reports_what_it_holds(hugepage_reservation, hugepage_baseline):
    out = run_tool("reserve")
    assert out.returncode == 0, out.stderr
    assert "huge pages for the suite: HugePages-1Gi" in out.stderr
    assert hugepage_totals() == hugepage_baseline  # already reserved: nothing written
    status = json.loads(run_tool("status").stdout)
    gi = status["sizes"]["HugePages-1Gi"]
    assert gi["suite_needs"] == hugepage_reservation[GiB] and gi["available"] >= gi["suite_needs"]
    assert gi["pool"] == hugepage_baseline[GiB]


def test_reservation_tool_fails_at_once_with_one_message_and_gives_back_its_pages(
    hugepage_baseline, tmp_path
):
    """Asking for more 1 GiB pages than the machine has memory: one message with what was
    asked, what is free and the buddy state; nothing grown; release (of a separate record)
    then gives back exactly what that record added."""
    too_many = 2 * meminfo()["MemTotal"] // GiB + 1
    cache = str(tmp_path / "cache")
    out = run_tool(
        "reserve",
        cache=cache,
        OFFLOADPOOL_TEST_HUGEPAGES_1GI=str(too_many),
        OFFLOADPOOL_TEST_HUGEPAGES_2MI="0",
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[0] == "FAIL: the test suite's huge pages cannot be reserved on this machine:"
    assert f"HugePages-1Gi: asked for {too_many} free pages;" in lines[1]
    assert "the kernel could add only 0 of the" in lines[1] and "memory taken:" in lines[1]
    assert "/proc/buddyinfo" in lines[1] and "hugepagesz=1G" in out.stderr
    assert hugepage_totals() == hugepage_baseline  # asked for more than exists: memory untouched

    # a reservation of one more 2 MiB page than is free, recorded in this separate cache
    need = hugepages.counters(2 * MiB).available + 1
    got = run_tool(
        "reserve", cache=cache, OFFLOADPOOL_TEST_HUGEPAGES_1GI="0", OFFLOADPOOL_TEST_HUGEPAGES_2MI=str(need)
    )
    assert got.returncode == 0, got.stderr
    assert hugepage_totals()[2 * MiB] == hugepage_baseline[2 * MiB] + 1
    recorded = json.loads((tmp_path / "cache" / "hugepages-reservation.json").read_text())
    assert recorded["added"] == {str(2 * MiB): 1}
    given = run_tool("release", cache=cache)
    assert given.returncode == 0 and "gave back 1 x HugePages-2Mi" in given.stderr
    assert hugepage_totals() == hugepage_baseline
    assert reservation_tool().needs()[GiB] >= 2


def test_reservation_lock_falls_back_to_the_root_where_run_lock_is_read_only(region_root, hugepage_baseline):
    """An agent container has a read-only root file system: /run/lock cannot hold the host-wide
    huge page lock, so the engine locks in the host root all agents of the node share."""
    script = (
        "import sys\n"
        "from offloadpool.region.lifecycle.provision import provision\n"
        "from offloadpool.region.lifecycle.release import release\n"
        "from offloadpool.region.request import PoolRequest\n"
        "root = sys.argv[1]\n"
        "r = provision(PoolRequest(name='ro', capacity=16 << 20, medium='HugePages-2Mi',"
        " min_segment=8 << 20), root)\n"
        "release(root, 'ro')\n"
        "print('ok', r.manifest.total_bytes)\n"
    )
    ro_run = (
        "mkdir -p /run/lock && mount --bind /run/lock /run/lock && mount -o remount,bind,ro /run/lock && "
        'exec "$@"'
    )
    out = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            ro_run,
            "engine",
            sys.executable,
            "-c",
            script,
            str(region_root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["ok", str(16 << 20)]
    assert (region_root / hugepages.ROOT_LOCK_NAME).exists()  # where the lock was taken
    assert mounts.mounts_under(region_root) == [] and hugepage_totals() == hugepage_baseline
