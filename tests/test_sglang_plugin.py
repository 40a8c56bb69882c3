"""offloadpool's SGLang plugin, loaded by SGLang 0.5.23's own ``load_plugins()``.

Each test provisions a real pool with the node engine, then starts SGLang scheduler ranks
(tests/sglang_workers/host_pool.py, the pinned SGLang's Python, TP ranks over gloo) that load
plugins through a real entry point (a dist-info carrying pyproject.toml's
``sglang.srt.plugins`` table) and build SGLang's own ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost``. What is checked: the host buffer is the pool's file in
/proc/self/maps, construction takes almost no minor faults (SGLang's own allocation faults
every page), each rank's bytes land only in its region or part (read from this process), the
lease is held while the ranks run, a request stock SGLang refuses under its container's memory
limit is served from the pool, and a pool too small for the rank stops it naming both numbers.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.cgroups import Cgroups, in_cgroups
from offloadpool.region.holding.lease import Lease, LeaseHeld
from offloadpool.region.lifecycle.provision import ProvisionResult, provision
from offloadpool.region.request import PoolRequest
from offloadpool.sglang import PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_TARGET

pytestmark = pytest.mark.sglang

MiB = 1 << 20
GiB = 1 << 30
#: sglang.srt.mem_cache.pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES of the pinned SGLang: what
#: its budget check leaves to the rest of the machine (or of the container) before sizing a pool
SGLANG_HOST_RESERVE = 10 * GiB
REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "sglang_workers" / "host_pool.py"
# bytes per token: MHA 4 layers x (K + V) x 2 heads x 64 x bf16; MLA 4 layers x 576 x bf16
PER_TOKEN = {"mha": 4 * 2 * 2 * 64 * 2, "mla": 4 * 576 * 2}


def plugins_dir(tmp_path: Path, with_plugin: bool) -> Path:
    """A directory for sys.path holding a dist-info with the installed offloadpool's entry points
    (pyproject.toml's, as pip wrote them), which SGLang's environment does not have installed."""
    d = tmp_path / ("plugins" if with_plugin else "no-plugins")
    d.mkdir(exist_ok=True)
    if with_plugin:
        dist = importlib.metadata.distribution("offloadpool")
        ours = [ep for ep in dist.entry_points if ep.group == PLUGIN_GROUP]
        assert [(ep.name, ep.value) for ep in ours] == [(PLUGIN_NAME, PLUGIN_TARGET)], ours
        info = d / "offloadpool_test-0.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: offloadpool-test\nVersion: 0\n")
        (info / "entry_points.txt").write_text(dist.read_text("entry_points.txt") or "")
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    python: Path,
    tmp_path: Path,
    pool: ProvisionResult | None,
    world: int,
    *,
    kind: str = "mha",
    layout: str = "page_first",
    tokens: int,
    hold: bool = False,
    cgroup: Path | None = None,
) -> list[dict[str, Any]]:
    """Start ``world`` ranks at once (each moved into ``cgroup`` first, when given); return each
    one's JSON line (rank order)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "agent")}
    env.pop("OFFLOADPOOL_POOL_DIR", None)
    if pool is not None:
        env["OFFLOADPOOL_POOL_DIR"] = str(pool.pool_dir)
    hold_file = tmp_path / "hold"
    if hold:
        hold_file.touch()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in range(world):
        cfg = {
            "world": world,
            "rank": rank,
            "init_method": init,
            "kind": kind,
            "layout": layout,
            "tokens": tokens,
            "fill": 0x11 * (rank + 1),
            "plugins_dir": str(plugins_dir(tmp_path, pool is not None)),
            **({"hold_file": str(hold_file)} if hold else {}),
        }
        argv = [str(python), str(WORKER), json.dumps(cfg)]
        procs.append(
            subprocess.Popen(
                in_cgroups([cgroup], argv) if cgroup is not None else argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    if hold:
        deadline = time.monotonic() + 300
        while not Path(f"{hold_file}.ready").exists() and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        ready = Path(f"{hold_file}.ready").exists()
        held = _lease_held(pool) if ready and pool is not None else None
        hold_file.unlink()
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        if p.returncode != 0 or not stdout.strip():
            pytest.fail(f"rank exited {p.returncode}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    if hold:
        outs[0]["lease_held_while_running"] = held
    return sorted(outs, key=lambda o: o["rank"])


def _lease_held(pool: ProvisionResult) -> bool:
    try:
        Lease.exclusive(pool.pool_dir).close()
    except LeaseHeld:
        return True
    return False


def make_pool(root: Path, name: str, capacity: int, layout: str, ranks: int) -> ProvisionResult:
    return provision(
        PoolRequest(name=name, capacity=capacity, medium="Memory", layout_type=layout, ranks=ranks), root
    )


def region_bytes(pool: ProvisionResult, region: int) -> bytes:
    out = b""
    for seg in pool.manifest.regions[region].segments:
        out += (pool.pool_dir / seg.file).read_bytes()
    return out


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mla", "layer_first")])
def test_a_per_rank_pool_serves_each_tp_rank_from_its_own_region(
    region_root: Path, tmp_path: Path, sglang_python: Path, kind: str, layout: str
) -> None:
    tokens = 4096  # a page-aligned host capacity: 8 MiB (MHA) or 18 MiB (MLA) per rank
    asked = tokens * PER_TOKEN[kind]
    pool = make_pool(region_root, "sgl", 2 * 24 * MiB, "PerRank", 2)
    ranks = run_ranks(sglang_python, tmp_path, pool, 2, kind=kind, layout=layout, tokens=tokens, hold=True)
    assert ranks[0]["lease_held_while_running"] is True
    assert not _lease_held(pool), "the lease outlived the ranks"
    for r, out in enumerate(ranks):
        assert "error" not in out, out
        assert out["bytes"] == out["requested"] == asked
        files = {str(pool.pool_dir / s.file) for s in pool.manifest.regions[r].segments}
        assert out["maps"] and set(out["maps"]) <= files, (out["maps"], files)
        # SGLang's own alloc_mmap faults every 4 KiB page (the stock test below); attaching the
        # pre-faulted pool maps them: what is left is attach's and SGLang's bookkeeping
        assert out["minor_faults"] < out["bytes"] // 4096 // 10, out
        data = region_bytes(pool, r)
        assert data[:asked] == bytes([0x11 * (r + 1)]) * asked  # this rank's bytes, all of them
        assert set(data[asked:]) <= {0}  # and nothing beyond its buffer


def test_one_shared_region_is_split_between_the_tp_ranks(
    region_root: Path, tmp_path: Path, sglang_python: Path
) -> None:
    tokens = 4096
    asked = tokens * PER_TOKEN["mha"]
    pool = make_pool(region_root, "shared", 32 * MiB, "Replicated", 1)
    ranks = run_ranks(sglang_python, tmp_path, pool, 2, kind="mha", layout="layer_first", tokens=tokens)
    data = region_bytes(pool, 0)
    part = len(data) // 2
    for r, out in enumerate(ranks):
        assert "error" not in out, out
        assert out["maps"], out
        assert set(data[r * part : r * part + asked]) == {0x11 * (r + 1)}
        assert set(data[r * part + asked : (r + 1) * part]) <= {0}


def test_stock_sglang_allocates_its_own_anonymous_memory(tmp_path: Path, sglang_python: Path) -> None:
    """The baseline the plugin replaces: no pool, SGLang's alloc_mmap, every page faulted."""
    (out,) = run_ranks(sglang_python, tmp_path, None, 1, tokens=4096)
    assert "error" not in out, out
    assert all("offloadpool" not in m and "/mnt/" not in m for m in out["maps"]), out
    assert out["minor_faults"] > out["bytes"] // 4096 // 2, out


def test_a_request_stock_sglang_refuses_in_its_container_is_served_from_the_pool(
    region_root: Path, tmp_path: Path, sglang_python: Path, cgroups: Cgroups
) -> None:
    """SGLang sizes a host pool against what the rank's memory cgroup has left (minus a 10 GiB
    reserve), as in a container: a pool the node provisioned outside that budget (its pages are
    the agent's, as reserved huge pages are nobody's MemAvailable) is refused by stock SGLang.
    The same request, in the same cgroup, with the plugin: served from the pool's file."""
    cg = cgroups.child("memory")
    limit = SGLANG_HOST_RESERVE + 1 * GiB  # the budget is at most 1 GiB, less what the rank uses
    limit_name = "memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes"
    (cg / limit_name).write_text(str(limit))
    tokens = (1 * GiB + 64 * MiB) // PER_TOKEN["mha"] // 16 * 16  # page-aligned, over the budget
    asked = tokens * PER_TOKEN["mha"]
    (stock,) = run_ranks(sglang_python, tmp_path, None, 1, kind="mha", tokens=tokens, cgroup=cg)
    assert stock.get("error", "").startswith(
        f"ValueError: Not enough host memory available. Requesting {asked / 1e9:.2f} GB"
    ), stock
    pool = make_pool(region_root, "big", asked + 16 * MiB, "Replicated", 1)
    (served,) = run_ranks(sglang_python, tmp_path, pool, 1, kind="mha", tokens=tokens, cgroup=cg)
    assert "error" not in served, served
    assert served["bytes"] == served["requested"] == asked, served
    files = {str(pool.pool_dir / s.file) for s in pool.manifest.regions[0].segments}
    assert served["maps"] and set(served["maps"]) <= files, (served["maps"], files)
    assert set(region_bytes(pool, 0)[:asked]) == {0x11}  # the rank wrote the pool's memory


def test_a_pool_too_small_for_the_rank_stops_it_naming_both_numbers(
    region_root: Path, tmp_path: Path, sglang_python: Path
) -> None:
    pool = make_pool(region_root, "small", 4 * MiB, "Replicated", 1)
    tokens = 8192  # 8 MiB
    (out,) = run_ranks(sglang_python, tmp_path, pool, 1, kind="mha", tokens=tokens)
    asked = tokens * PER_TOKEN["mha"]
    assert out["error"].startswith("PoolTooSmall: offloadpool: pool 'small'"), out
    assert f"holds {4 * MiB} bytes" in out["error"] and f"asks for {asked} bytes" in out["error"], out


def test_bench_startup_times_sglangs_own_host_pool_against_the_plugin(
    region_root: Path, sglang_python: Path
) -> None:
    """``offloadpool bench startup --sglang-python``: same capacity, same run, ratio printed."""
    import sys

    cmd = [
        sys.executable,
        "-c",
        "import sys; from offloadpool.cli.main import main; sys.exit(main(sys.argv[1:]))",
        "bench", "startup", "--capacity", "64Mi", "--reps", "1", "--media", "Memory",
        "--backend", "mlock", "--ranks", "0", "--sglang-python", str(sglang_python),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio_sglang_alloc_vs_plugin = **" in out.stdout, out.stdout
    assert "sglang: ratio_sglang_alloc_vs_plugin = " in out.stderr
    ratio = float(out.stdout.split("ratio_sglang_alloc_vs_plugin = **")[1].split("**")[0])
    assert ratio > 1, out.stdout  # faulting 64 MiB costs more than mapping a pre-faulted pool
    assert "offloadpool-bench-sglang-" not in Path("/proc/self/mounts").read_text()
