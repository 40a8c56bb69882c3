"""Stock vLLM given a compat pool but running under another engine id: found from ``/proc``.

Why this exists: stock vLLM looks for ``/dev/shm/vllm_offload_<engine_id>.mmap``. When the
engine's ``kv_transfer_config.engine_id`` differs from the pool's ``compat.vllm.engineId``
(most often the ``_dp<rank>`` suffix vLLM appends under data parallelism), vLLM finds nothing
under its name, creates, pre-faults and maps a region of its own in the pod's ``/dev/shm`` and
unlinks its names — no error anywhere, the pool unused, the node's memory spent twice.

The kernel still shows it. Such an engine's processes

* see the pool: their mount namespace holds a mount of the pool's file system (the admission
  webhook's bind mounts of the pool's files; ``/proc/<pid>/mountinfo`` names the device as
  decimal ``major:minor``), and
* map a file named ``vllm_offload_<id>.mmap[.N]`` (``(deleted)`` once vLLM unlinked it) that is
  not one of the pool's files (``/proc/<pid>/maps``: hex ``major:minor`` and inode) nor a file of
  another pool under the same host root.

Both together name the process and the engine id it actually used. Matching is by device and
inode, never by path (paths differ in every mount namespace); see ``holders`` for the same
reading of ``/proc`` and why the agent needs the host's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from offloadpool.region.files.manifest import MOUNT_NAME
from offloadpool.region.holding.holders import command_name, memory_files, parse_dev, self_pid

#: a stock vLLM region file, as its maps line names it: ``…/vllm_offload_<id>.mmap[.N][ (deleted)]``
_VLLM_FILE = re.compile(r"/vllm_offload_(?P<id>.+?)\.mmap(?:\.\d+)?(?: \(deleted\))?$")
#: how many mismatches a message names before it says "and N more"
_NAMED = 3


@dataclass(frozen=True)
class Mismatch:
    """One process that was given the pool but maps a vLLM region of its own."""

    pid: int
    comm: str
    engine_id: str  # the id in the name of the region it maps instead


def _device(path: Path) -> int | None:
    """The device of ``path`` itself: a link a pod put at a pool's ``mnt`` is not followed."""
    try:
        return os.stat(path, follow_symlinks=False).st_dev
    except OSError:
        return None


def _pool_devices(root: Path) -> set[int]:
    """Devices of every pool mount under the host root (any of them is a pool, not a stray
    region): a process that legitimately uses another compat pool is not a mismatch."""
    devices: set[int] = set()
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                dev = _device(Path(entry.path) / MOUNT_NAME)
                if dev is not None and dev != _device(Path(entry.path)):
                    devices.add(dev)  # a mount point, not a plain directory
    except OSError:
        pass
    return devices


def _stray_regions(proc: str, pid: int, ours: set[tuple[int, int]], pools: set[int]) -> set[str]:
    """Engine ids of the vLLM region files ``pid`` maps that no pool provides."""
    ids: set[str] = set()
    with open(f"{proc}/{pid}/maps") as fh:
        for line in fh:
            if "vllm_offload_" not in line:
                continue  # cheap: most lines of most processes
            parts = line.rstrip("\n").split(None, 5)
            if len(parts) < 6:
                continue
            found = _VLLM_FILE.search(parts[5])
            if found is None:
                continue
            try:
                dev, ino = parse_dev(parts[3]), int(parts[4])
            except ValueError:
                continue
            if (dev, ino) not in ours and dev not in pools:
                ids.add(found["id"])
    return ids


def _sees(proc: str, pid: int, device: int) -> bool:
    """True if the process's mount namespace holds a mount of ``device``."""
    want = f"{os.major(device)}:{os.minor(device)}"
    with open(f"{proc}/{pid}/mountinfo") as fh:
        return any(line.split(None, 3)[2] == want for line in fh)


def find(pool_dir: str | os.PathLike[str], *, proc: str = "/proc") -> list[Mismatch]:
    """Processes that see the pool at ``pool_dir`` yet map a vLLM region of their own."""
    pool_dir = Path(pool_dir)
    device = _device(pool_dir / MOUNT_NAME)
    ours = memory_files(pool_dir)
    if device is None or not ours:
        return []
    pools = _pool_devices(pool_dir.parent) | {device}
    me = self_pid(proc)
    found: list[Mismatch] = []
    try:
        pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
    except FileNotFoundError:
        return []
    for pid in pids:
        if pid == me:
            continue
        try:
            ids = _stray_regions(proc, pid, ours, pools)
            if ids and _sees(proc, pid, device):
                found.extend(Mismatch(pid, command_name(proc, pid), engine_id) for engine_id in sorted(ids))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited during the scan, or not ours to read
    return found


def describe(mismatches: list[Mismatch], pool_engine_id: str) -> str:
    """One line for status and events: who, which id it used, which id the pool serves, and
    what to change."""
    used = sorted({m.engine_id for m in mismatches})
    named = "; ".join(
        f"pid {m.pid} ({m.comm}) maps vllm_offload_{m.engine_id}.mmap" for m in mismatches[:_NAMED]
    )
    more = len(mismatches) - _NAMED
    if more > 0:
        named += f"; and {more} more"
    quoted = ", ".join(f'"{u}"' for u in used)
    return (
        f"engine id mismatch: {named} — a region of its own, not this pool's "
        f"vllm_offload_{pool_engine_id}.mmap, so the pool stays unused and the node's memory is "
        f"spent twice; the engine runs with kv_transfer_config.engine_id {quoted} but the pool's "
        f'compat.vllm.engineId is "{pool_engine_id}" (under data parallelism vLLM appends '
        f"_dp<rank>: give each DP rank a pool named for its id)"
    )
