"""The node's NVIDIA GPUs in the order engines number them, each with its NUMA node (sysfs).

A pool placed by its GPUs (``numa: GPU``) puts region r on the memory node of the r-th GPU.
The order is PCI bus id order: what ``nvidia-smi`` lists, what CUDA numbers with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and by default on a node of identical GPUs, where "fastest
first" ties are broken by bus id). The GPUs are read from sysfs, not from the driver, so the
agent needs neither a GPU of its own nor the NVIDIA libraries: every PCI function of vendor
0x10de whose class is a display controller (VGA 0x0300 or 3D 0x0302) is a GPU; NVIDIA's audio
functions and NVSwitches are other classes and are left out.

sysfs shows every PCI device of the host, also inside a container, so the list is the node's
GPUs, not the ones a pod was given; ``docs/node-engine.md`` says what that means for a pod given
a subset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Where sysfs is mounted; tests give a directory tree of their own.
SYSFS = Path("/sys")
NVIDIA_VENDOR = 0x10DE
#: PCI base class + subclass of a GPU: VGA compatible (0x0300), 3D controller (0x0302)
GPU_CLASSES = (0x0300, 0x0302)
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class Gpu:
    """One GPU: its PCI address (``0000:3b:00.0``) and NUMA node (None: the firmware gives
    none, as on one-node machines and most VMs, where sysfs says -1)."""

    bus_id: str
    numa_node: int | None


def _bus_key(bus_id: str) -> tuple[int, ...] | None:
    match = _BUS_ID.match(bus_id)
    return None if match is None else tuple(int(part, 16) for part in match.groups())


def _read_int(path: Path, base: int) -> int | None:
    try:
        return int(path.read_text().strip(), base)
    except (OSError, ValueError):
        return None


def node_gpus(sysfs: str | Path = SYSFS) -> list[Gpu]:
    """The node's NVIDIA GPUs in PCI bus id order (empty when there are none or no PCI bus)."""
    devices = Path(sysfs) / "bus" / "pci" / "devices"
    try:
        entries = list(devices.iterdir())
    except OSError:
        return []
    found: list[tuple[tuple[int, ...], Gpu]] = []
    for entry in entries:
        key = _bus_key(entry.name)
        if key is None or _read_int(entry / "vendor", 16) != NVIDIA_VENDOR:
            continue
        cls = _read_int(entry / "class", 16)
        if cls is None or cls >> 8 not in GPU_CLASSES:
            continue
        node = _read_int(entry / "numa_node", 10)
        found.append((key, Gpu(entry.name, node if node is not None and node >= 0 else None)))
    return [gpu for _key, gpu in sorted(found, key=lambda item: item[0])]


def pci_address(domain: int, bus: int, device: int, function: int = 0) -> str:
    """The sysfs name of a PCI function, from the numbers CUDA reports for a device (torch:
    ``p = torch.cuda.get_device_properties(i)``; ``pci_address(p.pci_domain_id, p.pci_bus_id,
    p.pci_device_id)``): the device the engine really uses, whatever the pod's renumbering."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def gpu_numa_node(bus_id: str, sysfs: str | Path = SYSFS) -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (as CUDA or torch report it, any case, with a
    4- or 8-digit domain), or None when sysfs gives none. For an engine's own GPU check."""
    key = _bus_key(bus_id.strip())
    if key is None:
        return None
    for gpu in node_gpus(sysfs):
        if _bus_key(gpu.bus_id) == key:
            return gpu.numa_node
    return None
