"""After a node reboot the pool's mount and the huge pages it added are gone, while a host root
on disk still holds its record: status says so, provision rebuilds, and release never gives
back pages that an earlier boot added."""

from __future__ import annotations

import json

from fixtures.host import hugepage_totals
from offloadpool.region.files.places import state_dir
from offloadpool.region.files.record import RECORD_NAME
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import hugepages, mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20


def simulate_reboot(pool_dir, added: int) -> None:
    """What a reboot does to a pool whose root survives on disk: the mount is gone and the
    kernel pool is back to its boot size; the record still says the earlier boot added pages
    (here: claims 32, so that giving them back would visibly take other tenants' pages)."""
    mounts.umount(pool_dir / "mnt")
    with hugepages.reservation_lock():
        hugepages.shrink(2 * MiB, added)
    record = json.loads((state_dir(pool_dir) / RECORD_NAME).read_text())
    record["boot_id"] = "an-earlier-boot"
    record["hugepages_added"] = 32
    (state_dir(pool_dir) / RECORD_NAME).write_text(json.dumps(record))


def test_rebuild_after_reboot_keeps_huge_page_accounting(region_root, hugepage_baseline):
    # pages someone else keeps in the pool (a boot-time reservation): they must survive
    with hugepages.reservation_lock():
        assert hugepages.grow(2 * MiB, 48) == 48, "the kernel must grant 48 pages of 2 MiB"
    req = PoolRequest(name="reboot", capacity=64 * MiB, medium="HugePages-2Mi")
    pool_dir = region_root / req.name
    first = provision(req, region_root)
    simulate_reboot(pool_dir, first.hugepages_added)
    others = hugepage_totals()

    state = pool_state(region_root, req.name)
    assert state.phase == "Failed" and "mount is gone" in state.message

    again = provision(req, region_root)
    assert again.rebuilt and not again.reused and again.populated_bytes == req.capacity
    assert pool_state(region_root, req.name).phase == "Ready"
    release(region_root, req.name)
    assert hugepage_totals() == others, "release gave back pages an earlier boot had added"
    assert mounts.mounts_under(region_root) == []
