"""``offloadpool hold-lease``, the lease sidecar the webhook gives every labelled pod, as a real
process: it takes the pool's shared flock (seen in /proc/locks by count_holders), writes its
ready file, waits while the node side holds the lease exclusively, and exits 0 on SIGTERM with
the lock released and the ready file gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fixtures.wait import wait_for
from offloadpool.region.holding.lease import Lease, LeaseHeld, count_holders, lease_path

EXE = str(Path(sys.executable).parent / "offloadpool")


def start(pool_dir: Path, ready: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [EXE, "hold-lease", str(pool_dir), "--ready-file", str(ready), "--poll-seconds", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    return proc.returncode, out


def test_holds_the_shared_lease_until_sigterm_then_exits_0_releasing_it(tmp_path: Path) -> None:
    lease_path(tmp_path).touch()
    ready = tmp_path / "ready"
    proc = start(tmp_path, ready)
    try:
        wait_for("the ready file", ready.exists, 15, interval=0.02)
        assert count_holders(lease_path(tmp_path)) == 1
        assert ready.read_text().strip() == str(proc.pid)
        try:
            Lease.exclusive(tmp_path)
            raise AssertionError("the node side got the lease exclusively while the sidecar held it")
        except LeaseHeld as held:
            assert "1 attached engine" in str(held)
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    assert count_holders(lease_path(tmp_path)) == 0
    assert not ready.exists()
    assert "holding the shared lease" in out and "SIGTERM: releasing" in out
    Lease.exclusive(tmp_path).close()  # the node side may change the pool again


def test_waits_for_the_lease_file_and_for_an_exclusive_holder(tmp_path: Path) -> None:
    """Not provisioned yet: it waits without creating the lease file. Held exclusively (the agent
    applying a change): it waits, not ready, and takes the lease when the agent lets go."""
    ready = tmp_path / "ready"
    proc = start(tmp_path, ready)
    try:
        time.sleep(0.5)
        assert proc.poll() is None and not lease_path(tmp_path).exists() and not ready.exists()
        lease_path(tmp_path).touch()
        agent = Lease.exclusive(tmp_path)
        time.sleep(0.5)
        assert proc.poll() is None and not ready.exists() and count_holders(lease_path(tmp_path)) == 0
        agent.close()
        wait_for("the ready file after the exclusive holder let go", ready.exists, 15, interval=0.02)
        assert count_holders(lease_path(tmp_path)) == 1
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
    assert "not provisioned on this node yet" in out and "held exclusively by the node agent" in out


def test_sigterm_while_waiting_exits_0(tmp_path: Path) -> None:
    proc = start(tmp_path, tmp_path / "ready")
    time.sleep(0.3)
    rc, out = stop(proc)
    assert rc == 0, out


def test_reads_only_and_never_creates_the_lease(tmp_path: Path) -> None:
    """Read permission is enough (flock needs no write access): a consumer uid that may only
    read the lease file still holds it."""
    lease = lease_path(tmp_path)
    lease.touch()
    os.chmod(lease, 0o444)
    ready = tmp_path / "ready"
    proc = start(tmp_path, ready)
    try:
        wait_for("the ready file", ready.exists, 15, interval=0.02)
        assert count_holders(lease) == 1
    finally:
        rc, out = stop(proc)
    assert rc == 0, out
