"""What a pinning backend is: register and unregister host ranges, one call each."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class PinBackend(ABC):
    """Registers host memory ranges so a device can DMA to and from them.

    ``register``/``unregister`` raise ``BackendError`` whose message carries the driver's or
    the kernel's own error. The orchestration (chunk order, per-file locks, rollback) lives in
    ``offloadpool.pinning.pin``; a backend only knows how to make one call.
    """

    name: str = "?"

    def preflight(self, lengths: Sequence[int], accounted: bool) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Refuse, before any memory is touched, a plan that cannot succeed (default: accept).

        ``accounted`` is False for hugetlbfs memory, which the kernel never counts as locked.
        """

    def activate(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Prepare the calling thread for a batch of calls (make a CUDA context current).

        Paired with ``deactivate``, which restores whatever the thread had before, so pinning
        from the engine's own thread never changes its current context or device.
        """

    def deactivate(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Undo ``activate``."""

    @abstractmethod
    def register(self, addr: int, length: int) -> None: ...

    @abstractmethod
    def unregister(self, addr: int, length: int) -> None: ...

    def close(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Release what the backend itself holds (a retained CUDA context)."""
