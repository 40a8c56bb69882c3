"""A vLLM 0.33.0 engine's KV offload workers using offloadpool's native spec, as in a pod.

Run by the pinned vLLM environment's Python inside ``unshare --mount --propagation private``
with the clone's ``agent/`` on PYTHONPATH (tests/fixtures/vllm_env.py):

* the pod's view: the pool directory bind-mounted (recursively: its ``mnt/`` is a mount of
  its own) at ``<pod_root>/offloadpool/<pool>``, and ``OFFLOADPOOL_POOL_DIR`` pointing there,
  as the admission webhook does;
* ``world_size`` forked workers, each going through vLLM's own path: ``OffloadingSpecFactory``
  loads ``offloadpool.vllm.spec.OffloadPoolOffloadingSpec`` by ``spec_module_path`` /
  ``spec_name`` (vLLM's out-of-tree loading), then ``create_worker``.

What needs a GPU is replaced in vLLM's module namespace, and only that: the platform check for
the shared region (``CPUOffloadingSpec._uses_shared_region``), and the CUDA-stream
``CPUOffloadingWorker``, whose stand-in does what vLLM's worker does with the region before it
builds CUDA handlers — vLLM's ``pin_mmap_region`` (unconditionally: on a GPU vLLM calls it,
so it must register nothing twice) and one ``create_next_worker_view`` per KV tensor — and
``cleanup()`` at shutdown. vLLM's ``host_register`` is wrapped to count its calls.

Each worker also reports what the kernel says it holds: its page-locked bytes (``VmLck``) and
the pool files it has mapped (``/proc/self/maps``).

With ``report_values``, each worker also reports every byte value of its tier (costly: opt-in).

The parent checks the pool's lease while the workers hold it, then after they exit, and prints
one JSON object. With ``engines`` (a list of overrides of the config), it runs those engines
one after another against the same pool(s), as a node serves one model after another, and
prints ``{"engines": [one object per engine]}``. With ``together`` (a list of overrides, each
with its own ``pod_uid``, as the webhook sets ``OFFLOADPOOL_POD_UID`` per pod), it runs those
engines at the same time, every worker of every engine attached before any reads, then starts
the ``refused`` engine while they hold the pool, and prints ``{"together": [...], "refused":
{...}}`` (``run_together``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from offloading_config import offloading_config


def make_pod_view(cfg: dict[str, Any]) -> list[str]:
    """Each pool (``pool_dirs``, or the one ``pool_dir``) where the pod sees it; the
    environment names the first, as the webhook does for a pod of one pool."""
    subprocess.run(["mount", "-t", "tmpfs", "pod-root", cfg["pod_root"]], check=True)
    pod_dirs = []
    for pool_dir in cfg.get("pool_dirs") or [cfg["pool_dir"]]:
        pod_dir = Path(cfg["pod_root"]) / "offloadpool" / Path(pool_dir).name
        pod_dir.mkdir(parents=True)
        subprocess.run(["mount", "--rbind", pool_dir, str(pod_dir)], check=True)
        pod_dirs.append(str(pod_dir))
    os.environ["OFFLOADPOOL_POOL_DIR"] = pod_dirs[0]
    return pod_dirs


def native_config(cfg: dict[str, Any], rank: int, dp: int = 0):
    """vLLM's own OffloadingConfig naming offloadpool's native spec, for data-parallel rank ``dp``."""
    extra = {
        "spec_name": "OffloadPoolOffloadingSpec",
        "spec_module_path": "offloadpool.vllm.spec",
        "pin_backend": "mlock",
        **cfg.get("extra_config", {}),
    }
    return offloading_config(
        cfg,
        rank,
        extra_config=extra,
        engine_id=cfg.get("engine_id", "native") + (f"_dp{dp}" if cfg.get("dp_size", 1) > 1 else ""),
        dp_index=cfg.get("dp_index", dp),
        dp_size=cfg.get("dp_size", 1),
    )


class WorkerStandIn:
    """What vLLM's CPUOffloadingWorker does with the region before its CUDA handlers."""

    def __init__(
        self, *, kv_caches: Any, blocks_per_chunk: int, num_cpu_chunks: int, mmap_region: Any
    ) -> None:
        from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

        self.region = mmap_region
        pin_mmap_region(mmap_region, worker_slot_only=True)
        self.views = [mmap_region.create_next_worker_view(page * blocks_per_chunk) for page in kv_caches]

    def shutdown(self) -> None:
        self.views.clear()
        self.region.cleanup()


