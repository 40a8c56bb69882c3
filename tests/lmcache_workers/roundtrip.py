"""Store KV chunks in a running ``lmcache server`` and read them back, with LMCache's own client.

Run with the pinned LMCache environment's Python (hack/vllm_env.py --engine lmcache) and one JSON argument:
``{"rpc_url", "http_url", "shape", "num_tokens", "fill"}``. The client is LMCache's server-bench
client (``ServerBenchClient``, CPU mode, ``lmcache_driven``: REGISTER_KV_CACHE, then STORE and
RETRIEVE, the server copying between the client's KV tensors and its L1). Every KV tensor is
filled with a known pattern before the store (element i of layer l is ``fill + 131 * l + i``
mod 2**15, as float16 bits); after the store the tensors are zeroed and RETRIEVE must bring the
pattern back. Prints one JSON object: what was stored, whether it came back, and the pattern's
first bytes (so the test can look for them in the pool's file from another process).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import torch
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    config = BenchConfig(
        rpc_url=cfg["rpc_url"],
        http_url=cfg["http_url"],
        mode="cpu",
        transfer_mode="lmcache_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=cfg["num_tokens"],
        kvcache_shape_spec=cfg["shape"],
        num_blocks=64,
        block_size=16,
    )
    log: list[str] = []
    client = ServerBenchClient(config, log.append)
    client.start()
    try:
        worker = client._workers[0]
        tensors = list(worker.kv_caches.values())
        for layer, t in enumerate(tensors):
            n = t.numel()
            bits = (torch.arange(n, dtype=torch.int64) + cfg["fill"] + 131 * layer) % (1 << 15)
            t.view(torch.int16).view(-1).copy_(bits.to(torch.int16))
        request = client.create_request(0, "offloadpool-roundtrip", "store")
        assert request is not None, log
        tokens = request.num_full_tokens
        blocks = list(range(request.block_offset, request.block_offset + request.num_blocks))
        expected = [t[:, blocks].clone() for t in tensors]  # (2, NB, BS, NH, HS): K and V
        before = client.lookup(request)
        stored = client.store(request, 0, tokens)
        # the server commits a STORE to its L1 asynchronously: look it up until it is all there
        deadline = time.monotonic() + 30
        after = client.lookup(request)
        while after.hit_chunks < request.total_chunks and time.monotonic() < deadline:
            time.sleep(0.2)
            after = client.lookup(request)
        for t in tensors:
            t.zero_()
        retrieved = client.retrieve(request, 0, tokens)
        # bit for bit (the pattern's float16 values include NaNs, which never compare equal)
        equal = all(
            torch.equal(t[:, blocks].view(torch.int16), e.view(torch.int16))
            for t, e in zip(tensors, expected, strict=True)
        )
        sample = expected[0][0, 0].contiguous().view(torch.uint8).numpy().tobytes()[:4096]
        client.end_session(request)
    finally:
        client.close()
    print(
        json.dumps(
            {
                "tokens": tokens,
                "chunks": request.total_chunks,
                "hits_before": before.hit_chunks,
                "hits_after": after.hit_chunks,
                "stored": stored is not None and list(stored.successful_worker_ranks) == [0],
                "retrieved": retrieved is not None and list(retrieved.successful_worker_ranks) == [0],
                "equal": equal,
                "sample_hex": sample.hex(),
                "stored_bytes": sum(e.numel() * e.element_size() for e in expected),
                "log": log[-20:],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
