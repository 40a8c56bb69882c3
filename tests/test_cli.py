"""The ``offloadpool`` command as a user runs it: real subprocesses, real mounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.host import REPO, cli, hugepage_totals
from offloadpool.region.memory import mounts

MiB = 1 << 20


def test_provision_from_file_with_overrides_status_release(region_root, hugepage_baseline):
    root = str(region_root)
    # 80Mi: a whole number of the example's 5Mi vLLM rows, below 2 GiB so vLLM keeps one file
    from_file = ("provision", "-f", str(REPO / "examples" / "vllm-compat.yaml"), "--capacity", "80Mi")
    out = cli(*from_file, "--root", root, "--node", "node-a", "--json")
    result = json.loads(out.stdout)
    pool_dir = Path(result["pool_dir"])
    assert pool_dir == region_root / "vllm-stock"
    manifest = result["manifest"]
    assert manifest["total_bytes"] == 80 * MiB and manifest["medium"] == "Memory"
    assert manifest["compat_file"] == "mnt/vllm_offload_llama-70b-tp4.mmap"
    compat = pool_dir / manifest["compat_file"]
    segment = pool_dir / manifest["regions"][0]["segments"][0]["file"]
    assert os.stat(compat).st_ino == os.stat(segment).st_ino  # the same memory, two names
    assert os.stat(compat).st_size == 80 * MiB

    status = json.loads(cli("status", "--root", root, "--json").stdout)
    assert [(p["name"], p["phase"], p["populated_bytes"]) for p in status["pools"]] == [
        ("vllm-stock", "Ready", 80 * MiB)
    ]
    table = cli("status", "--root", root).stdout
    assert "vllm-stock" in table and "Ready" in table

    again = json.loads(cli(*from_file, "--root", root, "--json").stdout)
    assert again["reused"] is True

    out = cli("release", "vllm-stock", "--root", root)
    assert "released pool vllm-stock" in out.stdout
    assert not pool_dir.exists() and mounts.mounts_under(region_root) == []
    out = cli("release", "vllm-stock", "--root", root)
    assert "nothing to release" in out.stdout


def test_provision_flags_only_prints_summary(region_root, hugepage_baseline):
    out = cli(
        "provision",
        "--root",
        str(region_root),
        "--name",
        "flags",
        "--capacity",
        "128Mi",
        "--medium",
        "HugePages-2Mi",
        "--layout",
        "PerRank",
        "--ranks",
        "2",
        "--min-size",
        "32Mi",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--mode",
        "0600",
    )
    assert "pool flags" in out.stdout and "Ready" in out.stdout and "4 (2, 2 per region)" in out.stdout
    st = os.stat(region_root / "flags" / "mnt" / "r1-s001")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1000, 1000, 0o600)
    cli("release", "flags", "--root", str(region_root))
    assert hugepage_totals() == hugepage_baseline


def test_status_off_a_terminal_prints_the_whole_table(region_root, hugepage_baseline):
    """``kubectl exec <agent-pod> -- offloadpool status`` has no terminal and no COLUMNS: the
    table is printed whole, message column included, not cut at rich's default 80 columns."""
    import subprocess
    import sys

    root = str(region_root)
    cli("provision", "--root", root, "--name", "whole-table", "--capacity", "32Mi", "--medium", "Memory")
    mounts.umount(region_root / "whole-table" / "mnt", lazy=True)  # its state says why, at length
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run(
        [sys.executable, "-m", "offloadpool.cli", "status", "--root", root],
        capture_output=True,  # stdout a pipe, not a terminal
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    assert "message" in out, out
    rows = [line for line in out.splitlines() if "whole-table" in line]
    assert len(rows) == 1, out  # one row: nothing wrapped onto a second line
    assert "Failed" in rows[0] and "the pool's mount is gone; provision again to rebuild it" in rows[0], out
    cli("release", "whole-table", "--root", root, "--force")


def test_bad_input_names_the_field_and_creates_nothing(region_root, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: offloadpool.io/v1alpha1\nkind: OffloadPool\nmetadata: {name: bad}\n"
        "spec: {capacity: 3Mi, medium: HugePages-2Mi}\n"
    )
    out = cli("provision", "-f", str(bad), "--root", str(region_root), check=False)
    assert out.returncode == 2 and "spec.capacity" in out.stderr
    out = cli("provision", "--root", str(region_root), "--capacity", "1Gi", check=False)
    assert out.returncode == 2 and "needs a name" in out.stderr
    out = cli(
        "provision",
        "--root",
        str(region_root),
        "--name",
        "x",
        "--capacity",
        "64Mi",
        "--layout",
        "PerRank",
        check=False,
    )
    assert out.returncode == 2 and "spec.layout.ranks" in out.stderr
    assert list(region_root.iterdir()) == []


def test_release_of_held_pool_exits_3(region_root, processes):
    import sys

    cli("provision", "--root", str(region_root), "--name", "held", "--capacity", "64Mi", "--medium", "Memory")
    holder = processes(
        [
            sys.executable,
            "-c",
            "import sys,time\nfrom offloadpool.region.holding.lease import Lease\n"
            "l=Lease.shared(sys.argv[1]); print('held', flush=True); time.sleep(3600)",
            str(region_root / "held"),
        ]
    )
    assert holder.stdout.readline().strip() == "held"
    out = cli("release", "held", "--root", str(region_root), check=False)
    assert out.returncode == 3 and "in use" in out.stderr
    out = cli("release", "held", "--root", str(region_root), "--force")
    assert "keep mapping memory that no pool accounts for" in out.stderr
    assert not (region_root / "held").exists()


def test_demo_provisions_summarises_and_cleans_up(region_root, hugepage_baseline):
    out = cli("demo", "--capacity", "256Mi", "--root", str(region_root))
    assert "offloadpool demo" in out.stdout
    assert "huge page coverage" in out.stdout and "populate rate" in out.stdout
    assert "kept the region" in out.stdout
    assert "mounts left: 0, pool directory left: False" in out.stdout
    assert list(region_root.iterdir()) == [] and mounts.mounts_under(region_root) == []
    assert hugepage_totals() == hugepage_baseline


def test_demo_keep_leaves_a_ready_pool(region_root):
    out = cli("demo", "--capacity", "128Mi", "--medium", "MemoryTHP", "--root", str(region_root), "--keep")
    assert "kept: release it with" in out.stdout
    status = json.loads(cli("status", "--root", str(region_root), "--json").stdout)
    assert [(p["name"], p["phase"], p["medium"]) for p in status["pools"]] == [("demo", "Ready", "MemoryTHP")]
    cli("release", "demo", "--root", str(region_root))


@pytest.mark.root  # the benchmark mounts its own scratch pools
def test_bench_populate_json_schema():
    """Shape of the benchmark's output only (speed belongs in the benchmark, not in tests)."""
    out = cli(
        "bench",
        "populate",
        "--capacity",
        "64Mi",
        "--reps",
        "1",
        "--pairs",
        "2",
        "--media",
        "Memory,HugePages-2Mi",
        "--json",
    )
    result = json.loads(out.stdout)
    for name in (
        "engine_baseline",
        "sharded",
        "segmented",
        "per_rank",
        "vllm_0_33",
        "offloadpool_Memory",
        "offloadpool_HugePages-2Mi",
        "memset_limit",
        "memset_bulk",
        "kernel_HugePages-2Mi_fallocate",
        "kernel_HugePages-2Mi_madvise",
        "kernel_Memory_madvise",
        "kernel_Memory_fallocate+madvise",
        "kernel_Memory_touch",
    ):
        s = result["strategies"][name]
        assert s["gib_per_s"] > 0 and s["seconds"] > 0 and len(s["samples_s"]) == 1
    assert result["best_offloadpool"] in ("offloadpool_Memory", "offloadpool_HugePages-2Mi")
    assert result["ratio_vs_engine_baseline"] > 0 and result["ratio_vs_memset_limit"] > 0
    assert result["machine"]["cores"] >= 1 and result["hugepages_restored"] is True
    media = result["media"]
    assert set(media) == {"Memory", "HugePages-2Mi"}
    assert media["HugePages-2Mi"]["chosen"] == "fallocate"
    assert media["Memory"]["chosen"] == "fallocate+madvise"
    assert set(media["HugePages-2Mi"]["options_gib_per_s"]) == {"fallocate", "madvise"}
    for medium, m in media.items():
        assert m["kernel_gib_per_s"] == max(m["options_gib_per_s"].values())
        assert m["ratio_vs_kernel"] == pytest.approx(
            m["offloadpool_gib_per_s"] / m["kernel_gib_per_s"], abs=1e-3
        )
        assert m["paired"]["option"] in m["options_gib_per_s"] and len(m["paired"]["ratios"]) == 2
        assert min(m["paired"]["ratios"]) <= m["paired_ratio_vs_kernel"] <= max(m["paired"]["ratios"])
        assert len(m["paired"]["populate_ratios"]) == 2 and m["paired_populate_ratio_vs_kernel"] > 0
        # a provision's seconds outside its pre-fault are part of its whole seconds
        assert 0 < m["outside_prefault_ms"] < result["strategies"][f"offloadpool_{medium}"]["seconds"] * 1000


def test_version_names_the_package_version() -> None:
    import offloadpool

    for args in (["version"], ["--version"]):
        done = subprocess.run(
            [sys.executable, "-m", "offloadpool.cli", *args], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"offloadpool {offloadpool.__version__}"


@pytest.mark.root  # the benchmark mounts its own scratch pools
def test_bench_scrub_json_schema():
    """Shape of the scrub benchmark's output, with its bare-write limit (speed is the bench's)."""
    out = cli(
        "bench", "scrub", "--capacity", "64Mi", "--reps", "1", "--media", "Memory,HugePages-2Mi",
        "--pairs", "2", "--json",
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert set(result["media"]) == {"Memory", "HugePages-2Mi"} and result["params"]["pairs"] == 2
    for m in result["media"].values():
        # the pairs: the chosen method, each ratio the bare write's seconds over the scrub's
        assert m["paired"]["method"] == m["fastest_scrub"] and len(m["paired"]["ratios"]) == 2
        assert all(r > 0 for r in m["paired"]["ratios"])
        assert min(m["paired"]["ratios"]) <= m["paired_scrub_vs_bare_write"] <= max(m["paired"]["ratios"])
        assert set(m["cases"]) == {"prefault", "scrub_memset", "scrub_punch", "scrub_remove", "bare_write"}
        for s in m["cases"].values():
            assert s["gib_per_s"] > 0 and len(s["samples_s"]) == 1
        best = m["cases"][f"scrub_{m['fastest_scrub']}"]["gib_per_s"]
        assert m["fastest_scrub_vs_bare_write"] == pytest.approx(
            best / m["cases"]["bare_write"]["gib_per_s"], abs=0.01
        )


def test_bare_write_shares_cover_the_pool_once():
    """The bare write's split: contiguous, page-aligned shares that cover every byte once."""
    from offloadpool.bench.scrub import _pieces
    from offloadpool.region.files.planner import plan
    from offloadpool.region.request import PoolRequest

    p = plan(PoolRequest(name="p", capacity=5 << 30, medium="Memory", max_files=4, min_segment=1 << 30))
    for workers in (1, 2, 3, 7):
        covered = []
        for share in _pieces(p, workers):
            for segment, offset, length in share:
                start = sum(s.bytes for s in p.segments[:segment]) + offset
                covered.append((start, start + length))
                assert offset % p.page_size == 0 and offset + length <= p.segments[segment].bytes
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == p.total_bytes
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
