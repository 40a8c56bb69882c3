"""Chaos, engine side: kill -9 of an attached engine while it attaches and pins.

Three pools (tmpfs 4 KiB, tmpfs THP, 2 MiB huge pages) live for the whole module, so the runs
also show that a series of engines dying in every phase never wears a pool down. Each seeded
run starts a real engine process (``fixtures/chaos_engine.py``: ``attach``, write 4 KiB,
``pin("mlock")`` in 256 KiB-2 MiB calls) and kills it with SIGKILL at a named point (the lease taken,
segments open, address range reserved, segments mapped, after the n-th pinned chunk, all
pinned) or after a random delay (from its start, or from its attach). Then: the lease and the
per-file registration locks are free, no process maps the pool, the pool is still Ready and
unchanged, every byte written to it is still there, the node could release it now, and the
next engine attaches and pins at once. At the end the pools are provisioned again (reused,
never re-populated) and released with nothing left. No mocks. See docs/chaos.md.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures.chaos import Run, seeds
from fixtures.chaos_engine import DATA_BYTES, engine_data
from fixtures.host import hugepage_totals
from fixtures.pinning_pools import vm_locked_bytes
from offloadpool.pinning import attach
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.holding import holders
from offloadpool.region.holding.holders import exclusive_unused
from offloadpool.region.holding.lease import LeaseHeld, count_holders, lease_path
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.memory.media import is_hugetlbfs
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
FIXTURES = Path(__file__).parent / "fixtures"
CRASH_AT, ENGINE = str(FIXTURES / "crash_at.py"), str(FIXTURES / "chaos_engine.py")
#: pinned in calls of this size: small, so pinning takes hundreds of calls and a kill can land
#: between them (a multiple of the pool's page size)
CHUNK = {"Memory": 256 << 10, "MemoryTHP": 2 * MiB, "HugePages-2Mi": 2 * MiB}
POOLS = {"Memory": 256 * MiB, "MemoryTHP": 256 * MiB, "HugePages-2Mi": 128 * MiB}
POINTS = (
    "engine:lease-taken",
    "engine:segments-open",
    "engine:range-reserved",
    "engine:mapped",
    "engine:pin-chunk",
    "engine:pinned",
    "engine:pin-chunk",
)  # mid-pin twice as often
REFERENCE_BYTES = 1 * MiB  # written once at the start of each pool; must survive every run


@dataclass
class EnginePool:
    dir: Path
    medium: str
    capacity: int
    reference: bytes
    writes: dict  # offset -> bytes every engine that reported WROTE left there
    pin_seconds: float = 0.0  # how long attach + write + pin takes here (calibrated once)

    @property
    def root(self) -> Path:
        return self.dir.parent


@pytest.fixture(scope="module")
def engine_pools(
    tmp_path_factory: pytest.TempPathFactory, hugepage_reservation: dict
) -> Iterator[dict[str, EnginePool]]:
    """One Ready pool per medium for the module; released at the end, leaving nothing."""
    root = tmp_path_factory.mktemp("chaos-engine")
    totals = hugepage_totals()
    pools: dict[str, EnginePool] = {}
    try:
        for medium, capacity in POOLS.items():
            name = medium.lower().replace("-", "")
            req = PoolRequest(name=name, capacity=capacity, medium=medium, min_segment=64 * MiB)
            result = provision(req, root, workers=2)
            reference = random.Random(medium).randbytes(REFERENCE_BYTES)
            t0 = time.monotonic()
            with attach(result.pool_dir) as region:
                view = region.memoryview()
                view[:REFERENCE_BYTES] = reference
                view.release()
                region.pin("mlock", max_chunk=CHUNK[medium])
                seconds = time.monotonic() - t0
            pools[medium] = EnginePool(result.pool_dir, medium, capacity, reference, {}, seconds)
            print(f"{medium}: attach + write + pin {seconds * 1000:.1f} ms")
        yield pools
        for medium, pool in pools.items():
            req = PoolRequest(name=pool.dir.name, capacity=pool.capacity, medium=medium, min_segment=64 * MiB)
            again = provision(req, root, workers=2)
            assert again.reused and again.populated_bytes == 0, (
                f"{medium}: the pool was re-populated after the runs"
            )
    finally:
        for pool in pools.values():
            release(root, pool.dir.name, force=True)
    assert mounts.mounts_under(root) == [], mounts.mounts_under(root)
    assert hugepage_totals() == totals


def start_engine(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def phase_of(lines: list[str], locked: int, pool: EnginePool) -> str:
    """How far an engine killed after a delay had got (its output, and VmLck read just before)."""
    if "PINNED" in lines:
        return "pinned, holding"
    if "WROTE" in lines:
        if is_hugetlbfs(pool.medium):
            return "pinning (hugetlb: VmLck does not count)"
        tenth = 10 * (10 * locked // pool.capacity)
        return f"pinning {min(90, tenth)}-{min(100, tenth + 10)}%"
    if "ATTACHED" in lines:
        return "attached, writing"
    return "starting (not attached)"


@pytest.mark.chaos
@pytest.mark.parametrize("seed", seeds(2))
def test_kill9_engine_mid_pin(seed: int, chaos_run: Run, engine_pools: dict[str, EnginePool]) -> None:
    run, rng = chaos_run, random.Random(seed)
    how = "point" if seed % 2 == 0 else rng.choice(("delay from start", "delay from attach"))
    # pinning huge pages takes a millisecond or two: a delay lands mid-pin only on 4 KiB pages
    pool = engine_pools["Memory" if how == "delay from attach" else rng.choice(sorted(engine_pools))]
    manifest_before = load_manifest(pool.dir)
    offset = REFERENCE_BYTES + DATA_BYTES * rng.randrange(0, (pool.capacity - REFERENCE_BYTES) // DATA_BYTES)
    # a point run that never reaches its point ends by itself; a delay run waits to be killed
    chunk = CHUNK[pool.medium]
    engine = [ENGINE, str(pool.dir), str(offset), str(seed), str(chunk), "0" if how == "point" else "60"]
    run.say(f"{pool.medium}, engine writes at {offset}, killed by {how}")

    if how == "point":
        point = POINTS[(seed // 2) % len(POINTS)]
        nth = rng.randint(1, pool.capacity // chunk) if point == "engine:pin-chunk" else 1
        proc = start_engine([sys.executable, CRASH_AT, point, str(nth), *engine])
        out, err = proc.communicate(timeout=60)
        run.check(
            "the engine died at the point it was sent to",
            f"CRASH-POINT {point} #{nth}" in err,
            f"rc {proc.returncode}: {err[-1000:]}",
        )
        label = (
            point
            if point != "engine:pin-chunk"
            else f"{point} ({10 * (10 * nth * chunk // pool.capacity)}% of the calls)"
        )
        run.hit(label)
        lines = out.split()
    else:
        proc = start_engine([sys.executable, *engine])
        lines = []
        if how == "delay from attach":
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "ATTACHED":
                proc.kill()
                run.check("the engine attaches", False, f"{line!r} {proc.communicate(timeout=60)[1][-1000:]}")
            lines.append(line)
            time.sleep(rng.uniform(0.0, 1.5 * pool.pin_seconds))
        else:
            time.sleep(rng.uniform(0.0, 0.8))
        try:
            locked = vm_locked_bytes(proc.pid)
        except (AssertionError, OSError):
            locked = 0
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        lines += out.split()
        run.check(
            "the engine was alive until killed",
            proc.returncode == -signal.SIGKILL,
            f"rc {proc.returncode}: {err[-1000:]}",
        )
        run.hit(f"{how}: {phase_of(lines, locked, pool)}")
    if "WROTE" in lines:
        pool.writes[offset] = engine_data(seed)

    run.check("lease free (no shared flock left)", count_holders(lease_path(pool.dir)) == 0)
    run.check(
        "no process maps or holds the pool", holders.count(pool.dir) == 0, str(holders.find_holders(pool.dir))
    )
    state = pool_state(pool.root, pool.dir.name)
    run.check("the pool stays Ready", state.phase == "Ready" and state.engines_attached == 0, state.message)
    run.check("the manifest is unchanged", load_manifest(pool.dir) == manifest_before)
    try:
        exclusive_unused(pool.dir).close()  # what release and reshaping take
        free = ""
    except LeaseHeld as exc:
        free = str(exc)
    run.check("the node could release the pool now", not free, free)

    t0 = time.monotonic()
    base = vm_locked_bytes()
    with attach(pool.dir, lease_timeout=0) as region:
        attached = time.monotonic() - t0
        stats = region.pin("mlock", max_chunk=64 * MiB)
        pinned = time.monotonic() - t0
        counted = 0 if is_hugetlbfs(pool.medium) else pool.capacity
        run.check("the next engine pins the whole region", stats.bytes_registered == pool.capacity)
        run.check(
            "it locks exactly its own region (nothing of the dead engine counts)",
            vm_locked_bytes() - base == counted,
            f"{vm_locked_bytes() - base} != {counted}",
        )
        view = region.memoryview()
        run.check("reference data intact", bytes(view[:REFERENCE_BYTES]) == pool.reference)
        for at, data in pool.writes.items():
            run.check(
                "data every earlier engine wrote is intact",
                bytes(view[at : at + DATA_BYTES]) == data,
                f"offset {at}",
            )
        view.release()
    # lease_timeout=0 already fails the attach if anything held the lease; the bound only
    # catches an attach that is slow for another reason (generous: the machine may be loaded)
    run.check("the next attach is immediate (no lease wait)", attached < 5.0, f"{attached:.3f} s")
    run.say(f"next engine attached in {attached * 1000:.1f} ms, pinned in {pinned * 1000:.1f} ms")
    run.check("nothing stays locked after the next engine detached", vm_locked_bytes() == base)
    run.check("lease free after the next engine", count_holders(lease_path(pool.dir)) == 0)
