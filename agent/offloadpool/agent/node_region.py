"""This node's region of the pool: what the node's own record says it holds, and who uses it.

The agent decides from the node's record (in the pool's root-only state directory), never from
the manifest in the pool directory, which pods can write. Who uses the region is read from the
kernel (``offloadpool.region.holding.holders``): engines holding the pool's lease, and processes that map
or hold open its files, so stock vLLM, which takes no lease, counts too.
"""

from __future__ import annotations

from pathlib import Path

from offloadpool.region.errors import RegionError
from offloadpool.region.files import layout_files, places
from offloadpool.region.files import record as records
from offloadpool.region.files.handle import open_pool
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.holding import engine_id_mismatch, holders, shares
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.status import local_region
from offloadpool.region.request import PoolRequest


class NodeRegion:
    """One pool's region under one host root."""

    def __init__(self, root: Path, pool_name: str) -> None:
        self.root = Path(root)
        self.pool_name = pool_name

    @property
    def pool_dir(self) -> Path:
        return places.pool_dir(self.root, self.pool_name)

    def local(self) -> tuple[int, int] | None:
        """(generation, total bytes) of the complete region on this node, from the node's own
        record: the manifest is in the pod-writable pool directory and is not trusted."""
        return local_region(self.root, self.pool_name)

    def populate_rate(self) -> float | None:
        """GiB/s of the pre-fault that made the region, from the node's own record (kept
        there across agent restarts and reuses); None when the record has none."""
        rec = records.load(self.pool_dir)
        rate = (rec.populate or {}).get("gib_per_s") if rec is not None else None
        if isinstance(rate, bool) or not isinstance(rate, int | float) or rate <= 0:
            return None
        return float(rate)

    def generation(self) -> int | None:
        """Generation of the complete region on this node (None if there is none)."""
        local = self.local()
        return None if local is None else local[0]

    def handed_out_problem(self, req: PoolRequest) -> str | None:
        """What a pod changed of the Ready pool's entries (``layout_files.handed_out_problem``),
        in one line naming the entry; None when nothing (or when there is nothing to check: the
        next provision says why)."""
        try:
            return layout_files.handed_out_problem(self.pool_dir, make_plan(req), req)
        except places.UnsafeEntry as exc:
            return str(exc)
        except (OSError, RegionError):
            return None

    def engines_attached(self) -> int:
        """Processes holding the lease or mapping/opening the pool's files, each once.

        Stock vLLM takes no lease: counting mappings too is what makes it visible. The scan
        sees other pods' processes only when this agent reads the host's /proc. The scan runs
        only when a file of the pool is open or mapped somewhere (``holders.count``).
        """
        return holders.count(self.pool_dir)

    def held(self) -> LeaseHeld | None:
        """Why the pool cannot be changed now (its holders, named as a provision would), or
        None when nothing holds it. Takes and lets go of the exclusive lease, as a provision
        does before it changes anything."""
        with open_pool(self.pool_dir) as pool:
            if not pool.exists():
                return None
            try:
                with pool.lock():
                    holders.exclusive_unused(pool).close()
            except LeaseHeld as exc:
                return exc
            return None

    def shares(self, partitions: int) -> list[shares.ShareState] | None:
        """Each share of a partitioned pool, claimed or free, and by whom (None: no shares,
        or their names are not there). An engine on any share holds the pool's lease too, so
        ``engines_attached`` counts it as well: shares say which share it is on."""
        if partitions < 2:
            return None
        try:
            return shares.states(self.pool_dir, partitions)
        except (OSError, places.UnsafeEntry):
            return None

    def engine_id_mismatch(self, engine_id: str | None) -> str | None:
        """For a stock-vLLM compat pool (``engine_id`` its vLLM engine id; None: not one): a
        process that was given the pool but maps a vLLM region of its own (another engine id),
        in one line; None when there is none.

        vLLM itself reports nothing in that case (it builds its own region and the pool stays
        unused), so this is the only place the mistake becomes visible.
        """
        if engine_id is None:
            return None
        found = engine_id_mismatch.find(self.pool_dir)
        return engine_id_mismatch.describe(found, engine_id)[:4096] if found else None
