"""Stock vLLM 0.33.0 adopts a compat pool made by the node engine — proven with vLLM's own code.

Each test provisions a real pool (``offloadpool.region.lifecycle.provision``: tmpfs mount, files,
pre-fault) with ``compat.vllm``, then starts a TP-N engine's offload workers with the pinned
vLLM (tests/vllm_workers/stock_engine.py): forked workers in a private mount namespace whose
/dev/shm is the pod's own tmpfs with the pool's files bind-mounted where the admission webhook
mounts them (``offloadpool.api.pods.compat_files``). vLLM decides everything itself: names,
file split, create or join, mapping, populate, pin, unlink.

Adoption means: vLLM creates nothing (the pod's /dev/shm stays empty), truncates and unlinks
nothing (the pool's files keep inode and size), takes no new memory (the pool's tmpfs usage is
unchanged), sees the data written before it started, and its writes reach the pool. The
mismatches show what each wrong setting does, as vLLM reports it (or does not).
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from offloadpool.api import OffloadPool
from offloadpool.api import pool_request as request_from_pool
from offloadpool.api.pods import compat_files
from offloadpool.region.files import vllm_compat
from offloadpool.region.files.planner import plan
from offloadpool.region.holding import engine_id_mismatch, holders
from offloadpool.region.lifecycle.provision import ProvisionResult, provision
from offloadpool.region.request import PoolRequest

pytestmark = pytest.mark.vllm

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[1]
#: TP-2 with 256 KiB of KV per rank per block: vLLM's row (kv_bytes_per_chunk) is 512 KiB.
TP, RANK_BLOCK = 2, 256 * KiB
ROW = TP * RANK_BLOCK


def make_pool(
    root: Path,
    name: str,
    capacity: int,
    engine_id: str,
    *,
    row: int | None = ROW,
    segments: int = 32,
    medium: str = "MemoryTHP",
) -> ProvisionResult:
    req = PoolRequest(
        name=name,
        capacity=capacity,
        medium=medium,
        compat_engine_id=engine_id,
        compat_row_bytes=row,
        compat_segments=segments,
    )
    return provision(req, root)


def pool_files(result: ProvisionResult) -> list[Path]:
    return [result.pool_dir / s.file for s in result.manifest.regions[0].segments]


def pool_usage(result: ProvisionResult) -> int:
    st = os.statvfs(result.pool_dir / "mnt")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def identity(files: list[Path]) -> list[tuple[int, int, int]]:
    return [(os.stat(f).st_ino, os.stat(f).st_size, os.stat(f).st_nlink) for f in files]


def write_bytes(result: ProvisionResult, marks: dict[int, int]) -> None:
    """Write a byte at each region offset through the pool's own segment files."""
    for seg in result.manifest.regions[0].segments:
        fd = os.open(result.pool_dir / seg.file, os.O_RDWR)
        try:
            with mmap.mmap(fd, seg.bytes) as m:
                for offset, value in marks.items():
                    if seg.offset <= offset < seg.offset + seg.bytes:
                        m[offset - seg.offset] = value
        finally:
            os.close(fd)


def read_bytes(result: ProvisionResult, offsets: list[int]) -> list[int]:
    out = {}
    for seg in result.manifest.regions[0].segments:
        with open(result.pool_dir / seg.file, "rb") as fh:
            for offset in offsets:
                if seg.offset <= offset < seg.offset + seg.bytes:
                    fh.seek(offset - seg.offset)
                    out[offset] = fh.read(1)[0]
    return [out[o] for o in offsets]


