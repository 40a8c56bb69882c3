"""Backend choice: "auto" takes the first usable of cuda, torch, mlock; clear errors otherwise."""

from __future__ import annotations

import pytest

from offloadpool.pinning import BackendUnavailable, get_backend
from offloadpool.pinning.backends import NAMES


def usable(name: str) -> bool:
    try:
        get_backend(name).close()
    except BackendUnavailable:
        return False
    return True


def test_auto_takes_the_first_usable_backend() -> None:
    expected = next(name for name in NAMES if usable(name))
    backend = get_backend("auto")
    try:
        assert backend.name == expected
    finally:
        backend.close()


def test_mlock_is_always_usable_on_linux() -> None:
    assert usable("mlock")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown pinning backend 'nvme'; choose auto, cuda, torch, mlock"):
        get_backend("nvme")


def test_unusable_backend_says_why() -> None:
    for name in ("cuda", "torch"):
        try:
            get_backend(name).close()
        except BackendUnavailable as exc:
            assert str(exc), f"{name} unavailable without a reason"
