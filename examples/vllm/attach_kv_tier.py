#!/usr/bin/env python3
"""A vLLM-style worker's CPU KV tier on an offloadpool pool (library path).

What a tensor-parallel worker does at start-up instead of building ``/dev/shm/vllm_offload_*``
itself: attach the pool its node provisioned, start pinning in the background, carve its KV
tensors out of its own slots while that runs, and wait for the pin before the first transfer.

    python examples/vllm/attach_kv_tier.py --pool /var/lib/offloadpool/kv --rank 0
    python examples/vllm/attach_kv_tier.py --rank 0     # in a labelled pod: $OFFLOADPOOL_POOL_DIR

The pool must be Interleaved with ``ranks`` = TP size and ``slotSize`` = the bytes one worker
keeps per CPU block (vLLM's ``cpu_page_size``): row i of the pool is CPU block i, and
worker r's part of it starts at ``r * slotSize``. Works without torch too (memoryviews).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from offloadpool.pinning import ManifestError, PinError, attach


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pool",
        default=os.environ.get("OFFLOADPOOL_POOL_DIR"),
        required="OFFLOADPOOL_POOL_DIR" not in os.environ,
        help="pool directory as mounted in the pod (default: $OFFLOADPOOL_POOL_DIR, set by the webhook)",
    )
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")))
    ap.add_argument("--backend", default="auto", help="auto | cuda | torch | mlock")
    ap.add_argument("--layers", type=int, default=4, help="KV tensors per CPU block (demo)")
    args = ap.parse_args(argv)

    try:
        region = attach(args.pool, rank=args.rank)
    except ManifestError as exc:  # not provisioned, not Ready, wrong rank, size mismatch, ...
        print(f"cannot attach the KV pool: {exc}", file=sys.stderr)
        return 1
    with region:
        pinning = region.pin(args.backend, background=True)  # overlap with the rest of start-up
        blocks, _row, _off, slot = region.row_geometry()
        per_layer = slot // args.layers

        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            kv = region.slot_view()  # (blocks, slot) uint8, strided by the row size
            layers = [kv[:, i * per_layer : (i + 1) * per_layer] for i in range(args.layers)]
            layers[0][0].fill_(args.rank + 1)  # a write into this worker's block 0, layer 0
            check = int(layers[0][0][0])
        else:
            block0 = region.slot_memoryview(0)
            block0[:per_layer] = bytes([args.rank + 1]) * per_layer
            check = block0[0]
            block0.release()

        try:
            stats = pinning.result()  # before the first GPU<->CPU copy
        except PinError as exc:
            print(f"pinning failed and was rolled back: {exc}", file=sys.stderr)
            return 1
        print(
            json.dumps(
                {
                    "rank": args.rank,
                    "blocks": blocks,
                    "slot_bytes": slot,
                    "layers": args.layers,
                    "pinned_bytes": stats.bytes_registered,
                    "pin_calls": stats.calls,
                    "pin_seconds": round(stats.seconds, 4),
                    "backend": stats.backend,
                    "torch_views": torch is not None,
                    "written": check,
                }
            )
        )
        if torch is not None:
            del kv, layers
    return 0


if __name__ == "__main__":
    sys.exit(main())
