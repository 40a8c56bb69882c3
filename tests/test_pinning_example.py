"""examples/vllm/attach_kv_tier.py works as documented, for every rank of an interleaved pool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fixtures.pinning_pools import MiB, PoolFactory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vllm" / "attach_kv_tier.py"


def test_example_attaches_each_rank_and_pins_its_slots(make_pool: PoolFactory) -> None:
    pool = make_pool("kv-tp4", capacity=64 * MiB, layout_type="Interleaved", ranks=4, slot_bytes=256 * 1024)
    for rank in range(4):
        proc = subprocess.run(
            [sys.executable, str(EXAMPLE), "--pool", str(pool), "--rank", str(rank), "--backend", "mlock"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["blocks"] == 64 and out["slot_bytes"] == 256 * 1024
        assert out["pinned_bytes"] == 16 * MiB  # its quarter: slot-selective
        assert out["written"] == rank + 1


def test_example_explains_a_missing_pool(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--pool", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "cannot attach the KV pool" in proc.stderr and "not provisioned" in proc.stderr
