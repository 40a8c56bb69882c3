"""The engine-side pinning helper: attach a node-provisioned pool, pin it, hand out views.

Standard library only; cuda-python and torch are imported lazily, by the backends and views
that need them, so ``import offloadpool.pinning`` is safe in any inference image::

    from offloadpool.pinning import attach
    with attach("/var/lib/offloadpool/kv", rank=0) as region:
        stats = region.pin(backend="auto")     # cuda, else torch, else mlock
        kv = region.slot_view(dtype=torch.bfloat16)
"""

from offloadpool.pinning.attach import Attachment, attach
from offloadpool.pinning.backends import get_backend
from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import AttachError, BackendError, BackendUnavailable, PinError
from offloadpool.pinning.pin import PinCancelled, PinRange, PinStats
from offloadpool.pinning.plan import DEFAULT_MAX_CHUNK, DEFAULT_MAX_RANGES, PinGeometry, plan_pin_ranges
from offloadpool.region.files.manifest import ManifestError

__all__ = [
    "AttachError",
    "Attachment",
    "BackendError",
    "BackendUnavailable",
    "DEFAULT_MAX_CHUNK",
    "DEFAULT_MAX_RANGES",
    "ManifestError",
    "PinBackend",
    "PinCancelled",
    "PinError",
    "PinGeometry",
    "PinRange",
    "PinStats",
    "attach",
    "get_backend",
    "plan_pin_ranges",
]
