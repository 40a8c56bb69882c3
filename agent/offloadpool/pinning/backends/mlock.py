"""``mlock`` backend: real page locking with no GPU.

It is what CPU-only machines, CI and the start-up benchmark use: ``mlock`` walks and faults the
same page tables a GPU registration walks, so it measures the engine's attach-and-pin cost for
real. (hugetlbfs pages are never swapped and the kernel leaves them out of ``VmLck``; ``mlock``
still succeeds on them and costs almost nothing.)
"""

from __future__ import annotations

import resource
from collections.abc import Sequence

from offloadpool.pinning import libc
from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import BackendError

CAP_IPC_LOCK = 14


def _status_field(name: str) -> str | None:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return None


def locked_bytes() -> int:
    """This process's locked memory (``VmLck``), in bytes."""
    value = _status_field("VmLck") or "0 kB"
    return int(value.split()[0]) * 1024


def has_cap_ipc_lock() -> bool:
    """Whether RLIMIT_MEMLOCK applies at all (it does not to a process holding CAP_IPC_LOCK)."""
    value = _status_field("CapEff")
    return value is not None and bool(int(value, 16) >> CAP_IPC_LOCK & 1)


class MlockBackend(PinBackend):
    name = "mlock"

    def __init__(self, check_limit: bool = True) -> None:
        self.check_limit = check_limit

    def preflight(self, lengths: Sequence[int], accounted: bool) -> None:
        if not self.check_limit or has_cap_ipc_lock() or not lengths:
            return
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft == resource.RLIM_INFINITY:
            return
        already = locked_bytes()
        # The kernel checks each call against the limit; hugetlb pages are then not counted.
        need = sum(lengths) if accounted else max(lengths)
        if already + need > soft:
            raise BackendError(
                f"mlock of {need} bytes would exceed RLIMIT_MEMLOCK ({soft} bytes, {already} "
                f"already locked) and the process lacks CAP_IPC_LOCK: raise the memlock limit "
                f"of the container (ulimit -l) or grant CAP_IPC_LOCK"
            )

    def register(self, addr: int, length: int) -> None:
        try:
            libc.mlock(addr, length)
        except OSError as exc:
            raise BackendError(str(exc)) from exc

    def unregister(self, addr: int, length: int) -> None:
        try:
            libc.munlock(addr, length)
        except OSError as exc:
            raise BackendError(str(exc)) from exc
