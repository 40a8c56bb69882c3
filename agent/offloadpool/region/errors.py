"""Errors of the node-side region engine.

Every error a user can cause is raised before any memory is touched and names the numbers
involved, so an OffloadPoolNode's reason (or the CLI's last line) says what to change.
"""

from __future__ import annotations

from offloadpool.region.holding.lease import LeaseHeld

__all__ = ["RegionError", "RequestError", "CapacityError", "LeaseHeld", "fmt_bytes"]


class RegionError(RuntimeError):
    """Something about a pool's region is wrong; the message says what and why."""


class RequestError(RegionError, ValueError):
    """The requested pool cannot be planned (bad sizes, unknown medium, ...)."""


class CapacityError(RegionError):
    """The node lacks the memory or huge pages the pool needs; the message names the shortfall."""


def fmt_bytes(n: int) -> str:
    """``n`` in the largest binary unit that keeps it readable, plus the exact byte count."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit} ({n} bytes)"
    return f"{n} bytes"
