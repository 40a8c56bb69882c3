"""The start-up benchmark runs end to end and reports what the docs quote (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from fixtures.pinning_pools import MiB, run_python
from offloadpool.bench.startup import markdown, run
from offloadpool.region.memory import mounts

# the benchmark mounts its own tmpfs/hugetlbfs scratch pools and mlocks them
pytestmark = pytest.mark.root


def test_startup_bench_reports_every_case_and_cleans_up() -> None:
    result = run(64 * MiB, reps=1, media=["HugePages-2Mi", "Memory"], backend="mlock")
    assert result["backend"] == "mlock"
    assert set(result["cases"]) == {
        "engine_built",
        "attach_provisioned[HugePages-2Mi]",
        "attach_provisioned[Memory]",
    }
    assert set(result["per_medium"]) == {"HugePages-2Mi", "Memory"}
    assert result["best_medium"] in result["per_medium"]
    assert result["ratio_engine_built_vs_attach"] == result["per_medium"][result["best_medium"]]["ratio"]
    for name, case in result["cases"].items():
        assert case["seconds"] > 0 and case["pin_s"] > 0
        # engine_built runs once per medium block (the ratio compares runs made side by side)
        assert len(case["samples_s"]) == (2 if name == "engine_built" else 1)
    assert result["hugepages_restored"] is True
    assert not [m for m in mounts.mounts() if "offloadpool-bench-startup-" in m.target]
    text = markdown(result, "offloadpool bench startup --capacity 64Mi --reps 1")
    assert "ratio_engine_built_vs_attach" in text and "| Memory |" in text
    json.dumps(result)


def test_startup_bench_entry_point_prints_json() -> None:
    out = run_python(
        "from offloadpool.bench.startup import main; "
        "main(['--capacity', '64Mi', '--reps', '1', '--media', 'Memory', '--backend', 'mlock', '--json'])"
    )
    result = json.loads(out.stdout)
    assert result["per_medium"]["Memory"]["ratio"] > 0
    assert "registration_gib_per_s" in result["per_medium"]["Memory"]


def test_cli_subcommand() -> None:
    out = run_python(
        "import sys; from offloadpool.cli.main import main; "
        "sys.exit(main(['bench', 'startup', '--capacity', '64Mi', '--reps', '1', '--media', 'Memory', "
        "'--backend', 'mlock', '--json']))"
    )
    result = json.loads(out.stdout)
    assert result["best_medium"] == "Memory" and result["backend"] == "mlock"


def test_startup_bench_compares_per_rank_interleaved_and_whole_region_pinning() -> None:
    """Four worker processes pin their share of one pool per layout: per-rank pins its region,
    interleaved its slots by the engine's numbers, whole-region everything; pools are released."""
    cap, slot = 64 * MiB, 1280 << 10
    result = run(cap, reps=1, media=["Memory"], backend="mlock", ranks=4, slot=slot)
    lay = result["layouts"]
    assert (lay["medium"], lay["ranks"], lay["slot_bytes"]) == ("Memory", 4, slot)
    pinned = {name: m["bytes_per_worker"] for name, m in lay["layouts"].items()}
    assert pinned == {
        "per_rank": [cap // 4] * 4,
        "interleaved": [(cap // (4 * slot)) * slot] * 4,  # 12 rows of this worker's 1280 KiB
        "whole_region": [cap] * 4,
    }
    assert set(lay["ratios"]) == {
        "whole_region_vs_per_rank",
        "interleaved_vs_per_rank",
        "whole_region_vs_interleaved",
    }
    assert all(m["seconds"] > 0 for m in lay["layouts"].values())
    assert not [m for m in mounts.mounts() if "offloadpool-bench-startup-" in m.target]
    text = markdown(result, "offloadpool bench startup --capacity 64Mi --reps 1 --media Memory")
    assert "| per_rank |" in text and "whole_region / per_rank" in text
