"""On a GPU: vLLM 0.33.0's own CPUOffloadingWorker moves KV blocks GPU <-> an offloadpool pool.

Run by the pinned vLLM environment's Python (tests/test_vllm_gpu.py, marked ``gpu``) with
``OFFLOADPOOL_POOL_DIR`` set. Nothing of vLLM is replaced: ``OffloadingSpecFactory`` loads
offloadpool's spec by ``spec_module_path``, ``create_worker`` attaches and pins the pool
(offloadpool's cuda backend) and builds vLLM's real worker with its CUDA streams; then
``submit_store`` copies two GPU blocks into pool chunks 0 and 3 and ``submit_load`` copies
them back into two other GPU blocks. Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def main() -> int:
    cfg = json.loads(sys.argv[1])
    report: dict[str, Any] = {}
    worker = None
    try:
        import torch
        import vllm.v1.kv_offload.cpu.gpu_worker as gpu_worker
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
        )
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        registrations: list[int] = []
        original = gpu_worker.host_register
        gpu_worker.host_register = lambda ptr, n: (registrations.append(n), original(ptr, n))[1]

        slot = cfg["slot_bytes"]
        config = OffloadingConfig(
            groups=(),
            worker_kv_bytes_per_block=slot,
            enable_kv_cache_events=False,
            extra_config={
                "spec_name": "OffloadPoolOffloadingSpec",
                "spec_module_path": "offloadpool.vllm.spec",
                "pin_backend": "cuda",
            },
            engine_id="gpu-check",
            model=OffloadingModelConfig(name="test-model", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=1,
                tp_size=1,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=True,
            ),
        )
        torch.cuda.set_device(0)
        gpu = torch.randint(-128, 127, (8, slot), dtype=torch.int8, device="cuda")
        kv = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=gpu, page_size_bytes=slot)],
            group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=slot)]],
        )
        spec = OffloadingSpecFactory.create_spec(config)
        worker = spec.get_worker(kv)
        region = worker._mmap_region
        report.update(
            spec=type(spec).__name__,
            region=type(region).__name__,
            pinned=region.is_pinned,
            pin_backend=region.pin_stats.backend,
            pin_bytes=region.pin_stats.bytes_registered,
            vllm_registrations=len(registrations),
        )
        assert worker.submit_store(
            1, GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0]), CPULoadStoreSpec([0, 3])
        )
        worker.wait({1})
        stored = [r.success for r in worker.get_finished()]
        base = region.base_tensor
        row = region._row_stride
        report["stored"] = stored
        report["pool_equals_gpu"] = bool(
            torch.equal(base[0:slot], gpu[1].cpu())
            and torch.equal(base[3 * row : 3 * row + slot], gpu[2].cpu())
        )
        assert worker.submit_load(
            2, CPULoadStoreSpec([0, 3]), GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0])
        )
        worker.wait({2})
        report["loaded"] = [r.success for r in worker.get_finished()]
        torch.cuda.synchronize()
        report["gpu_round_trip"] = bool(torch.equal(gpu[5], gpu[1]) and torch.equal(gpu[6], gpu[2]))
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if worker is not None:
            worker.shutdown()  # region.cleanup(): unpin, unmap, lease dropped
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