def kernel_view(pool_dirs: list[str]) -> dict[str, Any]:
    """This process's page-locked bytes and the files of the pool(s) it maps, by the kernel."""
    status = Path("/proc/self/status").read_text()
    vmlck = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmLck:"))
    mapped = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and any(fields[5].startswith(d + "/") for d in pool_dirs):
            mapped.add(fields[5])
    return {"vmlck": vmlck, "mapped": sorted(mapped)}


def worker(rank: int, cfg: dict[str, Any], barrier: Any, out: Any, go: Any, dp: int = 0) -> None:
    report: dict[str, Any] = {"rank": rank, "dp": dp}
    stand_in = None
    timeout = cfg.get("barrier_timeout", 60)
    if "pod_uid" in cfg:
        os.environ["OFFLOADPOOL_POD_UID"] = cfg["pod_uid"]  # this engine's pod, as the webhook says
    try:
        import vllm.v1.kv_offload.cpu.gpu_worker as gpu_worker
        import vllm.v1.kv_offload.cpu.spec as cpu_spec
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        vllm_registrations: list[int] = []
        original = gpu_worker.host_register
        gpu_worker.host_register = lambda ptr, n: (vllm_registrations.append(n), original(ptr, n))[1]
        cpu_spec.CPUOffloadingSpec._uses_shared_region = lambda self: True
        cpu_spec.CPUOffloadingWorker = WorkerStandIn
        spec = OffloadingSpecFactory.create_spec(native_config(cfg, rank, dp))
        report["spec"] = f"{type(spec).__module__}.{type(spec).__name__}"
        report["pool_dir"] = str(getattr(spec, "pool_dir", ""))
        report.update(
            num_chunks=spec.num_chunks,
            row_bytes=spec.kv_bytes_per_chunk,
            slot_bytes=spec.cpu_page_size_per_worker,
            cpu_bytes_to_use=int(spec.extra_config["cpu_bytes_to_use"]),
        )
        # one "KV tensor" per layer group: this worker's slot split in two
        slot = spec.cpu_page_size_per_worker
        block = slot // spec.blocks_per_chunk  # vLLM's worker sizes its views per block
        stand_in = spec.create_worker(kv_caches=[block // 2, block - block // 2])
        region = stand_in.region
        stats = region.pin_stats
        report.update(
            region=type(region).__name__,
            pinned=region.is_pinned,
            offloadpool_pin={"bytes": stats.bytes_registered, "calls": stats.calls, "backend": stats.backend},
            vllm_registrations=len(vllm_registrations),
            vllm_pinned_addresses=len(region.pinned_addresses),
            views=[[list(v.shape), list(v.stride()), v.storage_offset()] for v in stand_in.views],
            attached_rank=region.attachment.rank,
            share=region.attachment.share,
            **kernel_view(cfg["pod_dirs"]),
        )
        # write through vLLM's views: this rank's marker in every row of its first view
        # (another data-parallel replica's markers differ by 0x10: its writes must reach its pool)
        stand_in.views[0][:, 0] = 0x40 + 0x10 * dp + rank
        stand_in.views[1][:, -1] = 0x60 + 0x10 * dp + rank
        barrier.wait(timeout)
        base, stride = region.base_tensor, region._row_stride
        last = (spec.num_chunks - 1) * stride
        slots_per_row = min(cfg["world_size"], stride // slot)  # 1 under vLLM's replicated layout
        report["seen"] = [
            [int(base[r * slot].item()) & 0xFF, int(base[last + r * slot + slot - 1].item()) & 0xFF]
            for r in range(slots_per_row)
        ]
        if cfg.get("report_values"):  # every byte value of its tier: what it sees of anyone's writes
            report["values"] = sorted(
                {int(v) & 0xFF for v in base[: spec.num_chunks * stride].unique().tolist()}
            )
        out.put({"rank": rank, "dp": dp, "attached": True})
        go.wait(timeout)  # the parent checks the lease while every worker is attached
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-3000:]
        barrier.abort()
    finally:
        if stand_in is not None:
            stand_in.shutdown()  # vLLM's worker shutdown: region.cleanup()
        out.put(report)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import vllm.v1.kv_offload.cpu.gpu_worker
    import vllm.v1.kv_offload.cpu.spec
    import vllm.v1.kv_offload.factory  # noqa: F401

    pod_dirs = make_pod_view(cfg)
    cfg["pod_dirs"] = pod_dirs
    if "together" in cfg:
        print(json.dumps(run_together(cfg)))
    elif "engines" in cfg:
        print(json.dumps({"engines": [run_engine({**cfg, **engine}) for engine in cfg["engines"]]}))
    else:
        print(json.dumps(run_engine(cfg)))
    return 0


def run_engine(cfg: dict[str, Any]) -> dict[str, Any]:
    """Start one engine's workers, check the lease while they hold the pool, wait for them."""
    from offloadpool.region.holding.lease import Lease, LeaseHeld

    pod_dirs = cfg["pod_dirs"]
    ctx = mp.get_context("fork")
    # dp_size engines (data-parallel replicas) of world_size workers each, one barrier per engine
    tp, dps = cfg["world_size"], cfg.get("dp_size", 1)
    world = tp * dps
    barriers, out, go = [ctx.Barrier(tp) for _ in range(dps)], ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=worker, args=(r, cfg, barriers[dp], out, go, dp))
        for dp in range(dps)
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    reports, attached = [], 0
    while attached < world and len(reports) < world:
        msg = out.get(timeout=cfg.get("timeout", 240))
        if msg.get("attached"):
            attached += 1
        else:
            reports.append(msg)

    def leases() -> list[str]:
        states = []
        for pod_dir in pod_dirs:
            try:
                Lease.exclusive(pod_dir).close()
                states.append("free")
            except LeaseHeld:
                states.append("held")
        return states

    result: dict[str, Any] = {"pod_dir": pod_dirs[0], "pod_dirs": pod_dirs}
    if attached == world:
        result["leases_while_attached"] = leases()
        result["lease_while_attached"] = result["leases_while_attached"][0]
    go.set()
    while len(reports) < world:
        reports.append(out.get(timeout=cfg.get("timeout", 240)))
    for p in procs:
        p.join(30)
    result["leases_after_exit"] = leases()
    result["lease_after_exit"] = result["leases_after_exit"][0]
    result["workers"] = sorted(reports, key=lambda r: (r.get("dp", 0), r["rank"]))
    return result


def run_together(cfg: dict[str, Any]) -> dict[str, Any]:
    """Engines of different pods at once on one pool: engine k's workers write markers
    ``0x40 + 0x10*k + rank`` (passed as its ``dp`` tag; each is data-parallel rank 0 of its own
    engine). One barrier over every worker: all have written before any reads. While they hold
    the pool, the ``refused`` engine's workers try to attach; then all exit."""
    ctx = mp.get_context("fork")
    engines = [{**cfg, **e, "dp_index": 0} for e in cfg["together"]]
    world = sum(e["world_size"] for e in engines)
    barrier, out, go = ctx.Barrier(world), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=worker, args=(r, e, barrier, out, go, k))
        for k, e in enumerate(engines)
        for r in range(e["world_size"])
    ]
    for p in procs:
        p.start()
    reports, attached = [], 0
    while attached < world and len(reports) < world:
        msg = out.get(timeout=cfg.get("timeout", 240))
        if msg.get("attached"):
            attached += 1
        else:
            reports.append(msg)
    refused: dict[str, Any] = {}
    if attached == world:
        third = {**cfg, **cfg["refused"], "dp_index": 0}
        n = third["world_size"]
        late = [
            ctx.Process(target=worker, args=(r, third, ctx.Barrier(n), out, ctx.Event(), len(engines)))
            for r in range(n)
        ]
        for p in late:
            p.start()
        refused["workers"] = sorted(
            (out.get(timeout=cfg.get("timeout", 240)) for _ in late), key=lambda r: r["rank"]
        )
        for p in late:
            p.join(30)
    go.set()
    while len(reports) < world:
        reports.append(out.get(timeout=cfg.get("timeout", 240)))
    for p in procs:
        p.join(30)
    return {
        "pod_dir": cfg["pod_dirs"][0],
        "together": [
            sorted((w for w in reports if w["dp"] == k), key=lambda w: w["rank"]) for k in range(len(engines))
        ],
        "refused": refused,
    }


if __name__ == "__main__":
    sys.exit(main())
