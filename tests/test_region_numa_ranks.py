"""NUMA-local ranks: a PerRank pool's region r on a chosen node, listed per rank
(``spec.prefault.numaNodes``) or taken from the node's GPUs (``numa: GPU``), refused before any
memory is touched when a node is not there, shown in status, checked by the engine at attach.

Where pages are is read back from the kernel by another route than the code uses
(``/proc/self/numa_maps`` here, ``get_mempolicy`` in ``region.memory.numa_check``). This machine has
one NUMA node, so placement is on node 0; a node that is not online is the refusal case.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fixtures.host import cli, hugepage_totals, private_mounts_python
from offloadpool.api.conversion import pool_request
from offloadpool.api.pool import OffloadPool
from offloadpool.cli.render import placement
from offloadpool.pinning import attach
from offloadpool.region.errors import RequestError
from offloadpool.region.files.manifest import load as load_manifest
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.status import pool_state
from offloadpool.region.memory import gpus, numa, numa_check
from offloadpool.region.memory.numa import online_nodes
from offloadpool.region.request import PoolRequest
from test_region_numa import numa_maps_line

MiB = 1 << 20


def per_rank_pool(name: str, nodes: list[int], medium: str = "Memory", **prefault: object) -> PoolRequest:
    """A PerRank pool of ``len(nodes)`` ranks through the API model and its one conversion."""
    body = {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPool",
        "metadata": {"name": name},
        "spec": {
            "capacity": f"{16 * len(nodes)}Mi",
            "medium": medium,
            "layout": {"type": "PerRank", "ranks": len(nodes)},
            "prefault": {"numaNodes": nodes, **prefault},
        },
    }
    return pool_request(OffloadPool.model_validate(body))


def node_counts(line: str) -> dict[int, int]:
    """``N<node>=<pages>`` of a numa_maps line."""
    return {
        int(tok[1:].split("=")[0]): int(tok.split("=")[1])
        for tok in line.split()
        if tok[:1] == "N" and "=" in tok
    }


# -- listed per rank ----------------------------------------------------------------------------
@pytest.mark.parametrize("medium", ["Memory", "MemoryTHP", "HugePages-2Mi"])
def test_listed_nodes_place_each_rank_region_there(region_root, hugepage_baseline, medium):
    req = per_rank_pool("ranks", [0, 0, 0], medium)
    assert req.numa == "ranks:0,0,0"
    result = provision(req, region_root)
    manifest = result.manifest
    assert manifest.extra["numa_nodes"] == [[0], [0], [0]]
    assert manifest.extra["numa_policy"] == "ranks:0,0,0"
    assert [list(n) for n in pool_state(region_root, req.name).numa_nodes] == [[0], [0], [0]]
    for region in manifest.regions:
        seg = region.segments[0]
        line = numa_maps_line(region_root / req.name / seg.file, seg.bytes)
        if medium != "HugePages-2Mi":
            assert "bind:0" in line, line  # the file's shared policy: bound, not the default
        counts = node_counts(line)
        assert counts and set(counts) == {0}, line  # every page read back is on node 0
    release(region_root, req.name)


def test_a_node_not_online_is_refused_before_memory_is_touched(region_root, hugepage_baseline):
    bad = max(online_nodes()) + 1
    req = per_rank_pool("ranks", [0, bad], "HugePages-2Mi")
    with pytest.raises(RequestError, match=f"puts region 1 on node {bad}, which is not online"):
        provision(req, region_root)
    assert list(region_root.iterdir()) == []
    assert hugepage_totals() == hugepage_baseline  # no huge page reserved, none taken


def test_a_list_of_the_wrong_length_is_refused_by_the_engine_too(region_root):
    """The API refuses it (tests/crd_cases.py); a pool file or request made otherwise as well."""
    req = PoolRequest(
        name="ranks", capacity=64 * MiB, medium="Memory", layout_type="PerRank", ranks=4, numa="ranks:0,0"
    )
    with pytest.raises(RequestError, match=r"lists 2 node\(s\), one per region, but the pool has 4 region"):
        provision(req, region_root)
    assert list(region_root.iterdir()) == []


@pytest.mark.parametrize("text", ["ranks:", "ranks:0,x", "ranks:0,-1", "ranks:0,1024", "0-99999999999"])
def test_malformed_policies_are_refused(text):
    with pytest.raises(RequestError):
        numa.parse_policy(text)


# -- from the node's GPUs -----------------------------------------------------------------------
def pci_tree(root: Path, devices: dict[str, tuple[int, int, int]]) -> Path:
    """A sysfs tree at ``root`` with PCI devices ``bus id -> (vendor, class, numa_node)``."""
    base = root / "bus" / "pci" / "devices"
    for bus_id, (vendor, cls, node) in devices.items():
        d = base / bus_id
        d.mkdir(parents=True)
        (d / "vendor").write_text(f"0x{vendor:04x}\n")
        (d / "class").write_text(f"0x{cls:06x}\n")
        (d / "numa_node").write_text(f"{node}\n")
    return root


#: Two sockets: GPUs on both, listed out of bus order, among what sysfs also holds.
EIGHT_WAY = {
    "0000:cb:00.0": (0x10DE, 0x030200, 1),
    "0000:1b:00.0": (0x10DE, 0x030200, 0),
    "0000:db:00.0": (0x10DE, 0x030200, 1),
    "0000:43:00.0": (0x10DE, 0x030000, 0),  # a VGA-class NVIDIA GPU counts too
    "0000:1b:00.1": (0x10DE, 0x040300, 0),  # the GPU's audio function: not a GPU
    "0000:05:00.0": (0x10DE, 0x068000, 0),  # an NVSwitch: not a GPU
    "0000:00:02.0": (0x8086, 0x030000, 0),  # another vendor's display controller
    "0001:0a:00.0": (0x10DE, 0x030200, -1),  # another domain, no node from the firmware
}


def test_gpus_are_the_nvidia_display_functions_in_bus_order(tmp_path):
    found = gpus.node_gpus(pci_tree(tmp_path, EIGHT_WAY))
    assert [(g.bus_id, g.numa_node) for g in found] == [
        ("0000:1b:00.0", 0),
        ("0000:43:00.0", 0),
        ("0000:cb:00.0", 1),
        ("0000:db:00.0", 1),
        ("0001:0a:00.0", None),
    ]
    assert gpus.gpu_numa_node("0000:CB:00.0", tmp_path) == 1  # as CUDA spells it
    assert gpus.gpu_numa_node(gpus.pci_address(0, 0xCB, 0), tmp_path) == 1  # torch's numbers
    assert gpus.pci_address(1, 0x0A, 0) == "0001:0a:00.0"
    assert gpus.gpu_numa_node("00000000:db:00.0", tmp_path) == 1  # nvidia-smi's 8-digit domain
    assert gpus.gpu_numa_node("0000:1b:00.1", tmp_path) is None  # not a GPU
    assert gpus.node_gpus(tmp_path / "absent") == []


def test_gpu_policy_places_region_r_by_the_r_th_gpu(tmp_path):
    sysfs = pci_tree(tmp_path, EIGHT_WAY)
    resolved = numa.resolve(numa.parse_policy("GPU"), 5, sysfs)
    assert resolved == numa.Policy(numa.RANKS, (0, 0, 1, 1, numa.NO_NODE))
    assert numa.resolve(numa.parse_policy("Spread"), 5, sysfs) == numa.Policy("Spread")  # others as given
    with pytest.raises(RequestError, match=r"this node has 5 GPU\(s\) \(0000:1b:00.0, .*\) for 6 region"):
        numa.resolve(numa.parse_policy("GPU"), 6, sysfs)


def test_gpu_policy_on_this_machine(region_root, hugepage_baseline):
    """Through the real /sys: a node without enough NVIDIA GPUs fails the pool before anything
    exists (this machine has none); with enough, region r is placed by GPU r."""
    here = gpus.node_gpus()
    req = PoolRequest(
        name="bygpu", capacity=64 * MiB, medium="Memory", layout_type="PerRank", ranks=2, numa="GPU"
    )
    if len(here) < 2:
        with pytest.raises(RequestError, match=rf"this node has {len(here)} GPU\(s\)"):
            provision(req, region_root)
        assert list(region_root.iterdir()) == []
        assert hugepage_totals() == hugepage_baseline
    else:
        provision(req, region_root)
        expected = [[] if g.numa_node is None else [g.numa_node] for g in here[:2]]
        assert [list(n) for n in pool_state(region_root, req.name).numa_nodes] == expected
        release(region_root, req.name)


#: In a mount namespace of its own: a scratch PCI tree over /sys/bus/pci/devices, a GPU-placed
#: pool provisioned through the real code path (``/sys`` as the agent reads it), its placement
#: and pages read back, released. argv: root, pci tree.
_GPU_NAMESPACE = """
import json, subprocess, sys
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.request import PoolRequest
from offloadpool.region.lifecycle.status import pool_state
sys.path.insert(0, "tests")
from test_region_numa import numa_maps_line
root, tree = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "--bind", tree, "/sys/bus/pci/devices"], check=True)
req = PoolRequest(
    name="bygpu", capacity=64 * 2**20, medium="Memory", layout_type="PerRank", ranks=2, numa="GPU"
)
result = provision(req, root)
segs = [r.segments[0] for r in result.manifest.regions]
lines = [numa_maps_line(f"{root}/bygpu/{s.file}", s.bytes) for s in segs]
state = [list(n) for n in pool_state(root, "bygpu").numa_nodes]
print(json.dumps({"extra": result.manifest.extra, "state": state, "lines": lines}))
release(root, "bygpu")
"""


def test_gpu_policy_reads_the_node_s_gpus_where_the_agent_does(region_root, tmp_path):
    tree = pci_tree(
        tmp_path / "sys",
        {"0000:3b:00.0": (0x10DE, 0x030200, -1), "0000:1a:00.0": (0x10DE, 0x030200, 0)},
    )
    out = subprocess.run(
        private_mounts_python(_GPU_NAMESPACE, str(region_root), str(tree / "bus" / "pci" / "devices")),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    # bus order: region 0 by 0000:1a:00.0 (node 0), region 1 by 0000:3b:00.0 (no node: default)
    assert seen["extra"]["numa_nodes"] == [[0], []] and seen["state"] == [[0], []]
    assert seen["extra"]["numa_policy"] == "GPU"
    assert "bind:0" in seen["lines"][0] and "default" in seen["lines"][1], seen["lines"]
    assert not (region_root / "bygpu").exists(), list(region_root.iterdir())  # released in there


# -- shown ----------------------------------------------------------------------------------------
def test_the_cli_takes_a_list_and_shows_the_placement(region_root):
    args = ("--name", "clinuma", "--capacity", "32Mi", "--medium", "Memory", "--layout", "PerRank")
    out = cli("provision", *args, "--ranks", "2", "--numa-nodes", "0,0", "--root", str(region_root))
    assert "r0:0 r1:0" in out.stdout, out.stdout  # the summary's NUMA placement row
    shown = cli("status", "--root", str(region_root)).stdout
    assert "numa" in shown and "r0:0 r1:0" in shown, shown
    wrong = cli(
        "provision", *args, "--ranks", "2", "--numa-nodes", "0", "--root", str(region_root), check=False
    )
    assert wrong.returncode == 2 and "spec.prefault.numaNodes" in wrong.stderr + wrong.stdout, wrong
    cli("release", "clinuma", "--root", str(region_root))


def test_the_placement_is_written_region_by_region():
    assert placement([[0], [0], [1], [1]]) == "r0:0 r1:0 r2:1 r3:1"
    assert placement([[0], []]) == "r0:0 r1:*"
    assert placement([[0, 1]]) == "r0:0,1"
    assert placement([[], []]) == "-" and placement(None) == "-"


# -- the engine's check at attach -------------------------------------------------------------------
def rewrite_recorded(pool_dir: Path, nodes: object) -> None:
    """Change what the manifest records as the placement (a pod can write this file)."""
    manifest = load_manifest(pool_dir)
    path = pool_dir / "manifest.json"
    doc = json.loads(path.read_text())
    doc["extra"]["numa_nodes"] = nodes
    assert manifest.extra["numa_nodes"] != nodes
    path.write_text(json.dumps(doc))


def test_attach_checks_where_the_pages_are(region_root, caplog):
    req = per_rank_pool("check", [0, 0])
    provision(req, region_root)
    pool_dir = region_root / req.name
    caplog.set_level(logging.WARNING, logger="offloadpool")

    with attach(pool_dir, rank=1) as region:  # placed as recorded, on this process's node
        assert numa_check.page_nodes(region.address, region.size, region.page_size) == {0: 64}
    assert caplog.records == []

    with attach(pool_dir, rank=1, gpu_numa_node=1):  # the caller's GPU is elsewhere: warned
        pass
    assert len(caplog.records) == 1, caplog.text
    assert "pool 'check' region 1 is not local to this process's GPU (NUMA node 1)" in caplog.text
    assert "64 of 64 sampled pages on node 0" in caplog.text
    caplog.clear()

    rewrite_recorded(pool_dir, [[0], [3]])  # the record says node 3; the pages are on node 0
    with attach(pool_dir, rank=1) as region:
        assert region.memoryview()[0] == 0  # attached all the same: a warning, never a refusal
    assert len(caplog.records) == 1, caplog.text
    assert "region 1 was placed on NUMA node(s) [3], but 64 of 64 sampled pages on node 0" in caplog.text
    caplog.clear()

    rewrite_recorded(pool_dir, "node three")  # what cannot be read is ignored, not trusted
    with attach(pool_dir, rank=0):
        pass
    assert caplog.records == []
    release(region_root, req.name)


def test_the_check_never_raises():
    """An address with no mapping: the check finds nothing and says so at debug level."""
    from offloadpool.region.files.manifest import Layout, Manifest, Region, Segment

    region = Region(0, 4096, (Segment("mnt/r0-s000", 0, 4096),), rank=0)
    manifest = Manifest(
        pool="gone",
        generation=1,
        medium="Memory",
        page_size=4096,
        layout=Layout("PerRank", 1),
        regions=(region,),
        total_bytes=4096,
        alignment=4096,
        extra={"numa_nodes": [[1]]},
    )
    with pytest.raises(OSError):
        numa_check.page_node(8)
    assert numa_check.check(manifest, region, 8) == []


def test_cpu_nodes_are_those_of_the_allowed_cpus():
    assert numa_check.cpu_nodes() == set(online_nodes())  # unpinned: every node with CPUs here
    code = (
        "import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from offloadpool.region.memory.numa_check import cpu_nodes; print(sorted(cpu_nodes()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0]"


def test_a_process_on_other_cpus_than_its_placed_region_is_warned():
    """The CPU side of the check, for a placement this one-node machine cannot make: a region
    bound to node 1 read by a process that may run on node 0's CPUs only."""
    on_one = Counter({1: 64})
    found = numa_check.mismatches("pool 'p' region 0", [1], on_one, cpus_on={0})
    assert found == [
        "pool 'p' region 0 is on NUMA node(s) [1], but this process runs on CPUs of node(s) [0] only: "
        "copies cross the socket link"
    ]
    assert numa_check.mismatches("r", [1], on_one, cpus_on={0, 1}) == []  # may run by it
    assert numa_check.mismatches("r", [], on_one, cpus_on={0}) == []  # no placement was promised
    assert numa_check.mismatches("r", [1], on_one, gpu_node=1, cpus_on={0}) == []  # its GPU is by it
    spread = Counter({0: 32, 1: 32})
    assert numa_check.mismatches("r", [0, 1], spread, gpu_node=1) == []  # Interleave: spread on purpose
    assert len(numa_check.mismatches("r", [], spread, gpu_node=1)) == 1  # left to the kernel: told
