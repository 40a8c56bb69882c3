"""``cuda`` backend: ``cuMemHostRegister`` through the CUDA driver API (cuda-python).

Why the driver API and not the runtime's ``cudaHostRegister``: a failed runtime call records
an error that a later, unrelated runtime call (a kernel launch check) reports, far from the
cause. A driver API call just returns its status. Registration uses
``CU_MEMHOSTREGISTER_PORTABLE`` so the pinned range counts as pinned in every CUDA context of
the process, whichever device the engine uses.

cuda-python moved its driver module: ``cuda.bindings.driver`` (12.6+, 13.x) and the older
``cuda.cuda``; both are supported. Imported only when this backend is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import BackendError, BackendUnavailable

CU_MEMHOSTREGISTER_PORTABLE = 0x01


def load_driver() -> Any:
    """Return cuda-python's driver module, whichever version is installed."""
    errors = []
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise BackendUnavailable(
        "the cuda backend needs cuda-python (pip install 'offloadpool[cuda]'); " + "; ".join(errors)
    )


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


class CudaDriverBackend(PinBackend):
    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        self._drv = load_driver()
        try:
            self._call("cuInit", 0)
            (count,) = self._call("cuDeviceGetCount")
        except BackendError as exc:
            raise BackendUnavailable(f"CUDA driver not usable: {exc}") from None
        except Exception as exc:  # cuda-python raises if libcuda.so itself is missing
            raise BackendUnavailable(f"CUDA driver not usable: {exc!r}") from None
        if count < 1:
            raise BackendUnavailable("CUDA driver reports no device")
        if not 0 <= device < count:
            raise BackendUnavailable(f"CUDA device {device} does not exist ({count} visible)")
        (self._dev,) = self._call("cuDeviceGet", device)
        (self._ctx,) = self._call("cuDevicePrimaryCtxRetain", self._dev)
        self._flags = getattr(self._drv, "CU_MEMHOSTREGISTER_PORTABLE", CU_MEMHOSTREGISTER_PORTABLE)

    def _error_name(self, err: Any) -> str:
        try:
            res = self._drv.cuGetErrorName(err)
            name = res[1] if isinstance(res, tuple) else res
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # never let error reporting hide the error
            return "CUDA error"

    def _call(self, fn: str, *args: Any) -> tuple[Any, ...]:
        """Call a driver function; raise BackendError naming it and the CUresult on failure."""
        res = getattr(self._drv, fn)(*args)
        res = res if isinstance(res, tuple) else (res,)
        err, values = res[0], res[1:]
        if _code(err) != 0:
            raise BackendError(f"{fn} failed: {self._error_name(err)} ({_code(err)})")
        return values

    def activate(self) -> None:
        """Push the retained primary context for this batch of calls.

        Pushing (rather than setting) leaves the thread's own context stack as it was after
        ``deactivate``; with ``CU_MEMHOSTREGISTER_PORTABLE`` the registration holds in every
        context of the process anyway, whichever device the engine itself uses.
        """
        self._call("cuCtxPushCurrent", self._ctx)

    def deactivate(self) -> None:
        self._call("cuCtxPopCurrent")

    def register(self, addr: int, length: int) -> None:
        self._call("cuMemHostRegister", addr, length, self._flags)

    def unregister(self, addr: int, length: int) -> None:
        self._call("cuMemHostUnregister", addr)

    def close(self) -> None:
        if getattr(self, "_ctx", None) is not None:
            self._ctx = None
            try:
                self._call("cuDevicePrimaryCtxRelease", self._dev)
            except Exception:  # interpreter shutdown may already have torn cuda-python down
                pass
