"""offloadpool's native vLLM spec, loaded and driven by vLLM 0.33.0's own code.

Each test provisions a real pool with the node engine, then starts TP-N offload workers with
the pinned vLLM (tests/vllm_workers/native_engine.py): vLLM's ``OffloadingSpecFactory`` loads
``offloadpool.vllm.spec`` by ``spec_module_path``/``spec_name``, each worker's
``create_worker`` attaches the pool (seen through a recursive bind mount, as a pod sees it)
and vLLM's own view code lays its tensors over it. What is checked: the tier's size comes
from the pool; vLLM's views land on each rank's slots; writes cross processes; offloadpool
registers exactly this rank's slots once and vLLM's ``pin_mmap_region`` registers nothing;
the lease is held while attached and free after; the pool's files are untouched; a pool that
cannot serve the engine fails every worker at start with one message naming a fitting spec.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.lifecycle.provision import ProvisionResult, provision
from offloadpool.region.request import PoolRequest

pytestmark = pytest.mark.vllm

KiB, MiB = 1 << 10, 1 << 20
REPO = Path(__file__).resolve().parents[1]
SLOT = 256 * KiB  # one rank's KV bytes per block


def make_pool(
    root: Path,
    name: str,
    capacity: int,
    *,
    layout: str = "Interleaved",
    ranks: int = 2,
    slot: int | None = SLOT,
    medium: str = "Memory",
    **more: Any,
) -> ProvisionResult:
    return provision(
        PoolRequest(
            name=name,
            capacity=capacity,
            medium=medium,
            layout_type=layout,
            ranks=ranks,
            slot_bytes=slot,
            **more,
        ),
        root,
    )


def files_of(result: ProvisionResult) -> list[tuple[int, int]]:
    return [
        (os.stat(result.pool_dir / s.file).st_ino, os.stat(result.pool_dir / s.file).st_size)
        for region in result.manifest.regions
        for s in region.segments
    ]


def byte_at(result: ProvisionResult, offset: int, region: int = 0) -> int:
    for seg in result.manifest.regions[region].segments:
        if seg.offset <= offset < seg.offset + seg.bytes:
            with open(result.pool_dir / seg.file, "rb") as fh:
                fh.seek(offset - seg.offset)
                return fh.read(1)[0]
    raise IndexError(offset)


def run_native(
    vllm_engine, tmp_path: Path, result: ProvisionResult, world: int, **cfg: Any
) -> dict[str, Any]:
    pod_root = tmp_path / f"pod-{world}"
    pod_root.mkdir()
    return vllm_engine(
        "native_engine.py",
        {
            "pool_dir": str(result.pool_dir),
            "pod_root": str(pod_root),
            "world_size": world,
            "worker_kv_bytes_per_block": SLOT,
            **cfg,
        },
    )


@pytest.mark.parametrize("world", [2, 4])
def test_tp_workers_attach_the_pool_through_vllms_spec_factory(
    region_root: Path, tmp_path: Path, vllm_engine, world: int
) -> None:
    capacity = 32 * world * SLOT  # 32 rows of world slots
    result = make_pool(region_root, f"tp{world}", capacity, ranks=world)
    before = files_of(result)
    run = run_native(vllm_engine, tmp_path, result, world)
    assert run["lease_while_attached"] == "held" and run["lease_after_exit"] == "free"
    row = world * SLOT
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        r = w["rank"]
        assert w["spec"] == "offloadpool.vllm.spec.OffloadPoolOffloadingSpec"
        assert w["cpu_bytes_to_use"] == capacity  # derived from the pool
        assert (w["num_chunks"], w["row_bytes"], w["slot_bytes"]) == (32, row, SLOT)
        assert w["region"] == "PoolRegion" and w["pinned"] is True
        # vLLM's own views over the pool: this rank's slot of every row, in two tensors
        assert w["views"] == [
            [[32, SLOT // 2], [row, 1], r * SLOT],
            [[32, SLOT // 2], [row, 1], r * SLOT + SLOT // 2],
        ]
        # exactly one registration path: offloadpool's, of this rank's slots only
        assert w["offloadpool_pin"]["bytes"] == 32 * SLOT and w["offloadpool_pin"]["backend"] == "mlock"
        assert w["vmlck"] == 32 * SLOT  # the kernel's count: this worker's slots, nothing else
        assert w["vllm_registrations"] == 0 and w["vllm_pinned_addresses"] == 0
        assert w["seen"] == [[0x40 + q, 0x60 + q] for q in range(world)]  # every rank's writes
    assert files_of(result) == before  # nothing created, truncated or unlinked
    last = 31 * row
    assert [byte_at(result, q * SLOT) for q in range(world)] == [0x40 + q for q in range(world)]
    assert [byte_at(result, last + q * SLOT + SLOT - 1) for q in range(world)] == [
        0x60 + q for q in range(world)
    ]


def test_replicated_mla_tier_shares_one_copy_per_row(region_root: Path, tmp_path: Path, vllm_engine) -> None:
    """vLLM's replicated (MLA) layout keeps one copy: a Replicated pool in vLLM's rows."""
    result = make_pool(region_root, "mla", 32 * SLOT, layout="Replicated", ranks=1, slot=SLOT)
    run = run_native(vllm_engine, tmp_path, result, 2, replicated_layout=True)
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert (w["num_chunks"], w["row_bytes"], w["slot_bytes"]) == (32, SLOT, SLOT)
        assert [v[2] for v in w["views"]] == [0, SLOT // 2]  # every worker: rank 0's slot, the row
        assert w["offloadpool_pin"]["bytes"] == 32 * SLOT and w["vllm_registrations"] == 0
        assert w["vmlck"] == 32 * SLOT
        assert len(w["seen"]) == 1 and w["seen"][0][0] in (0x40, 0x41)  # one copy, both ranks write it
    assert run["lease_after_exit"] == "free"


def test_data_parallel_replicas_each_attach_their_own_pool(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    """DP-2 × TP-2 in one pod (docs/vllm.md): ``pool_dir`` with ``{dp}`` sends replica i's workers
    to pool ``kv-dp<i>``; each replica's writes land in its own pool only, each pool's lease is
    held while its replica runs and free after."""
    pools = [make_pool(region_root, f"kv-dp{i}", 32 * 2 * SLOT, ranks=2) for i in range(2)]
    before = [files_of(p) for p in pools]
    pod_root = tmp_path / "pod-dp"
    pod_root.mkdir()
    run = vllm_engine(
        "native_engine.py",
        {
            "pool_dirs": [str(p.pool_dir) for p in pools],
            "pod_root": str(pod_root),
            "world_size": 2,
            "dp_size": 2,
            "worker_kv_bytes_per_block": SLOT,
            "extra_config": {"pool_dir": f"{pod_root}/offloadpool/kv-dp{{dp}}"},
        },
    )
    assert run["leases_while_attached"] == ["held", "held"] and run["leases_after_exit"] == ["free", "free"]
    assert [(w["dp"], w["rank"]) for w in run["workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        dp = w["dp"]
        assert w["pool_dir"] == f"{pod_root}/offloadpool/kv-dp{dp}"
        assert w["cpu_bytes_to_use"] == 32 * 2 * SLOT and w["offloadpool_pin"]["bytes"] == 32 * SLOT
        assert w["seen"] == [[0x40 + 0x10 * dp + q, 0x60 + 0x10 * dp + q] for q in range(2)]
    for i, pool in enumerate(pools):
        assert files_of(pool) == before[i]
        assert [byte_at(pool, q * SLOT) for q in range(2)] == [0x40 + 0x10 * i + q for q in range(2)]
        assert [byte_at(pool, 31 * 2 * SLOT + q * SLOT + SLOT - 1) for q in range(2)] == [
            0x60 + 0x10 * i + q for q in range(2)
        ]


PAGE = 4096


def model(
    world: int,
    *,
    layers: int,
    kv_heads: int = 0,
    head_dim: int = 128,
    latent: int = 0,
    block: int = 16,
    dtype: str = "bfloat16",
    blocks_per_chunk: int = 1,
) -> dict[str, Any]:
    """One engine: a model's per-worker KV bytes per block, as vLLM computes them.

    GQA: K and V of this worker's ``kv_heads / world`` heads; MLA (``latent``: kv_lora_rank +
    rope dim): one latent per token, the same on every worker, under vLLM's replicated layout."""
    size = {"bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "float32": 4}[dtype]
    if latent:
        per_block = layers * latent * block * size
    else:
        per_block = layers * 2 * max(kv_heads // world, 1) * head_dim * block * size
    return {
        "world_size": world,
        "worker_kv_bytes_per_block": per_block,
        "blocks_per_chunk": blocks_per_chunk,
        "dtype": dtype,
        "replicated_layout": bool(latent),
    }


#: Engines one node might serve one after another: TP 1/2/4/8, GQA and MLA, block sizes 16/32/64,
#: bf16/fp8/fp32, 1 or 2 blocks per chunk, and a row vLLM pads to 4 KiB (head_dim 80, TP 2).
ENGINES = [
    model(1, layers=4, kv_heads=8),
    model(2, layers=4, kv_heads=8, dtype="float32", block=32),
    model(4, layers=4, kv_heads=8, block=32, dtype="fp8_e4m3"),
    model(8, layers=4, kv_heads=8, blocks_per_chunk=2),
    model(2, layers=1, kv_heads=2, head_dim=80),  # 5120-byte slots, 10240-byte rows padded to 12 KiB
    model(4, layers=3, latent=576),  # MLA, 55296-byte rows padded to 56 KiB
    model(8, layers=2, latent=576, block=64, dtype="fp8_e4m3"),
]


def own_pages(rows: int, row: int, offset: int, slot: int) -> int:
    """The bytes of the pages a worker's slots touch: what it must page-lock, and no more."""
    if slot > row - PAGE:  # the #59544 rule: slots a page short of the row pin whole rows
        return -(-rows * row // PAGE) * PAGE
    pages = set()
    for r in range(rows):
        start = r * row + offset
        pages.update(range(start // PAGE, -(-(start + slot) // PAGE)))
    return len(pages) * PAGE


@pytest.mark.parametrize(
    "layout",
    [
        dict(layout="Replicated", ranks=1, slot=None),  # a flat pool: memory only
        dict(layout="Interleaved", ranks=3, slot=320 * KiB),  # made for a model none of these is
    ],
    ids=["flat", "interleaved-other-model"],
)
def test_one_pool_serves_every_engine_in_turn_each_worker_locking_its_own_bytes(
    region_root: Path, tmp_path: Path, vllm_engine, layout: dict[str, Any]
) -> None:
    """Provisioned once, the pool serves TP 1-8, GQA and MLA, several block sizes and dtypes one
    after another: no refusal, no re-provisioning, the tier is as many of each engine's rows
    as fit, and every worker page-locks exactly the pages of its own data (VmLck)."""
    capacity = 50 * 3 * 320 * KiB
    result = make_pool(region_root, "any", capacity, **layout)
    before, generation = files_of(result), result.manifest.generation
    pod_root = tmp_path / "pod-any"
    pod_root.mkdir()
    run = vllm_engine(
        "native_engine.py",
        {"pool_dir": str(result.pool_dir), "pod_root": str(pod_root), "engines": ENGINES},
        timeout=600,
    )
    assert len(run["engines"]) == len(ENGINES)
    for engine, got in zip(ENGINES, run["engines"], strict=True):
        world, replicated = engine["world_size"], engine["replicated_layout"]
        slot = engine["worker_kv_bytes_per_block"] * engine["blocks_per_chunk"]
        row = -(-(slot if replicated else world * slot) // PAGE) * PAGE  # vLLM pads rows to 4 KiB
        rows = capacity // row
        assert [w.get("error") for w in got["workers"]] == [None] * world, (engine, got["workers"][0])
        assert got["lease_while_attached"] == "held" and got["lease_after_exit"] == "free"
        assert len(got["workers"]) == world
        for w in got["workers"]:
            assert "error" not in w, (engine, w.get("traceback"))
            r, offset = w["rank"], 0 if replicated else w["rank"] * slot
            assert (w["num_chunks"], w["row_bytes"], w["slot_bytes"]) == (rows, row, slot), engine
            assert w["cpu_bytes_to_use"] == capacity and w["attached_rank"] == 0
            half = engine["worker_kv_bytes_per_block"] // 2 * engine["blocks_per_chunk"]
            assert w["views"][0] == [[rows, half], [row, 1], offset]
            assert w["vllm_registrations"] == 0
            assert w["vmlck"] == own_pages(rows, row, offset, slot), (engine, r)
            if replicated:
                assert w["offloadpool_pin"]["bytes"] == rows * row
            else:
                assert w["seen"] == [[0x40 + q, 0x60 + q] for q in range(world)]
    assert files_of(result) == before  # one pool, never re-made
    assert load_manifest(result.pool_dir).generation == generation


def test_a_per_rank_pool_gives_each_tp4_worker_its_own_regions_files_pinned_contiguously(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    """PerRank TP-4 (#59547): worker r maps region r's files and no other, vLLM's views over it
    are rows of its slot at offset 0, it locks its region's rows and nothing else, its writes
    land at the start of region r."""
    region = 16 * MiB
    result = make_pool(
        region_root, "perrank", 4 * region, layout="PerRank", ranks=4, slot=None, min_segment=4 * MiB
    )
    regions = result.manifest.regions
    assert all(len(r.segments) == 4 for r in regions)  # several files per region
    engine = model(4, layers=4, kv_heads=8, head_dim=96)  # 48 KiB slots: 341 of them per 16 MiB region
    slot = engine["worker_kv_bytes_per_block"]
    rows = region // slot
    pod_root = tmp_path / "pod-perrank"
    pod_root.mkdir()
    run = vllm_engine(
        "native_engine.py", {"pool_dir": str(result.pool_dir), "pod_root": str(pod_root), **engine}
    )
    assert run["lease_while_attached"] == "held" and run["lease_after_exit"] == "free"
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        r = w["rank"]
        assert w["attached_rank"] == r and w["num_chunks"] == rows and w["slot_bytes"] == slot
        assert w["views"] == [[[rows, slot // 2], [slot, 1], 0], [[rows, slot // 2], [slot, 1], slot // 2]]
        assert w["mapped"] == sorted(f"{run['pod_dir']}/{s.file}" for s in regions[r].segments)
        assert w["vmlck"] == -(-rows * slot // PAGE) * PAGE  # its own rows: the whole region it uses
        assert w["offloadpool_pin"]["bytes"] == rows * slot
        assert w["seen"] == [[0x40 + r, 0x60 + r]]  # rank 0 inside its own region
    for r in range(4):
        assert byte_at(result, 0, region=r) == 0x40 + r
        assert byte_at(result, (rows - 1) * slot + slot - 1, region=r) == 0x60 + r


def test_a_per_rank_pool_of_other_ranks_fails_every_worker_naming_both_numbers(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    result = make_pool(region_root, "four", 4 * 4 * MiB, layout="PerRank", ranks=4, slot=None)
    run = run_native(vllm_engine, tmp_path, result, 2)
    for w in run["workers"]:
        assert w["error"] == (
            f"PoolMismatch: pool 'four' at {run['pod_dir']} is laid out PerRank for 4 ranks (one "
            f"region per worker), the engine has 2 workers: use a PerRank pool of 2 ranks, or an "
            f"Interleaved or Replicated pool (any engine fits those)"
        )
        assert "vmlck" not in w  # refused before anything was mapped
    assert run["lease_after_exit"] == "free"


def test_a_tier_larger_than_the_pool_fails_with_both_numbers(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    result = make_pool(region_root, "small", 32 * 2 * SLOT, ranks=2)
    run = run_native(vllm_engine, tmp_path, result, 2, extra_config={"cpu_bytes_to_use": 64 * 2 * SLOT})
    for w in run["workers"]:
        assert w["error"] == (
            f"PoolMismatch: pool 'small' at {run['pod_dir']} holds {32 * 2 * SLOT} bytes (32 of vLLM's "
            f"{2 * SLOT}-byte rows), cpu_bytes_to_use asks for 64 ({64 * 2 * SLOT} bytes): lower "
            f"cpu_bytes_to_use, or leave it out and the tier is the pool"
        ), w


def example_docs(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((REPO / "examples" / "vllm" / name).read_text()))


def kv_transfer_config(container: dict[str, Any]) -> dict[str, Any]:
    (arg,) = [a for a in container["args"] if a.startswith("--kv-transfer-config=")]
    return json.loads(arg.split("=", 1)[1])


def test_the_native_example_deployment_runs_on_its_pool_scaled_down(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    """examples/vllm/deployment-native-tp4.yaml: its --kv-transfer-config, loaded by vLLM, on its
    pool's layout scaled down to 4 × 16 MiB. The pool carries no model arithmetic: vLLM's own
    numbers for Llama-3.1-70B at TP4 (80 layers, 2 of 8 KV heads per rank, 16-token fp16 blocks:
    1280 KiB per rank per block) decide the tier."""
    pool_doc, deployment = example_docs("deployment-native-tp4.yaml")
    layout = pool_doc["spec"]["layout"]
    assert set(layout) == {"type", "ranks"}  # memory and ranks, nothing of a model
    ranks = layout["ranks"]
    config = kv_transfer_config(deployment["spec"]["template"]["spec"]["containers"][0])
    assert config["kv_connector"] == "OffloadingConnector"
    assert "cpu_bytes_to_use" not in config["kv_connector_extra_config"]
    region = 16 * MiB
    result = make_pool(region_root, "example", ranks * region, layout=layout["type"], ranks=ranks, slot=None)
    pod_root = tmp_path / "pod-example"
    pod_root.mkdir()
    slot = 16 * 2 * 80 * 2 * 128 * 2
    run = vllm_engine(
        "native_engine.py",
        {
            "pool_dir": str(result.pool_dir),
            "pod_root": str(pod_root),
            "world_size": ranks,
            "worker_kv_bytes_per_block": slot,
            "extra_config": config["kv_connector_extra_config"],
        },
    )
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert w["spec"] == "offloadpool.vllm.spec.OffloadPoolOffloadingSpec"
        assert (w["num_chunks"], w["attached_rank"]) == (region // slot, w["rank"])
    assert run["lease_after_exit"] == "free"


def test_two_engines_on_one_node_get_separate_shares_and_never_see_each_others_bytes(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    """A pool of 2 shares, provisioned once, serves a TP-2 and a TP-1 engine of different models
    at the same time, each its own pod (``OFFLOADPOOL_POD_UID``): each engine's tier is one
    share, its workers claim a different share and map only that share's files, and what each
    writes through vLLM's views lands in its share alone; the other share keeps its bytes. A
    third pod's engine while both are held is refused naming both holders."""
    share = 16 * MiB
    result = make_pool(
        region_root, "shared", 2 * share, layout="Replicated", ranks=1, slot=None, partitions=2
    )
    head = result.manifest
    assert head.shares == 2
    files = {i: [s.file for s in head.regions[i].segments] for i in range(2)}
    fill = 0xAA  # the pool's bytes before any engine: what nobody wrote
    for name in files[0] + files[1]:
        with open(result.pool_dir / name, "r+b") as fh:  # in place: the provisioned pages
            fh.write(bytes([fill]) * os.fstat(fh.fileno()).st_size)
    engines = [
        {**model(2, layers=4, kv_heads=8), "pod_uid": "pod-a-uid", "engine_id": "a"},
        {**model(1, layers=2, kv_heads=8, head_dim=80), "pod_uid": "pod-b-uid", "engine_id": "b"},
    ]
    pod_root = tmp_path / "pod-shares"
    pod_root.mkdir()
    run = vllm_engine(
        "native_engine.py",
        {
            "pool_dir": str(result.pool_dir),
            "pod_root": str(pod_root),
            "together": engines,
            "report_values": True,
            "refused": {**model(1, layers=1, kv_heads=8), "pod_uid": "pod-c-uid", "engine_id": "c"},
        },
    )
    pod_dir = run["pod_dir"]
    got_shares = []
    markers: dict[int, dict[int, int]] = {}  # share -> {offset: byte} its engine wrote
    for k, (engine, workers) in enumerate(zip(engines, run["together"], strict=True)):
        world, slot = engine["world_size"], engine["worker_kv_bytes_per_block"]
        row = -(-world * slot // PAGE) * PAGE
        rows = share // row
        assert len(workers) == world
        for w in workers:
            assert "error" not in w, (engine, w.get("traceback"))
            assert w["cpu_bytes_to_use"] == share  # the tier is one share, not the pool
            assert (w["num_chunks"], w["row_bytes"], w["slot_bytes"]) == (rows, row, slot)
        (mine,) = {w["share"] for w in workers}  # one share per engine, all its workers
        got_shares.append(mine)
        own = {0x40 + 0x10 * k + r for r in range(world)} | {0x60 + 0x10 * k + r for r in range(world)}
        for w in workers:
            assert w["mapped"] == sorted(f"{pod_dir}/{f}" for f in files[mine]), (k, w["rank"])
            assert w["values"] == sorted(own | {fill}), (k, w["rank"])  # its writes and no one else's
            assert w["vmlck"] == own_pages(rows, row, w["rank"] * slot, slot)
        markers[mine] = {
            i * row + r * slot + end: (0x40 if end == 0 else 0x60) + 0x10 * k + r
            for i in range(rows)
            for r in range(world)
            for end in (0, slot - 1)
        }
    assert sorted(got_shares) == [0, 1]
    for i in range(2):  # each share's file holds its engine's writes, the rest untouched
        data = b"".join((result.pool_dir / f).read_bytes() for f in files[i])
        changed = {o: b for o, b in enumerate(data) if b != fill}
        assert changed == markers[i], i
    (third,) = run["refused"]["workers"]
    holders = {got_shares[k]: f"'pod-{'ab'[k]}-uid'" for k in range(2)}
    assert re.fullmatch(
        re.escape(f"AttachError: no free share in pool {pod_dir!r} for 'pod-c-uid': ")
        + re.escape(f"share 0 by {holders[0]} (pid ")
        + r"\d+\); "
        + re.escape(f"share 1 by {holders[1]} (pid ")
        + r"\d+\) "
        + re.escape("(2 shares; a share is freed when every process of its engine has exited)"),
        third["error"],
    ), third
    assert "vmlck" not in third  # refused before anything was mapped
