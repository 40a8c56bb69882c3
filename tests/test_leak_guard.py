"""The session leak guard can fail: it names a real leftover mount, process and temp dir.

Why: a guard that never fires proves nothing. This creates each kind of leak for real (a
tmpfs mount, a child process, a temp dir), checks the guard's report names each one exactly,
then removes them and checks the report is empty again.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from fixtures.leak_guard import leaks, snapshot


def test_guard_names_each_leak_and_is_quiet_once_cleaned(tmp_path: Path) -> None:
    before = snapshot()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "leakguard-check", str(mnt)], check=True)
    leaked_dir = tempfile.mkdtemp(prefix="offloadpool-leakguard-check-")
    child = subprocess.Popen(["sleep", "600"])
    try:
        found = leaks(before, snapshot())
        assert any(line.startswith(f"mount left behind: tmpfs leakguard-check on {mnt} ")
                   for line in found), found
        assert f"process still running: pid {child.pid}: sleep 600" in found, found
        assert f"temp entry left behind: {leaked_dir}" in found, found
        assert len(found) == 3, found
    finally:
        child.kill()
        child.wait(10)
        os.rmdir(leaked_dir)
        subprocess.run(["umount", str(mnt)], check=True)
    assert leaks(before, snapshot()) == []
