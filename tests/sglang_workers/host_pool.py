"""One SGLang scheduler rank building its HiCache host pool with SGLang 0.5.23's own classes.

Run with the pinned SGLang's Python (hack/vllm_env.py --engine sglang) and the clone's ``agent/``
on PYTHONPATH; the argument is a JSON object: ``world``, ``rank`` (torch.distributed over gloo,
as SGLang's TP group is), ``kind`` (``mha`` or ``mla``), ``layout``, ``tokens`` (the host pool's
token capacity), ``page`` (tokens per page), ``fill`` (a byte this rank writes over its
buffer) and ``plugins_dir`` (put on sys.path: a dist-info whose entry point names the plugin).
SGLang's real ``load_plugins()`` loads every entry point of ``sglang.srt.plugins``, then the
rank builds ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over CPU "device" buffers.
Prints one JSON line: the buffer's address and size, the files /proc/self/maps shows there,
the minor faults construction took, and the error SGLang or the plugin stopped with.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch


def maps_at(address: int, size: int) -> list[str]:
    """Files mapped over [address, address + size), from /proc/self/maps."""
    found = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo < address + size and hi > address and len(parts) >= 6:
                found.append(parts[5])
    return found


def device_buffers(kind: str, tokens: int, layers: int) -> object:
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo

    cpu = torch.device("cpu")
    if kind == "mha":
        k = tuple(torch.zeros(tokens, 2, 64, dtype=torch.bfloat16) for _ in range(layers))
        v = tuple(torch.zeros(tokens, 2, 64, dtype=torch.bfloat16) for _ in range(layers))
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        return MHABufferInfo(
            buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
            page_size=16,
            head_num=2,
            head_dim=64,
            v_head_dim=64,
            dtype=torch.bfloat16,
            device=cpu,
        )
    bufs = tuple(torch.zeros(tokens, 1, 576, dtype=torch.bfloat16) for _ in range(layers))
    return MLABufferInfo(
        buffers=bufs,
        data_ptrs=torch.tensor([t.data_ptr() for t in bufs], dtype=torch.uint64),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=16,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        kv_cache_dim=576,
        dtype=torch.bfloat16,
        device=cpu,
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    sys.path.insert(0, cfg["plugins_dir"])
    if cfg["world"] > 1:
        torch.distributed.init_process_group(
            "gloo", init_method=cfg["init_method"], rank=cfg["rank"], world_size=cfg["world"]
        )
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    layers = 4
    info = device_buffers(cfg["kind"], 64, layers)
    common = dict(
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=16,
        layout=cfg["layout"],
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=64,
        start_layer=0,
        end_layer=layers - 1,
        host_token_capacity=cfg["tokens"],
    )
    out: dict = {"rank": cfg["rank"]}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    try:
        if cfg["kind"] == "mha":
            pool = MHATokenToKVPoolHost(info, **common)
        else:
            pool = MLATokenToKVPoolHost(info, target_layer_num=layers, **common)
    except (Exception, SystemExit) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)
        os._exit(0)
    out["minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    buf = pool.kv_buffer
    out["address"], out["bytes"] = buf.data_ptr(), buf.numel() * buf.element_size()
    out["requested"] = pool.size * pool.size_per_token
    out["maps"] = maps_at(out["address"], out["bytes"])
    buf.view(torch.uint8).fill_(cfg["fill"])
    if cfg["world"] > 1:
        torch.distributed.barrier()
    print(json.dumps(out), flush=True)
    if cfg.get("hold_file"):  # keep the lease while the test looks, until the file goes
        open(cfg["hold_file"] + ".ready", "w").close()
        while os.path.exists(cfg["hold_file"]):
            import time

            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
