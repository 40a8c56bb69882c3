"""Part of ``offloadpool bench startup --sglang-python PY``: SGLang's host pool, its way and ours.

Runs in the pinned SGLang's Python (hack/vllm_env.py --engine sglang), ``agent/`` on PYTHONPATH.
Same size, same run, interleaved, each case once untimed before its timed runs:

* ``sglang_alloc``: SGLang 0.5.23's own ``alloc_with_host_register`` with its default allocator
  (``alloc_mmap``: anonymous mapping, every page faulted before it returns);
* ``sglang_plugin``: the same call with offloadpool's plugin registered through SGLang's
  ``HookRegistry`` on a pool provisioned (untimed) before: attach, lease, carve.

No CUDA registration on a CPU (``pin_memory`` False; with a GPU SGLang registers both the same
way). Prints one JSON object: each case's seconds and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from offloadpool.bench.stats import summarize
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.memory import mounts
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import ENV_POOL_DIR, MEMORY

NAME = "sglang-bench"


def run(cap: int, reps: int) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.pool_host import common
    from sglang.srt.plugins.hook_registry import HookRegistry

    from offloadpool.sglang import plugin

    stock = common.alloc_with_host_register
    base = Path(tempfile.mkdtemp(prefix="offloadpool-bench-sglang-"))
    try:
        pool = provision(PoolRequest(name=NAME, capacity=cap, medium=MEMORY), base)
        os.environ[ENV_POOL_DIR] = str(pool.pool_dir)
        plugin.register()
        HookRegistry.apply_hooks()
        hooked = common.alloc_with_host_register
        assert hooked is not stock

        def sglang_alloc() -> float:
            t0 = time.perf_counter()
            buf = stock((cap,), torch.uint8, "cpu", False, common.HostTensorAllocator())
            seconds = time.perf_counter() - t0
            del buf
            return seconds

        def sglang_plugin() -> float:
            t0 = time.perf_counter()
            buf = hooked((cap,), torch.uint8, "cpu", False, common.HostTensorAllocator())
            seconds = time.perf_counter() - t0
            del buf
            assert plugin._POOL is not None
            plugin._POOL.attachment.close()  # a fresh attach for the next run, as a new rank
            plugin._POOL = None
            return seconds

        times: dict[str, list[float]] = {"sglang_alloc": [], "sglang_plugin": []}
        for _case, fn in (("sglang_alloc", sglang_alloc), ("sglang_plugin", sglang_plugin)):
            fn()  # untimed warm-up
        for _ in range(reps):
            for case, fn in (("sglang_alloc", sglang_alloc), ("sglang_plugin", sglang_plugin)):
                times[case].append(fn())
        cases = {case: dataclasses.asdict(summarize(v)) for case, v in times.items()}
        ratio = cases["sglang_alloc"]["median"] / cases["sglang_plugin"]["median"]
        return {"capacity": cap, "reps": reps, "cases": cases, "sglang_alloc_vs_plugin": ratio}
    finally:
        if (base / NAME).exists():
            release(base, NAME, force=True)
        for m in reversed(mounts.mounts_under(base)):
            mounts.umount(m.target, lazy=True)
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacity", type=int, required=True, help="bytes")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    print(json.dumps(run(args.capacity, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
