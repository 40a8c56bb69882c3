"""The session leak guard can fail: it names a real leftover mount, process and temp dir.

Why: a guard that never fires proves nothing. This creates each kind of leak for real (a
tmpfs mount, a child process, a temp dir), checks the guard's report names each one exactly,
then removes them and checks the report is empty again.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from fixtures.leak_guard import leaks, snapshot


@pytest.mark.root  # it mounts a real tmpfs to leak
def test_guard_names_each_leak_and_is_quiet_once_cleaned(tmp_path: Path) -> None:
    before = snapshot()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "leakguard-check", str(mnt)], check=True)
    leaked_dir = tempfile.mkdtemp(prefix="offloadpool-leakguard-check-")
    leaked_shm = tempfile.mkdtemp(prefix="offloadpool-leakguard-check-", dir="/dev/shm")  # the scale test's
    child = subprocess.Popen(["sleep", "600"])
    try:
        found = leaks(before, snapshot())
        assert any(
            line.startswith(f"mount left behind: tmpfs leakguard-check on {mnt} ") for line in found
        ), found
        assert f"process still running: pid {child.pid}: sleep 600" in found, found
        assert f"temp entry left behind: {leaked_dir}" in found, found
        assert f"temp entry left behind: {leaked_shm}" in found, found
        assert len(found) == 4, found
    finally:
        child.kill()
        child.wait(10)
        os.rmdir(leaked_dir)
        os.rmdir(leaked_shm)
        subprocess.run(["umount", str(mnt)], check=True)
    assert leaks(before, snapshot()) == []


def test_guard_tells_pages_kept_from_reservation_given_away() -> None:
    """More pages than at the start is a pool that did not give back; fewer is the suite's kept
    reservation (part of the start value) given away — both fail the session, each named."""
    before = snapshot()
    size = next(iter(before.hugepages))
    more = replace(before, hugepages={**before.hugepages, size: before.hugepages[size] + 3})
    fewer = replace(before, hugepages={**before.hugepages, size: before.hugepages[size] - 1})
    assert leaks(before, more) == [
        f"huge pages not given back: /sys/kernel/mm/hugepages/{size}/nr_hugepages "
        f"is {before.hugepages[size] + 3}, was {before.hugepages[size]} at session start"
    ]
    (line,) = leaks(before, fewer)
    assert (
        line.startswith(
            f"huge pages given away: /sys/kernel/mm/hugepages/{size}/nr_hugepages is "
            f"{before.hugepages[size] - 1}, was {before.hugepages[size]}"
        )
        and "hack/hugepages.py" in line
    )
