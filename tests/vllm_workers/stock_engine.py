"""A stock vLLM 0.33.0 engine's KV offload workers, as they start in a pod on a compat pool.

Run by the pinned vLLM environment's Python (hack/vllm_env.py) inside
``unshare --mount --propagation private``, with the clone's ``agent/`` on PYTHONPATH:

    unshare --mount --propagation private <vllm python> stock_engine.py '<json>'

It builds the pod's view first: a private tmpfs on /dev/shm (the pod's own, as an emptyDir of
medium Memory gives it) with the pool's files bind-mounted where the admission webhook mounts
them (``/dev/shm/vllm_offload_<id>.mmap[.N]``). Then it forks ``world_size`` workers, and each
runs vLLM's own code, unmodified: ``OffloadingSpecFactory.create_spec`` (CPUOffloadingSpec by
default) and ``CPUOffloadingSpec.create_worker``, which builds vLLM's ``SharedOffloadRegion``
with the arguments vLLM itself computes; then ``pin_mmap_region`` and vLLM's worker views.

Only what needs a GPU or torch.distributed is replaced, in vLLM's module namespace: the
platform check that enables the shared region (``_uses_shared_region``), the gloo barrier
(``_all_workers_barrier``: a multiprocessing barrier across the forked workers), and the
CUDA-stream ``CPUOffloadingWorker`` (which receives the region: we keep it). Everything that
decides names, sizes, create-or-join, mapping, populate, pin and unlink is vLLM's.

Prints one JSON object: each worker's report and the pod's /dev/shm before and after.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from offloading_config import offloading_config


def shm_view() -> dict[str, Any]:
    """What the pod's /dev/shm holds: its own tmpfs usage and each file there."""
    st = os.statvfs("/dev/shm")
    files = {}
    for name in sorted(os.listdir("/dev/shm")):
        s = os.stat(os.path.join("/dev/shm", name))
        files[name] = {"size": s.st_size, "ino": s.st_ino, "dev": s.st_dev}
    return {"used_bytes": (st.f_blocks - st.f_bfree) * st.f_frsize, "files": files}


def make_pod_view(cfg: dict[str, Any]) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={cfg['shm_size']}", "pod-shm", "/dev/shm"], check=True
    )
    for host_path, pod_path in cfg["mounts"]:
        open(pod_path, "w").close()  # a hostPath File mount's target
        subprocess.run(["mount", "--bind", host_path, pod_path], check=True)


def stock_config(cfg: dict[str, Any], rank: int):
    """vLLM's own OffloadingConfig for stock vLLM's CPU offloading of ``cpu_bytes_to_use``."""
    extra = {"cpu_bytes_to_use": cfg["cpu_bytes_to_use"], **cfg.get("extra_config", {})}
    return offloading_config(cfg, rank, extra_config=extra, engine_id=cfg["engine_id"])


def hold(cfg: dict[str, Any], rank: int) -> None:
    """With ``hold_dir``: stay attached (mapped, pinned) until the test has looked at the engine
    from the host, as the node agent does while a pod runs. ``ready.<rank>`` holds the pid."""
    where = cfg.get("hold_dir")
    if not where:
        return
    with open(os.path.join(where, f"ready.{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    deadline = time.monotonic() + cfg.get("hold_seconds", 120)
    while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)


def own_shm(rank: int) -> dict[str, Any]:
    """vLLM's own use of /dev/shm beside the region: the ring buffer of its message queue
    (``ShmRingBuffer``, a ``multiprocessing.shared_memory`` block) made, written, attached by
    name as a reader does, read back, and removed."""
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    made = ShmRingBuffer(n_reader=1, max_chunk_bytes=1 << 20, max_chunks=2)
    name = made.shared_memory.name
    with made.get_data(1) as buf:
        buf[:4] = bytes([0x70 + rank]) * 4
    listed = name in os.listdir("/dev/shm")
    reader = ShmRingBuffer(*made.handle())
    with reader.get_data(1) as buf:
        seen = bytes(buf[:4]).hex()
    del reader, made
    return {"name": name, "listed": listed, "seen": seen, "left": name in os.listdir("/dev/shm")}


def worker(rank: int, cfg: dict[str, Any], barrier: Any, out: Any) -> None:
    report: dict[str, Any] = {"rank": rank}
    region = None
    try:
        import vllm.v1.kv_offload.cpu.spec as cpu_spec
        from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        timeout = cfg.get("barrier_timeout", 60)
        cpu_spec._all_workers_barrier = lambda: barrier.wait(timeout)
        cpu_spec.CPUOffloadingWorker = lambda **kw: kw["mmap_region"]
        spec = OffloadingSpecFactory.create_spec(stock_config(cfg, rank))
        spec._uses_shared_region = lambda: True
        report["spec"] = type(spec).__name__
        t0 = time.perf_counter()
        region = spec.create_worker(kv_caches=None)
        report["attach_seconds"] = time.perf_counter() - t0
        report.update(
            mmap_path=region.mmap_path,
            num_chunks=region.num_chunks,
            row_stride=region._row_stride,
            cpu_page_size=region.cpu_page_size,
            total_bytes=region.total_size_bytes,
            segments=[[path, offset, length] for path, offset, length in region._segments],
        )
        pin_mmap_region(region, worker_slot_only=True)
        report["pinned"] = region.is_pinned
        # While mapped: memory vLLM made in the pod's own /dev/shm (a region it created counts
        # there even after vLLM unlinked its names) and the mapped pool files.
        report["shm_attached"] = shm_view()
        base = region.base_tensor
        report["read"] = {str(off): int(base[off].item()) & 0xFF for off in cfg.get("read_offsets", [])}
        barrier.wait(timeout)  # every rank has read what was there before any rank writes
        # vLLM's own view of this worker's slots: write a marker into the first byte of each row.
        view = region.create_next_worker_view(region.cpu_page_size)
        view[:, 0] = 0x40 + rank
        barrier.wait(timeout)
        # every worker wrote; read the other ranks' markers through this worker's mapping
        row, stride, slot = 0, region._row_stride, region.cpu_page_size
        report["seen_markers"] = [
            int(base[row * stride + r * slot].item()) & 0xFF for r in range(cfg["world_size"])
        ]
        barrier.wait(timeout)
        if cfg.get("own_shm"):
            report["own_shm"] = own_shm(rank)
        hold(cfg, rank)
    except BaseException as exc:  # reported, and the parent's verdict is the test's
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        barrier.abort()
    finally:
        if region is not None:
            report["creator_at_cleanup"] = region._creator
            region.cleanup()  # what vLLM does at shutdown: unlinks only what it created
        out.put(report)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    # Import vLLM once, before forking, as vLLM's own worker processes inherit it.
    import vllm.v1.kv_offload.cpu.gpu_worker
    import vllm.v1.kv_offload.cpu.spec
    import vllm.v1.kv_offload.factory  # noqa: F401

    make_pod_view(cfg)
    result: dict[str, Any] = {"shm_before": shm_view()}
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(cfg["world_size"]), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cfg, barrier, out)) for r in range(cfg["world_size"])]
    for p in procs:
        p.start()
    reports = [out.get(timeout=cfg.get("timeout", 240)) for _ in procs]
    for p in procs:
        p.join(30)
    result["workers"] = sorted(reports, key=lambda r: r["rank"])
    result["shm_during_exit"] = shm_view()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
