"""``torch`` backend: ``torch.cuda.cudart().cudaHostRegister``, for images without cuda-python.

The CUDA runtime remembers a failed call as the thread's "last error", which a later, unrelated
launch check then reports. So after any failed call this backend clears that state itself
(``cudaGetLastError`` of the libcudart torch loaded), and the error it raises names the chunk
and the runtime's own message. Prefer the ``cuda`` backend when cuda-python is available.
"""

from __future__ import annotations

import ctypes
from typing import Any

from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import BackendError, BackendUnavailable

CUDA_HOST_REGISTER_PORTABLE = 0x01


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart already loaded into this process (torch's), found via /proc/self/maps."""
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                path = line.split(maxsplit=5)[-1].strip()
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None


class TorchRuntimeBackend(PinBackend):
    name = "torch"

    def __init__(self, device: int = 0) -> None:
        try:
            import torch
        except ImportError as exc:
            raise BackendUnavailable(f"the torch backend needs torch: {exc}") from None
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch reports no usable CUDA device")
        self._torch = torch
        self._device = device
        self._cudart = torch.cuda.cudart()  # initialises CUDA in torch
        self._lib = _loaded_cudart()
        self._guard: Any = None

    def activate(self) -> None:
        """Select the device for this batch only (the engine's current device is restored)."""
        self._guard = self._torch.cuda.device(self._device)
        self._guard.__enter__()

    def deactivate(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(None, None, None)

    def _clear_last_error(self) -> str:
        if self._lib is None:
            return "; the runtime's last-error state could not be cleared (libcudart not found)"
        self._lib.cudaGetLastError()
        return ""

    def _check(self, fn: str, res: Any) -> None:
        code = int(res)
        if code != 0:
            try:
                text = self._cudart.cudaGetErrorString(res)
            except Exception:
                text = "CUDA runtime error"
            note = self._clear_last_error()
            raise BackendError(f"{fn} failed: {text} ({code}){note}")

    def register(self, addr: int, length: int) -> None:
        self._check(
            "cudaHostRegister", self._cudart.cudaHostRegister(addr, length, CUDA_HOST_REGISTER_PORTABLE)
        )

    def unregister(self, addr: int, length: int) -> None:
        self._check("cudaHostUnregister", self._cudart.cudaHostUnregister(addr))