def engine_config(
    result: ProvisionResult,
    engine_id: str,
    *,
    pool_engine_id: str | None = None,
    cpu_bytes: int | None = None,
    read_offsets: list[int] = (),
    **extra: Any,
) -> dict[str, Any]:
    """What the pod's engine runs with: the webhook's file mounts for the pool's engine id, and
    vLLM's own settings (engine id, cpu_bytes_to_use, the model's KV bytes per block)."""
    files = compat_files(pool_engine_id or engine_id, len(pool_files(result)))
    return {
        "mounts": [[str(result.pool_dir / host), pod] for host, pod in files],
        "shm_size": result.manifest.total_bytes + 64 * MiB,
        "engine_id": engine_id,
        "world_size": TP,
        "worker_kv_bytes_per_block": RANK_BLOCK,
        "cpu_bytes_to_use": cpu_bytes or result.manifest.total_bytes,
        "read_offsets": list(read_offsets),
        **extra,
    }


def assert_adopted(
    result: ProvisionResult,
    run: dict[str, Any],
    before: list[tuple[int, int, int]],
    usage: int,
    marks: dict[int, int],
) -> None:
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert w["shm_attached"]["used_bytes"] < MiB, "vLLM made memory of its own in the pod's /dev/shm"
        assert w["creator_at_cleanup"] is False
        assert {int(k): v for k, v in w["read"].items()} == marks, "data written before vLLM started"
        assert w["seen_markers"] == [0x40 + r for r in range(TP)], "each rank's write, seen by every rank"
    assert identity(pool_files(result)) == before, "a pool file was replaced, truncated or unlinked"
    assert pool_usage(result) == usage, "vLLM's populate took memory the pool did not already hold"
    # vLLM's writes are in the pool: rank r's marker at row 0, slot r (and the last row)
    last_row = (result.manifest.total_bytes // ROW - 1) * ROW
    assert read_bytes(result, [r * RANK_BLOCK for r in range(TP)]) == [0x40 + r for r in range(TP)]
    assert read_bytes(result, [last_row + r * RANK_BLOCK for r in range(TP)]) == [0x40 + r for r in range(TP)]


def run_held(
    vllm_engine, cfg: dict[str, Any], hold_dir: Path, look: Callable[[], Any]
) -> tuple[dict[str, Any], list[int], Any]:
    """Run the engine; while every worker is attached, ``look()`` at it from the host (the node
    agent's view: the host's /proc); then let it finish. Returns the run, the workers' pids and
    what ``look`` saw."""
    hold_dir.mkdir()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(vllm_engine, "stock_engine.py", {**cfg, "hold_dir": str(hold_dir)})
        try:
            deadline = time.monotonic() + 240
            while len(list(hold_dir.glob("ready.*"))) < TP and not running.done():
                assert time.monotonic() < deadline, "the engine's workers never attached"
                time.sleep(0.1)
            pids = sorted(int(p.read_text()) for p in hold_dir.glob("ready.*"))
            seen = look()
        finally:
            (hold_dir / "go").touch()
        return running.result(), pids, seen


def test_stock_vllm_adopts_a_one_file_pool(region_root: Path, vllm_engine, tmp_path: Path) -> None:
    """Also: the attached engine is seen from the host as a holder, and not as a mismatch."""
    result = make_pool(region_root, "one", 256 * MiB, "llama-tp2")
    assert len(pool_files(result)) == 1
    marks = {1: 0x11, 128 * MiB + 3: 0x22, 256 * MiB - 1: 0x33}
    write_bytes(result, marks)
    before, usage = identity(pool_files(result)), pool_usage(result)
    run, pids, (held_by, mismatches) = run_held(
        vllm_engine,
        engine_config(result, "llama-tp2", read_offsets=list(marks)),
        tmp_path / "hold",
        lambda: (holders.find_holders(result.pool_dir), engine_id_mismatch.find(result.pool_dir)),
    )
    assert len(pids) == TP and {h.pid for h in held_by if h.mapped} >= set(pids), held_by
    assert mismatches == []
    assert [w["segments"] for w in run["workers"]] == [
        [["/dev/shm/vllm_offload_llama-tp2.mmap", 0, 256 * MiB]]
    ] * TP
    assert_adopted(result, run, before, usage, marks)


def test_stock_vllm_adopts_a_multi_file_pool_split_on_its_rows(region_root: Path, vllm_engine) -> None:
    """2 GiB with CPUOffloadingSpec's 32 segments: vLLM maps min(32, 2) files of whole rows."""
    result = make_pool(region_root, "multi", 2 * GiB, "llama-tp2")
    files = pool_files(result)
    assert len(files) == 2
    marks = {0: 0x11, GiB - 1: 0x22, GiB: 0x33, 2 * GiB - 1: 0x44}  # each side of the file boundary
    write_bytes(result, marks)
    before, usage = identity(files), pool_usage(result)
    run = vllm_engine("stock_engine.py", engine_config(result, "llama-tp2", read_offsets=list(marks)))
    planned = [
        [pod, seg.offset, seg.bytes]
        for (_, pod), seg in zip(
            compat_files("llama-tp2", 2), result.manifest.regions[0].segments, strict=True
        )
    ]
    assert all(w["segments"] == planned for w in run["workers"]), run["workers"][0].get("segments")
    assert_adopted(result, run, before, usage, marks)


def test_a_pool_in_one_file_where_vllm_wants_several_fails_on_the_second_file(
    region_root: Path, vllm_engine
) -> None:
    """A compat pool of 2 GiB or more in one file where stock vLLM splits its region
    (numSegments 1 is TieringOffloadingSpec's; CPUOffloadingSpec wants 32)."""
    result = make_pool(region_root, "onefile", 2 * GiB, "llama-tp2", row=None, segments=1)
    before, usage = identity(pool_files(result)), pool_usage(result)
    run = vllm_engine("stock_engine.py", engine_config(result, "llama-tp2"))
    for w in run["workers"]:
        assert (
            w["error"] == "FileNotFoundError: [Errno 2] No such file or directory: "
            "'/dev/shm/vllm_offload_llama-tp2.mmap.1'"
        ), w.get("traceback")
    assert identity(pool_files(result)) == before and pool_usage(result) == usage


def test_an_engine_id_that_differs_makes_vllm_silently_build_its_own_region(
    region_root: Path, vllm_engine, tmp_path: Path
) -> None:
    """Data parallelism appends _dp<rank> to kv_transfer_config.engine_id: a pool named for the
    bare id is not found, and vLLM creates, pre-faults and unlinks a region of its own in the
    pod's /dev/shm — no error from vLLM, the node's memory spent twice. The node side sees it
    from the host while the engine runs: each worker, by pid, with the id it uses."""
    result = make_pool(region_root, "dp", 64 * MiB, "llama")
    before, usage = identity(pool_files(result)), pool_usage(result)
    run, pids, found = run_held(
        vllm_engine,
        engine_config(result, "llama_dp0", pool_engine_id="llama"),
        tmp_path / "hold",
        lambda: engine_id_mismatch.find(result.pool_dir),
    )
    assert len(pids) == TP and sorted((m.pid, m.engine_id) for m in found) == [(p, "llama_dp0") for p in pids]
    message = engine_id_mismatch.describe(found, "llama")
    assert f"pid {pids[0]} " in message and 'engine_id "llama_dp0"' in message
    assert 'compat.vllm.engineId is "llama"' in message
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert w["mmap_path"] == "/dev/shm/vllm_offload_llama_dp0.mmap"
        # vLLM's own region, in the pod's memory: at least this rank's populated slots
        assert w["shm_attached"]["used_bytes"] >= 64 * MiB // TP
        assert "vllm_offload_llama_dp0.mmap" not in w["shm_attached"]["files"]  # unlinked after the barrier
    assert identity(pool_files(result)) == before and pool_usage(result) == usage
    assert read_bytes(result, [0, RANK_BLOCK]) == [0, 0], "the pool was never written"


def test_a_region_larger_than_the_pool_times_out_after_30_s(region_root: Path, vllm_engine) -> None:
    result = make_pool(region_root, "small", 64 * MiB, "llama-tp2")
    before, usage = identity(pool_files(result)), pool_usage(result)
    run = vllm_engine("stock_engine.py", engine_config(result, "llama-tp2", cpu_bytes=66 * MiB))
    for w in run["workers"]:
        assert w["error"] == f"TimeoutError: Timed out waiting for mmap file to reach {66 * MiB} bytes", (
            w.get("traceback")
        )
    assert identity(pool_files(result)) == before and pool_usage(result) == usage


def test_the_stock_example_pod_names_its_pools_region() -> None:
    """examples/vllm/deployment-stock-compat.yaml passes the engine id and size of examples/vllm-compat.yaml,
    whose file split the node engine makes as vLLM would (31 files of whole 5Mi rows)."""
    (deployment,) = yaml.safe_load_all(
        (REPO / "examples" / "vllm" / "deployment-stock-compat.yaml").read_text()
    )
    assert deployment["kind"] == "Deployment" and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    (arg,) = [a for a in pod["spec"]["containers"][0]["args"] if a.startswith("--kv-transfer-config=")]
    config = json.loads(arg.split("=", 1)[1])
    pool = OffloadPool.model_validate(yaml.safe_load((REPO / "examples" / "vllm-compat.yaml").read_text()))
    vllm = pool.spec.compat.vllm
    assert config["kv_connector"] == "OffloadingConnector"
    assert config["engine_id"] == vllm.engine_id
    assert config["kv_connector_extra_config"]["cpu_bytes_to_use"] == pool.spec.capacity_bytes()
    sizes = [s.bytes for s in plan(request_from_pool(pool)).segments]
    assert sizes == vllm_compat.segment_sizes(pool.spec.capacity_bytes(), vllm.row_bytes(), vllm.num_segments)
    assert len(sizes) == pool.spec.vllm_compat_file_count() == 31


def test_stock_vllm_adopts_a_one_file_hugepages_pool(region_root: Path, vllm_engine) -> None:
    """hugetlbfs: vLLM maps one file with a plain mmap (the kernel aligns it to the huge page) and
    populates its 4 KiB-aligned slots of already-present huge pages."""
    result = make_pool(region_root, "huge", 64 * MiB, "llama-tp2", medium="HugePages-2Mi")
    marks = {5: 0x55, 64 * MiB - 1: 0x66}
    write_bytes(result, marks)
    before, usage = identity(pool_files(result)), pool_usage(result)
    run = vllm_engine("stock_engine.py", engine_config(result, "llama-tp2", read_offsets=list(marks)))
    assert_adopted(result, run, before, usage, marks)


def test_stock_vllm_cannot_map_several_hugetlbfs_files(region_root: Path, vllm_engine) -> None:
    """Why the node engine refuses a compat pool that vLLM would split on hugetlbfs: vLLM maps
    each file with MAP_FIXED into an anonymous reservation aligned to 4 KiB (2 MiB at best), and
    hugetlbfs refuses a 1 GiB-page mapping there. Shown on a plain 2-file HugePages-1Gi pool
    whose files are bind-mounted under vLLM's names (the engine would not make it a compat pool)."""
    result = provision(
        PoolRequest(name="g1", capacity=2 * GiB, medium="HugePages-1Gi", max_files=2), region_root
    )
    segs = result.manifest.regions[0].segments
    assert [s.bytes for s in segs] == vllm_compat.segment_sizes(2 * GiB, ROW, 32)  # vLLM's own split
    config = engine_config(result, "llama-tp2")
    config["mounts"] = [
        [str(result.pool_dir / s.file), f"/dev/shm/{name}"]
        for s, name in zip(segs, vllm_compat.file_names("llama-tp2", 2), strict=True)
    ]
    run = vllm_engine("stock_engine.py", config)
    einval = "OSError: [Errno 22] Failed to map /dev/shm/vllm_offload_llama-tp2.mmap"
    errors = [w.get("error") for w in run["workers"]]
    # A reservation lands 1 GiB-aligned by chance about once in 512 starts; then that worker maps
    # (and finds its peer gone at the next barrier).
    assert errors.count(einval) >= 1, run["workers"]
    assert all(e == einval or e is None or e.startswith("BrokenBarrierError") for e in errors), errors
