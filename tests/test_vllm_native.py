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
from pathlib import Path
from typing import Any

import pytest
import yaml

from offloadpool.api.quantity import parse_quantity
from offloadpool.region.provision import ProvisionResult, provision
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
) -> ProvisionResult:
    return provision(
        PoolRequest(
            name=name, capacity=capacity, medium=medium, layout_type=layout, ranks=ranks, slot_bytes=slot
        ),
        root,
    )


def files_of(result: ProvisionResult) -> list[tuple[int, int]]:
    return [
        (os.stat(result.pool_dir / s.file).st_ino, os.stat(result.pool_dir / s.file).st_size)
        for s in result.manifest.regions[0].segments
    ]


def byte_at(result: ProvisionResult, offset: int) -> int:
    for seg in result.manifest.regions[0].segments:
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


def test_a_pool_for_other_ranks_fails_every_worker_with_the_spec_that_fits(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    result = make_pool(region_root, "two", 32 * 2 * SLOT, ranks=2)
    run = run_native(vllm_engine, tmp_path, result, 4)
    for w in run["workers"]:
        assert w["error"] == (
            f"PoolMismatch: pool 'two' at {run['pod_dir']} is laid out for 2 ranks, the engine has 4 "
            f"workers; a pool that fits: spec: {{capacity: {32 * 2 * SLOT}, layout: {{type: Interleaved, "
            f"ranks: 4, slotSize: {SLOT}}}}}"
        )
    assert run["lease_after_exit"] == "free"


def test_a_tier_larger_than_the_pool_fails_with_both_numbers(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    result = make_pool(region_root, "small", 32 * 2 * SLOT, ranks=2)
    run = run_native(vllm_engine, tmp_path, result, 2, extra_config={"cpu_bytes_to_use": 64 * 2 * SLOT})
    for w in run["workers"]:
        assert w["error"].startswith(
            f"PoolMismatch: pool 'small' at {run['pod_dir']} holds {32 * 2 * SLOT} bytes, vLLM's CPU tier "
            f"needs {64 * 2 * SLOT} (64 rows of {2 * SLOT}); lower cpu_bytes_to_use or use a pool that fits"
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
    pool's layout (Llama-3.1-70B TP4: 1280Ki per rank per block) with 8 rows instead of 13104."""
    pool_doc, deployment = example_docs("deployment-native-tp4.yaml")
    layout = pool_doc["spec"]["layout"]
    slot = parse_quantity(layout["slotSize"])
    config = kv_transfer_config(deployment["spec"]["template"]["spec"]["containers"][0])
    assert config["kv_connector"] == "OffloadingConnector"
    result = make_pool(region_root, "example", 8 * layout["ranks"] * slot, ranks=layout["ranks"], slot=slot)
    pod_root = tmp_path / "pod-example"
    pod_root.mkdir()
    run = vllm_engine(
        "native_engine.py",
        {
            "pool_dir": str(result.pool_dir),
            "pod_root": str(pod_root),
            "world_size": layout["ranks"],
            "worker_kv_bytes_per_block": slot,
            "extra_config": config["kv_connector_extra_config"],
        },
    )
    for w in run["workers"]:
        assert "error" not in w, w.get("traceback")
        assert w["spec"] == "offloadpool.vllm.spec.OffloadPoolOffloadingSpec" and w["num_chunks"] == 8
    assert run["lease_after_exit"] == "free"
