"""Small shared helpers for benchmarks: medians with spread, and a description of the machine."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Summary:
    median: float
    minimum: float
    maximum: float
    samples: tuple[float, ...]

    @property
    def spread_percent(self) -> float:
        """(max - min) / median, in percent."""
        return 100.0 * (self.maximum - self.minimum) / self.median if self.median else 0.0


def summarize(samples: list[float]) -> Summary:
    return Summary(statistics.median(samples), min(samples), max(samples), tuple(samples))


def _first(path: str, key: str) -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


#: Free page reporting (virtio-balloon): a VM hands freed memory back to its host, which must
#: back it again at the next touch. Its knobs say how soon (``min_free_ms`` exists only on
#: some hypervisors' kernels), so a run records them.
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def _page_reporting() -> str:
    """``knob=value`` for each knob this kernel has; empty when it does not report at all."""
    out = []
    for knob in ("page_reporting_order", "min_free_ms"):
        try:
            out.append(f"{knob}={(PAGE_REPORTING / knob).read_text().strip()}")
        except OSError:
            pass
    return " ".join(out)


def machine() -> dict:
    """What the numbers were measured on (CPU, cores, memory, kernel, VM or not, THP, NUMA,
    free page reporting)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        thp = ""
    try:
        nodes = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        nodes = "0"
    return {
        "cpu": _first("/proc/cpuinfo", "model name"),
        "cores": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(int(_first("/proc/meminfo", "MemTotal").split()[0]) / (1 << 20), 1),
        "kernel": platform.release(),
        "virtual_machine": " hypervisor" in cpuinfo,
        "python": platform.python_version(),
        "shmem_thp": thp,
        "numa_nodes": nodes,
        "free_page_reporting": _page_reporting(),
    }
