"""Pinning backends and how ``"auto"`` picks one: cuda if usable, else torch, else mlock.

Backends that need optional libraries import them only when constructed, so importing the
helper never loads cuda-python or torch.
"""

from __future__ import annotations

from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import BackendUnavailable

NAMES = ("cuda", "torch", "mlock")


def get_backend(name: str, device: int = 0) -> PinBackend:
    """Construct the named backend (``"auto"``: the first usable of cuda, torch, mlock)."""
    if name == "auto":
        reasons = []
        for candidate in NAMES:
            try:
                return get_backend(candidate, device)
            except BackendUnavailable as exc:
                reasons.append(f"{candidate}: {exc}")
        raise BackendUnavailable("no pinning backend usable: " + "; ".join(reasons))
    if name == "cuda":
        from offloadpool.pinning.backends.cuda_driver import CudaDriverBackend

        return CudaDriverBackend(device)
    if name == "torch":
        from offloadpool.pinning.backends.torch_runtime import TorchRuntimeBackend

        return TorchRuntimeBackend(device)
    if name == "mlock":
        from offloadpool.pinning.backends.mlock import MlockBackend

        return MlockBackend()
    raise ValueError(f"unknown pinning backend {name!r}; choose auto, {', '.join(NAMES)}")


__all__ = ["NAMES", "PinBackend", "get_backend"]
