"""Errors the pinning helper raises, each saying what to do about it."""

from __future__ import annotations

from offloadpool.region.files.manifest import ManifestError


class AttachError(ManifestError):
    """The pool on disk does not match its manifest, or the request does not fit the pool.

    A subclass of ``ManifestError`` so one ``except ManifestError`` covers every refusal to
    attach; raised before anything is mapped, and nothing is left mapped or locked after it.
    """


class BackendUnavailable(RuntimeError):
    """A pinning backend cannot be used in this process (library missing, no GPU, no driver)."""


class BackendError(RuntimeError):
    """One registration or unregistration call failed; the message carries the driver's error."""


class PinError(RuntimeError):
    """Pinning failed part-way and was rolled back: nothing this call registered stays registered.

    ``offset``/``length`` locate the chunk that failed (bytes from the start of the
    attachment), ``segment`` names its file, ``backend`` the backend used.
    """

    def __init__(
        self,
        message: str,
        *,
        offset: int | None = None,
        length: int | None = None,
        segment: str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(message)
        self.offset = offset
        self.length = length
        self.segment = segment
        self.backend = backend
