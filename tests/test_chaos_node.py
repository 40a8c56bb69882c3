"""Chaos, node side: kill -9 of the real CLI at random points of provision, populate and release.

Each seeded run draws a pool shape, then kills 1-2 provisions and 1-2 releases of it, each in
one of three ways: at a *named point* (the process kills itself with SIGKILL on reaching it,
``fixtures/crash_at.py``: between two steps, inside an atomic file write, after the n-th
populated chunk), at a random *populate progress* (the test watches the journal, writes an
engine's data into a part already populated, then kills), or after a random *delay*. After
every kill and after the runs that follow, invariants that would be false if the node engine
were wrong are asserted (see ``check_after_kill``, ``check_converged``, ``check_released``).
Real mounts, real huge pages, real ``madvise``; no mocks. See docs/chaos.md.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fixtures.chaos import Run, seeds
from fixtures.host import cli, cli_argv, hugepage_totals, other_tenant_holds_free_hugepages
from offloadpool.pinning import attach
from offloadpool.region.files.journal import JOURNAL_NAME, Unit, units
from offloadpool.region.files.manifest import MANIFEST_NAME, ManifestError
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.files.places import state_dir
from offloadpool.region.files.planner import Plan
from offloadpool.region.files.planner import plan as make_plan
from offloadpool.region.files.record import RECORD_NAME
from offloadpool.region.holding import holders
from offloadpool.region.holding.lease import count_holders, lease_path
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest

MiB = 1 << 20
CRASH_AT = str(Path(__file__).parent / "fixtures" / "crash_at.py")
NAME = "chaos"
MEDIA = ("Memory", "MemoryTHP", "HugePages-2Mi")
#: what a Ready pool's directory holds, nothing more (no temp file of an interrupted write)
READY_ENTRIES = {"lease", MANIFEST_NAME, "mnt"}
#: what its state directory (root-only, no pod is given it) holds
READY_STATE = {JOURNAL_NAME, RECORD_NAME}
PROVISION_POINTS = (
    "provision:record-Provisioning",
    "provision:mid-record-write",
    "provision:hugepages-reserved",
    "provision:mounted-not-shared",
    "provision:mounted",
    "provision:segments-created",
    "provision:record-Populating",
    "provision:populate-chunk",
    "provision:mid-manifest-write",
    "provision:manifest-written",
    "provision:record-Ready",
)
RELEASE_POINTS = (
    "release:lease-taken",
    "release:manifest-removed",
    "release:unmounted",
    "release:record-Draining",
    "release:remove-names",
    "release:mid-remove-names",
)
#: The provision point between growing the kernel's huge page pool and recording it. Runs that
#: start with it take every free huge page first (as another tenant would hold them), so the
#: pool really grows, and their first release is killed between giving pages back and removing
#: the intent (after the record): the two windows the huge page intent closes.
GROWTH_POINT = "provision:hugepages-reserved"
GROWTH_RELEASE_POINT = "release:hugepages-shrunk"
ENGINE_BYTES = 64 << 10  # what the "engine" writes into a populated unit


@dataclass
class Pool:
    """The pool a run works on, and what it has learned about it so far."""

    root: Path
    medium: str
    capacity: int
    min_segment: int
    workers: int
    written: dict[int, bytes] = field(default_factory=dict)  # unit index -> engine data

    @property
    def dir(self) -> Path:
        return self.root / NAME

    def request(self) -> PoolRequest:
        return PoolRequest(
            name=NAME,
            capacity=self.capacity,
            medium=self.medium,
            min_segment=self.min_segment,
            workers=self.workers,
        )

    def plan(self) -> Plan:
        return make_plan(self.request())

    def units(self) -> list[Unit]:
        p = self.plan()
        return units(p.segments, p.page_size)

    def flags(self) -> list[str]:
        return [
            "--root",
            str(self.root),
            "--name",
            NAME,
            "--capacity",
            f"{self.capacity // MiB}Mi",
            "--medium",
            self.medium,
            "--min-size",
            f"{self.min_segment // MiB}Mi",
            "--workers",
            str(self.workers),
        ]

    def journal(self) -> bytes:
        try:
            return (state_dir(self.dir) / JOURNAL_NAME).read_bytes()
        except FileNotFoundError:
            return b""

    def recorded_bytes(self) -> int:
        done = self.journal()
        return sum(u.bytes for u in self.units() if u.index < len(done) and done[u.index])

    def _map(self, unit: Unit, write: bytes | None) -> bytes:
        seg = self.plan().segments[unit.segment]
        fd = os.open(self.dir / seg.file, os.O_RDWR)
        try:
            m = mmap.mmap(fd, seg.bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                if write is not None:
                    m[unit.offset : unit.offset + len(write)] = write
                return m[unit.offset : unit.offset + ENGINE_BYTES]
            finally:
                m.close()
        finally:
            os.close(fd)

    def write_engine_data(self, rng: random.Random) -> int | None:
        """Write data into a unit the journal says is populated (as an engine would); its index."""
        done = self.journal()
        candidates = [
            u for u in self.units() if u.index < len(done) and done[u.index] and u.index not in self.written
        ]
        if not candidates:
            return None
        unit = rng.choice(candidates)
        self.written[unit.index] = rng.randbytes(ENGINE_BYTES)
        self._map(unit, self.written[unit.index])
        return unit.index

    def read_unit(self, index: int) -> bytes:
        return self._map(self.units()[index], None)


def crash_argv(point: str, nth: int, *args: str) -> list[str]:
    return [sys.executable, CRASH_AT, point, str(nth), "offloadpool.cli", *args]


def disk_phase(pool: Pool) -> str:
    """Where a killed run left the pool, read from disk (the label of delay/progress kills)."""
    if not (state_dir(pool.dir) / RECORD_NAME).exists():
        return "before the record"
    state = pool_state(pool.root, NAME)
    if state.phase == "Ready":
        return "Ready"
    if (pool.dir / MANIFEST_NAME).exists():
        return "manifest written, record not Ready"
    if state.phase == "Populating":
        done = pool.recorded_bytes() / pool.capacity
        return (
            "Populating 0%"
            if done == 0
            else "Populating 100%"
            if done >= 1
            else f"Populating {min(90, int(done * 10) * 10)}-{min(100, int(done * 10) * 10 + 10)}%"
        )
    if state.phase == "Provisioning":
        return "Provisioning, mounted" if mounts.mount_at(pool.dir / "mnt") else "Provisioning, not mounted"
    return f"{state.phase}"


def died_at(run: Run, proc: subprocess.Popen, point: str, nth: int) -> bool:
    """Wait for a process sent to die at the ``nth`` time it reaches ``point``: True when it did
    (checked by what it said), False when it ran to its end instead (checked to have succeeded)."""
    what = point.split(":", 1)[0]
    _out, err = proc.communicate(timeout=120)
    if proc.returncode == -signal.SIGKILL:
        run.check(
            "the process died at the point it was sent to", f"CRASH-POINT {point} #{nth}" in err, err[-500:]
        )
        run.hit(point + (f" #{nth}" if nth > 1 else ""))
        return True
    run.check(f"a {what} that is not killed succeeds", proc.returncode == 0, err[-2000:])
    return False


def kill_provision(run: Run, rng: random.Random, pool: Pool, processes, point: str | None = None) -> None:
    """One provision, killed at ``point``, or by one of the three methods the seed picks."""
    rate = ["--rate-limit", f"{pool.capacity // MiB}Mi"]  # about a second of populate: room to kill in
    how = "point" if point else rng.choice(("point", "point", "progress", "delay"))
    if how == "point":
        points = [
            p
            for p in PROVISION_POINTS
            if p != "provision:hugepages-reserved" or pool.medium.startswith("Huge")
        ]
        point = point or rng.choice(points)
        nth = {
            "provision:populate-chunk": rng.randint(1, 7),
            "provision:mid-record-write": rng.randint(1, 4),
        }.get(point, 1)
        proc = processes(crash_argv(point, nth, "provision", *pool.flags(), *rate))
        if not died_at(run, proc, point, nth):
            run.hit(f"{point} (not on this run's path: ran to Ready)")
        return
    proc = processes(cli_argv("provision", *pool.flags(), *rate))
    if how == "progress":
        target = rng.uniform(0.05, 0.95) * pool.capacity
        deadline = time.monotonic() + 60
        while proc.poll() is None and pool.recorded_bytes() < target and time.monotonic() < deadline:
            time.sleep(0.005)
        written = pool.write_engine_data(rng) if proc.poll() is None else None
        if written is not None:
            run.say(f"engine wrote into populated unit {written} before the kill")
    else:
        time.sleep(rng.uniform(0.0, 2.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    if proc.returncode == -signal.SIGKILL:
        run.hit(f"{how}: {disk_phase(pool)}")
    else:
        run.check("a provision that is not killed succeeds", proc.returncode == 0, proc.stderr.read()[-2000:])
        run.hit(f"{how}: finished before the kill")


def check_after_kill(run: Run, pool: Pool) -> None:
    """What must hold right after any kill of a provision."""
    state = pool_state(pool.root, NAME)
    run.check(
        "killed run leaves no lock behind (status not 'in progress')", not state.in_progress, state.message
    )
    own = {str((pool.dir / "mnt").resolve())}
    run.check(
        "no mount but the pool's own",
        {m.target for m in mounts.mounts_under(pool.root)} <= own,
        str(mounts.mounts_under(pool.root)),
    )
    complete = len(pool.journal()) == len(pool.units()) and all(pool.journal())
    if (pool.dir / MANIFEST_NAME).exists():
        run.check("a manifest (attachable) only over fully populated memory", complete, pool.journal().hex())
    else:
        run.check("no half-built pool visible as Ready", state.phase != "Ready", state.phase)
        try:
            attach(pool.dir).close()
            attached = True
        except ManifestError:
            attached = False
        run.check("an engine cannot attach to a half-built pool", not attached)
    if state.phase == "Ready":
        run.check("Ready only when complete", complete and mounts.mount_at(pool.dir / "mnt") is not None)


def check_converged(run: Run, pool: Pool, result: dict, recorded: int, was_ready: bool) -> None:
    """The provision after the kills: Ready, exactly as planned, nothing redone, data intact."""
    p = pool.plan()
    state = pool_state(pool.root, NAME)
    run.check("next run converges to Ready", state.phase == "Ready", state.message)
    run.check("not rebuilt", result["rebuilt"] is False)
    if was_ready:
        run.check("a Ready pool is reused, not re-populated", result["reused"] is True, str(result))
    else:
        run.check(
            "populated + skipped = capacity",
            result["populated_bytes"] + result["skipped_bytes"] == pool.capacity,
            str(result),
        )
    run.check(
        "nothing recorded as populated before the kill is populated again",
        result["skipped_bytes"] >= recorded,
        f"skipped {result['skipped_bytes']} < recorded {recorded}",
    )
    if recorded > 0:
        run.check("resume skips work (skipped_bytes > 0 after progress)", result["skipped_bytes"] > 0)
    run.check("journal complete", len(pool.journal()) == len(pool.units()) and all(pool.journal()))
    manifest = load_manifest(pool.dir)
    run.check("manifest as planned", manifest.regions == p.regions)
    files = sorted(f.name for f in (pool.dir / "mnt").iterdir())
    run.check(
        "exactly the planned segment files",
        files == sorted(Path(s.file).name for s in p.segments),
        str(files),
    )
    run.check(
        "segment sizes as planned", all(os.stat(pool.dir / s.file).st_size == s.bytes for s in p.segments)
    )
    entries = {e.name for e in pool.dir.iterdir()}
    run.check(
        "no stray file in the pool directory", entries == READY_ENTRIES, str(sorted(entries ^ READY_ENTRIES))
    )
    kept = {e.name for e in state_dir(pool.dir).iterdir()}
    run.check("no stray file in the state directory", kept == READY_STATE, str(sorted(kept ^ READY_STATE)))
    own = [m for m in mounts.mounts_under(pool.root)]
    run.check(
        "exactly one mount, the pool's",
        [m.target for m in own] == [str((pool.dir / "mnt").resolve())],
        str(own),
    )
    run.check("the pool's mount is a shared peer", "shared:" in own[0].propagation, own[0].propagation)
    for index, data in pool.written.items():
        run.check(
            "engine data written before the kill is intact", pool.read_unit(index) == data, f"unit {index}"
        )
    with attach(pool.dir) as region:  # a real engine attaches and sees the same bytes
        view = region.memoryview()
        for index, data in pool.written.items():
            u = pool.units()[index]
            offset = sum(s.bytes for s in p.segments[: u.segment]) + u.offset
            run.check(
                "the attached mapping shows the engine's data",
                bytes(view[offset : offset + len(data)]) == data,
            )
        view.release()
    run.check(
        "lease free after the engine detached",
        count_holders(lease_path(pool.dir)) == 0 and holders.count(pool.dir) == 0,
    )


def kill_release(run: Run, rng: random.Random, pool: Pool, processes, point: str | None = None) -> None:
    """One release, killed at ``point``, at a point the seed picks, or after a random delay."""
    if point or rng.random() < 0.75:
        point = point or rng.choice(RELEASE_POINTS)
        nth = rng.randint(1, 3) if point == "release:mid-remove-names" else 1
        proc = processes(crash_argv(point, nth, "release", NAME, "--root", str(pool.root)))
        if not died_at(run, proc, point, nth):
            run.hit(f"{point} (not on this run's path)")
    else:
        proc = processes(cli_argv("release", NAME, "--root", str(pool.root)))
        time.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        run.hit(
            "release delay: "
            + (
                "finished before the kill"
                if proc.returncode == 0
                else "nothing removed yet"
                if (pool.dir / MANIFEST_NAME).exists()
                else "part-way"
                if pool.dir.exists()
                else "pool gone"
            )
        )
    state = pool_state(pool.root, NAME)
    run.check("killed release leaves no lock behind", not state.in_progress)
    own = {str((pool.dir / "mnt").resolve())}
    run.check("no mount but the pool's own", {m.target for m in mounts.mounts_under(pool.root)} <= own)
    if (pool.dir / MANIFEST_NAME).exists():
        run.check(
            "while a manifest is there, the memory is there (Ready)", state.phase == "Ready", state.message
        )
    else:
        run.check("a pool being released is not Ready", state.phase != "Ready", state.phase)


def check_released(run: Run, pool: Pool, baseline: dict[int, int]) -> None:
    run.check("pool directory gone", not pool.dir.exists())
    run.check("no mount left", mounts.mounts_under(pool.root) == [], str(mounts.mounts_under(pool.root)))
    run.check(
        "huge page pools back at baseline",
        hugepage_totals() == baseline,
        f"{hugepage_totals()} != {baseline}",
    )


@pytest.mark.chaos
@pytest.mark.parametrize("seed", seeds(1))
def test_kill9_provision_populate_release(
    seed: int,
    chaos_run: Run,
    region_root: Path,
    hugepage_baseline: dict[int, int],
    processes,
    request: pytest.FixtureRequest,
) -> None:
    run, rng = chaos_run, random.Random(seed)
    # The first kill of each phase goes round the named points, so 20 consecutive seeds reach
    # every one of them; the others are drawn at random.
    first_point = PROVISION_POINTS[seed % len(PROVISION_POINTS)]
    first_release_point = RELEASE_POINTS[seed % len(RELEASE_POINTS)]
    medium = rng.choice(MEDIA) if first_point != GROWTH_POINT else "HugePages-2Mi"
    if first_point == GROWTH_POINT:
        tenant = other_tenant_holds_free_hugepages(region_root.parent / "tenant")
        held = tenant.__enter__()
        request.addfinalizer(lambda: tenant.__exit__(None, None, None))
        first_release_point = GROWTH_RELEASE_POINT
        run.say(f"another tenant holds the {held} free huge pages: the pool grows the kernel's")
    capacity = rng.choice((32, 64)) * MiB
    pool = Pool(
        region_root, medium, capacity, min_segment=rng.choice((16, 32)) * MiB, workers=rng.choice((1, 2))
    )
    run.say(f"{medium}, {capacity // MiB} MiB, {len(pool.plan().segments)} file(s), {pool.workers} worker(s)")

    for attempt in range(rng.randint(1, 2)):
        kill_provision(run, rng, pool, processes, first_point if attempt == 0 else None)
        check_after_kill(run, pool)
        index = pool.write_engine_data(rng)
        if index is not None:
            run.say(f"engine wrote into populated unit {index} after the kill")
    recorded = pool.recorded_bytes()
    was_ready = pool_state(pool.root, NAME).phase == "Ready"
    engine = None
    if (pool.dir / MANIFEST_NAME).exists() and not was_ready:
        # Killed after the manifest was written and before the record said Ready: the memory
        # is complete, so an engine may attach now — and the next provision must still finish.
        engine = attach(pool.dir)
        run.say("an engine attached between the kill and the next provision")
    try:
        out = cli("provision", *pool.flags(), "--json", check=False)
        run.check(
            "next provision succeeds (also with an engine attached to a complete pool)",
            out.returncode == 0,
            out.stderr[-2000:],
        )
    finally:
        if engine is not None:
            engine.close()
    check_converged(run, pool, json.loads(out.stdout), recorded, was_ready)

    for attempt in range(rng.randint(1, 2)):
        kill_release(run, rng, pool, processes, first_release_point if attempt == 0 else None)
    out = cli("release", NAME, "--root", str(pool.root), "--json")
    run.check("next release converges", json.loads(out.stdout)["forced"] is False)
    check_released(run, pool, hugepage_baseline)
