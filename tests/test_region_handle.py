"""One pool handle: an operation resolves its pool once and goes through descriptors after.

``region.files.handle.open_pool`` opens the pool's directory and its state directory beneath
the host root once; everything an operation does below it goes through those descriptors. So
a name swapped under the pool root after the opening redirects nothing of that operation, and
one provision, status read or release looks the pool's name up a fixed, small number of times
(before the handle: a provision opened the pool directory by name a dozen times and its state
directory eighteen). The lock is the one step that looks again, by design: a waiter whose
state directory was released meanwhile takes the pool anew. Real directories, mounts, flocks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offloadpool.region.files import beneath, layout_files
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import open_pool
from offloadpool.region.holding import holders, published
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import ABSENT, READY

MiB = 1 << 20
NAME = "kv"


def request() -> PoolRequest:
    return PoolRequest(name=NAME, capacity=8 * MiB, medium="Memory", min_segment=4 * MiB, max_files=2)


class _Opens:
    """Every open (``os.open``, ``open``) of the pool's name while counting: the name itself beneath a
    directory descriptor (the pool directory beneath the root, the state directory's last step
    beneath ``.state``) or a path at or under ``<root>/<pool>``. An audit hook sees each call
    before the kernel does (a lookup that finds nothing counts too); it cannot be removed, so
    it records only while a test counts."""

    def __init__(self) -> None:
        self.pool: Path | None = None
        self.seen: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or self.pool is None:
            return
        path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
        if path == self.pool.name or path == str(self.pool) or path.startswith(f"{self.pool}/"):
            self.seen.append(path)

    def count(self, pool: Path, step: Any) -> int:
        self.seen, self.pool = [], pool
        try:
            step()
        finally:
            self.pool = None
        return len(self.seen)


_OPENS = _Opens()


@pytest.fixture
def walk(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Names opened by the ``O_NOFOLLOW`` walk (one ``os.open`` per component, which the audit
    hook sees), not ``openat2`` through ctypes (which it does not)."""
    monkeypatch.setattr(beneath, "_use_openat2", False)
    yield


def test_one_provision_status_and_release_look_the_pool_up_by_name_once(
    region_root: Path, walk: None
) -> None:
    """A fresh provision looks each of the pool's two directories up once before they exist and
    opens each once it has made them; a second provision (the pool kept), a status read and a
    release open each once. Before the handle these were 32, 20, 5 and 13."""
    pool = region_root / NAME
    made = _OPENS.count(pool, lambda: provision(request(), region_root))
    assert _OPENS.seen == [NAME] * 3, (
        "the pool directory: looked up, then opened once made; its state directory: opened once made"
    )
    assert made == 3
    assert _OPENS.count(pool, lambda: provision(request(), region_root)) == 2, _OPENS.seen
    state = pool_state(region_root, NAME)
    assert state.phase == READY
    assert _OPENS.count(pool, lambda: pool_state(region_root, NAME)) == 2, _OPENS.seen
    assert _OPENS.count(pool, lambda: release(region_root, NAME)) == 2, _OPENS.seen
    assert pool_state(region_root, NAME).phase == ABSENT


def test_a_name_swapped_after_the_opening_redirects_nothing_of_the_operation(
    region_root: Path, tmp_path: Path
) -> None:
    """Once the pool is open, its directory renamed away and a link to a directory elsewhere put
    at its name, and its state directory replaced by another: every later step of the
    operation (record, manifest, lease, holder records, the exclusive lease) acts on the
    directories it opened, nothing lands where the names now lead, while a lookup by name (a
    new operation) sees the new state directory."""
    req = request()
    provision(req, region_root)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pool_dir, state_dir = region_root / NAME, region_root / ".state" / NAME
    moved, moved_state = region_root / "kv-moved", region_root / ".state" / "kv-moved"
    with open_pool(pool_dir, lock=True) as pool:
        manifest = pool.read_manifest()
        os.rename(state_dir, moved_state)
        state_dir.mkdir(mode=0o700)
        # the pool directory holds the mount: a bind of another directory over its name would do
        # the same to a lookup; a rename of the directory holding a mount point is refused
        # (EBUSY) only for the mount point itself, so the pool directory is moved whole
        os.rename(pool_dir, moved)
        pool_dir.symlink_to(elsewhere)
        try:
            rec = records.load(pool)
            assert rec is not None and rec.phase == READY
            rec.message = "written through the handle"
            records.save(pool, rec)
            pool.write_manifest(manifest)
            layout_files.ensure_lease_file(pool)
            published.save(pool, published.Published("csi-1", "uid-1", "team-a", "/target"))
            assert [p.volume_id for p in published.load_all(pool)] == ["csi-1"]
            with pytest.raises(holders.PoolInUse, match="csi-1"):  # its own record holds it
                holders.exclusive_unused(pool).close()
            assert published.drop(pool, "csi-1")
            holders.exclusive_unused(pool).close()  # the lease in the directory it opened
            assert records.load(pool_dir) is None, "a new lookup by name finds the new, empty state directory"
        finally:
            pool_dir.unlink()
            os.rename(moved, pool_dir)
    assert list(elsewhere.iterdir()) == [], "nothing reached through the link at the pool's name"
    assert list(state_dir.iterdir()) == [], "nothing written to the state directory now at the name"
    kept = records.parse((moved_state / records.RECORD_NAME).read_bytes())
    assert kept is not None and kept.message == "written through the handle"
    assert (pool_dir / "manifest.json").read_bytes() == manifest.encode()  # moved back
    os.rmdir(state_dir)
    os.rename(moved_state, state_dir)
    assert release(region_root, NAME).existed


def test_a_lock_waiter_takes_the_pool_anew_when_it_was_released_meanwhile(region_root: Path) -> None:
    """The lock's re-check: a handle opened before a release finished waits for the lock, then
    finds the state directory it holds no longer at the name (released, and made again by a
    provision meanwhile) and takes both directories anew, so what it does under the lock lands
    in the pool that is there now, not in the removed one."""
    provision(request(), region_root)
    pool_dir = region_root / NAME
    released, waiting = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def wait_for_lock() -> None:
        with open_pool(pool_dir) as pool:
            before = os.fstat(pool.state_fd()).st_ino
            waiting.set()
            with pool.lock():
                seen["before"] = before
                seen["after"] = os.fstat(pool.state_fd()).st_ino
                seen["record"] = records.load(pool)
                seen["has_dir"] = pool.has_dir()

    with open_pool(pool_dir, lock=True) as holder:
        waiter = threading.Thread(target=wait_for_lock)
        waiter.start()
        assert waiting.wait(10)
        # a release under this lock, then a provision making the pool again (in another handle:
        # the provision takes the lock too, so it is made here by hand as a provision makes it)
        from offloadpool.region.lifecycle.teardown import teardown

        teardown(holder)
        released.set()
        with open_pool(pool_dir, create=True) as again:
            records.save(again, records.Record.new(request()))
    waiter.join(10)
    assert not waiter.is_alive()
    assert seen["after"] != seen["before"], "the waiter locked the state directory at the name now"
    assert seen["record"] is not None, "and reads the record made there, not the removed one's"
    assert seen["has_dir"]
    assert release(region_root, NAME).existed
