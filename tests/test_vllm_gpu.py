"""On a GPU: KV blocks move GPU <-> pool through vLLM 0.33.0's own worker (marked ``gpu``).

Deselected where no NVIDIA GPU exists (tests/conftest.py); hack/gpu-check.sh runs it with the
other gpu tests. The worker script (tests/vllm_workers/native_gpu.py) replaces nothing of vLLM:
offloadpool's spec is loaded by vLLM's factory, pins the pool with the cuda backend, and vLLM's
``CPUOffloadingWorker`` copies with its CUDA streams.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadpool.region.holding.lease import Lease
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.request import PoolRequest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SLOT = 256 << 10


def test_vllm_worker_stores_and_loads_blocks_through_the_pool(
    region_root: Path, tmp_path: Path, vllm_engine
) -> None:
    result = provision(
        PoolRequest(
            name="gpu",
            capacity=64 * SLOT,
            medium="Memory",
            layout_type="Interleaved",
            ranks=1,
            slot_bytes=SLOT,
        ),
        region_root,
    )
    # native_gpu.py needs no pod view of its own: the pool directory through its env var
    run = vllm_engine(
        "native_gpu.py",
        {"slot_bytes": SLOT},
        env={"OFFLOADPOOL_POOL_DIR": str(result.pool_dir)},
        namespace=False,
    )
    assert "error" not in run, run.get("traceback")
    assert (run["spec"], run["region"], run["pinned"], run["pin_backend"]) == (
        "OffloadPoolOffloadingSpec",
        "PoolRegion",
        True,
        "cuda",
    )
    assert run["pin_bytes"] == 64 * SLOT and run["vllm_registrations"] == 0
    assert run["stored"] == [True] and run["pool_equals_gpu"] is True
    assert run["loaded"] == [True] and run["gpu_round_trip"] is True
    Lease.exclusive(result.pool_dir).close()  # the worker's shutdown dropped the lease
