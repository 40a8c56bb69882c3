"""A kill -9 between changing the kernel's huge page pool and recording it neither leaks pages
nor gives them back twice: the huge page intent (``offloadpool.region.memory.hugepage_intent``).

The real CLI is killed at named points (``fixtures/crash_at.py``) of a provision that really
grows ``nr_hugepages`` (every free page is taken first by another "tenant", as the shortfall
tests do) and of the release that gives the pages back; the next provision or release, or any
other offloadpool process that takes the huge page lock, must bring ``nr_hugepages`` to what the
records say, and the machine's pools end exactly where they began.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from fixtures.host import cli, hugepage_totals, other_tenant_holds_free_hugepages
from offloadpool.region.files import record as records
from offloadpool.region.memory import hugepage_intent, hugepages, mounts
from offloadpool.region.memory.hugepage_intent import Intent, IntentError
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
PAGE = 2 * MiB
CRASH_AT = str(Path(__file__).parent / "fixtures" / "crash_at.py")
PAGES = 32  # a 64 MiB pool of 2 MiB pages


def flags(root: Path, name: str = "grown", capacity_mib: int = 64) -> list[str]:
    return [
        "--root",
        str(root),
        "--name",
        name,
        "--capacity",
        f"{capacity_mib}Mi",
        "--medium",
        "HugePages-2Mi",
        "--min-size",
        "16Mi",
    ]


def killed_at(processes, point: str, *args: str) -> None:
    proc = processes([sys.executable, CRASH_AT, point, "1", "offloadpool.cli", *args])
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"{point} was not reached (exit {proc.returncode}):\n{err}"
    assert f"CRASH-POINT {point} #1" in err, err


def total() -> int:
    return hugepages.counters(PAGE).total


def recorded_pages(root: Path, name: str) -> int:
    return json.loads(records.path(root / name).read_text())["hugepages_added"]


@pytest.mark.parametrize(
    "point",
    [
        "provision:hugepage-intent-written",  # intent durable, nr_hugepages not yet written
        "provision:hugepages-reserved",  # grown, not recorded: the leak
        "provision:hugepages-recorded",  # recorded, intent not yet removed
    ],
)
def test_provision_killed_around_growing_the_pool_converges_without_a_leak(
    point, region_root, hugepage_baseline, tmp_path, processes
):
    with other_tenant_holds_free_hugepages(tmp_path / "tenant"):
        start = total()
        killed_at(processes, point, "provision", *flags(region_root))
        grown = total() - start
        assert grown == (0 if point == "provision:hugepage-intent-written" else PAGES)

        out = json.loads(cli("provision", *flags(region_root), "--json").stdout)
        assert out["reused"] is False
        assert total() == start + PAGES, "the pool holds its 32 pages, counted once"
        assert recorded_pages(region_root, "grown") == PAGES, "and its record says so"
        assert not hugepage_intent.pending(region_root)

        gone = json.loads(cli("release", "grown", "--root", str(region_root), "--json").stdout)
        assert gone["hugepages_returned"] == PAGES
        assert total() == start, f"nr_hugepages {total()} after release, {start} before the provision"
        assert not hugepage_intent.pending(region_root)
    assert mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


@pytest.mark.parametrize(
    "point",
    [
        "release:hugepage-intent-written",  # intent durable, record still says 32, kernel untouched
        "release:hugepages-recorded",  # record says 0, kernel untouched
        "release:hugepages-shrunk",  # given back, intent not yet removed: the double give-back
    ],
)
def test_release_killed_around_giving_pages_back_gives_them_back_once(
    point, region_root, hugepage_baseline, tmp_path, processes
):
    with other_tenant_holds_free_hugepages(tmp_path / "tenant"):
        start = total()
        out = json.loads(cli("provision", *flags(region_root), "--json").stdout)
        assert out["hugepages_added"] == PAGES and total() == start + PAGES

        killed_at(processes, point, "release", "grown", "--root", str(region_root))
        assert total() == start + (PAGES if point != "release:hugepages-shrunk" else 0)

        gone = json.loads(cli("release", "grown", "--root", str(region_root), "--json").stdout)
        assert gone["existed"] is True
        assert total() == start, f"nr_hugepages {total()} after release, {start} before the provision"
        assert not (region_root / "grown").exists() and not hugepage_intent.pending(region_root)
    assert mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


def test_another_pools_provision_gives_back_the_pages_a_killed_one_grew(
    region_root, hugepage_baseline, tmp_path, processes
):
    """The lock serialises every pool's changes: whichever offloadpool process takes it next
    settles the intent, here a provision of another pool, which then grows for itself."""
    with other_tenant_holds_free_hugepages(tmp_path / "tenant"):
        start = total()
        killed_at(processes, "provision:hugepages-reserved", "provision", *flags(region_root))
        assert total() == start + PAGES

        out = json.loads(cli("provision", *flags(region_root, "other", 16), "--json").stdout)
        assert out["hugepages_added"] == 8, "the killed pool's free pages were given back, not taken"
        assert total() == start + 8 and not hugepage_intent.pending(region_root)

        cli("release", "other", "--root", str(region_root))
        assert total() == start
        cli("release", "grown", "--root", str(region_root))  # never mounted; records 0 pages
        assert total() == start
    assert hugepage_totals() == hugepage_baseline


def test_release_of_the_killed_pool_settles_its_unrecorded_growth(
    region_root, hugepage_baseline, tmp_path, processes
):
    """The killed provision's record says no pages were added; releasing the pool must still
    give back what it grew (the intent is pending, so release takes the lock)."""
    with other_tenant_holds_free_hugepages(tmp_path / "tenant"):
        start = total()
        killed_at(processes, "provision:hugepages-reserved", "provision", *flags(region_root))
        assert total() == start + PAGES
        proc = cli("release", "grown", "--root", str(region_root), "--json")
        assert json.loads(proc.stdout)["hugepages_returned"] == 0  # the record had none
        assert total() == start and not hugepage_intent.pending(region_root)
        assert (  # and the node's log says what was settled
            f"huge page intent settled: pool grown: grow by {PAGES} huge pages of 2048 kB from "
            f"nr_hugepages {start}: interrupted; nr_hugepages {start + PAGES} -> {start}" in proc.stderr
        ), proc.stderr
    assert hugepage_totals() == hugepage_baseline


def test_an_intent_of_an_earlier_boot_is_dropped_untouched(region_root, hugepage_baseline):
    before = total()
    hugepage_intent.write(region_root, Intent("grow", "old", PAGE, 5, before - 5, 0, "an-earlier-boot"))
    with hugepages.reservation_lock(region_root):
        pass
    assert total() == before and not hugepage_intent.pending(region_root)


def test_the_intent_lives_root_only_and_is_written_atomically(region_root):
    intent = Intent("shrink", "p", PAGE, 3, 10, 3, records.boot_id())
    hugepage_intent.write(region_root, intent)
    state = region_root / hugepage_intent.STATE_DIR
    assert os.stat(state).st_mode & 0o777 == 0o700
    assert os.stat(hugepage_intent.path(region_root)).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in state.iterdir()) == [hugepage_intent.INTENT_NAME]
    assert hugepage_intent.load(region_root) == intent
    hugepage_intent.clear(region_root)
    assert hugepage_intent.load(region_root) is None and list(state.iterdir()) == []


def test_an_unreadable_or_symlinked_intent_stops_huge_page_changes(region_root, hugepage_baseline, tmp_path):
    """Nobody can tell what a garbled intent owes: the lock holder refuses with one message and
    writes nothing, rather than guess. A symlink is never followed."""
    state = region_root / hugepage_intent.STATE_DIR
    state.mkdir(mode=0o700)
    before = total()
    for content in (b"{not json", b'{"op": "grow"}', b"[]"):
        hugepage_intent.path(region_root).write_bytes(content)
        with pytest.raises(IntentError, match="cannot be read.*remove the file"):
            with hugepages.reservation_lock(region_root):
                pass
    hugepage_intent.path(region_root).unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(json.dumps({"op": "grow"}))
    hugepage_intent.path(region_root).symlink_to(elsewhere)
    with pytest.raises(IntentError, match="Too many levels of symbolic links"):
        hugepage_intent.load(region_root)
    hugepage_intent.path(region_root).unlink()
    state.rmdir()
    state.symlink_to(tmp_path)
    with pytest.raises(IntentError, match="not a directory"):
        hugepage_intent.write(region_root, Intent("grow", "p", PAGE, 1, 0, 0, records.boot_id()))
    assert list(tmp_path.glob("hugepages.intent*")) == [] and total() == before
    state.unlink()


def _record(added: int, *, boot: str = "b", size: int = PAGE) -> records.Record:
    rec = records.Record.new(PoolRequest(name="p", capacity=64 * MiB, medium="HugePages-2Mi"))
    rec.hugepages_added, rec.boot_id, rec.hugepage_size = added, boot, size
    return rec


def test_what_an_interrupted_change_owes_the_kernel():
    """The decision, case by case: (pages to add to nr_hugepages) from the kernel's total now and
    the pool's record; before-total 100, 32 pages asked, 4 recorded before, boot "b"."""
    grow = Intent("grow", "p", PAGE, 32, 100, 4, "b")
    assert grow.correction(100, _record(4)) == 0  # killed before writing nr_hugepages
    assert grow.correction(132, _record(4)) == -32  # grown, not recorded: give back
    assert grow.correction(120, _record(4)) == -20  # the kernel granted 20 of 32
    assert grow.correction(132, _record(36)) == 0  # grown and recorded
    assert grow.correction(132, None) == -32  # the record was removed: no pool owns them
    assert grow.correction(132, _record(36, boot="a")) == -32  # a stale record of another boot
    assert grow.correction(140, _record(4)) == -32  # never more than the intent asked

    shrink = Intent("shrink", "p", PAGE, 32, 100, 32, "b")
    assert shrink.correction(100, _record(32)) == 0  # record untouched: the kernel is too
    assert shrink.correction(100, _record(0)) == -32  # recorded, not given back: finish it
    assert shrink.correction(68, _record(0)) == 0  # given back and recorded
    assert shrink.correction(68, None) == 0  # ... and the pool's record removed since
    assert shrink.correction(100, None) == -32  # record gone before the kernel was written
    assert shrink.correction(60, _record(0)) == 0  # someone else took more: never add back

    for bad in (
        dict(op="resize"),
        dict(pool="../etc"),
        dict(pages=0),
        dict(page_size=3 * MiB),
        dict(before=-1),
        dict(recorded=True),
    ):
        fields = dict(op="grow", pool="p", page_size=PAGE, pages=1, before=0, recorded=0, boot_id="b")
        with pytest.raises(ValueError, match="not a huge page intent"):
            Intent(**{**fields, **bad})  # type: ignore[arg-type]
