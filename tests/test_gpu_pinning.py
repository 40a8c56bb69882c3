"""GPU tests: real CUDA registration, real copies, real failures (marked ``gpu``).

They run wherever an NVIDIA GPU is present and are deselected elsewhere (tests/conftest.py).
They need only the library, cuda-python, torch and pytest: torch and cuda-python are imported
inside the tests, so collecting this module on a CPU machine imports neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fixtures.pinning_pools import MiB, PoolFactory
from offloadpool.pinning import PinError, attach, get_backend
from offloadpool.pinning.backends.cuda_driver import CudaDriverBackend, load_driver

pytestmark = pytest.mark.gpu


def host_flags(addr: int) -> int | None:
    """``cuMemHostGetFlags``: the registration flags of a host address, None if unregistered."""
    drv = load_driver()
    backend = CudaDriverBackend()
    try:
        backend.activate()  # pushes a context for the query
        try:
            err, flags = drv.cuMemHostGetFlags(addr)
        finally:
            backend.deactivate()
        return int(flags) if int(getattr(err, "value", err)) == 0 else None
    finally:
        backend.close()


def torch_works() -> None:
    """A kernel launch, a copy and a sync: any pending or sticky CUDA error would surface here."""
    import torch

    x = torch.ones(1 << 20, device="cuda")
    y = (x * 2).sum()
    torch.cuda.synchronize()
    assert y.item() == 2 << 20


@pytest.fixture
def gpu_pool(make_pool: PoolFactory) -> Path:
    return make_pool("kv", capacity=256 * MiB, min_segment=64 * MiB)  # 4 segments of 64 MiB


@pytest.mark.parametrize("medium", ["Memory", "HugePages-2Mi"])
def test_cuda_registers_every_segment(make_pool: PoolFactory, medium: str) -> None:
    pool = make_pool("kv", capacity=256 * MiB, min_segment=64 * MiB, medium=medium)
    with attach(pool) as region:
        plan = region.plan()
        assert len({r.segment for r in plan}) == 4
        stats = region.pin("cuda")
        assert stats.backend == "cuda" and stats.bytes_registered == 256 * MiB
        assert stats.calls == len(plan)
        for r in plan:  # every registration is visible to the driver, portable
            flags = host_flags(region.address + r.offset)
            assert flags is not None and flags & 0x01, f"range at {r.offset} not registered"
        addr = region.address
    assert host_flags(addr) is None  # closing unregistered it (and the query error is harmless)
    torch_works()


def test_auto_picks_cuda_on_a_gpu_machine() -> None:
    backend = get_backend("auto")
    try:
        assert backend.name == "cuda"
    finally:
        backend.close()


def round_trip(view: Any) -> None:
    """Random bytes: the first half of the rows H2D, back D2H into the second half, row by row
    (each row is contiguous pinned memory, so these are real asynchronous DMA copies)."""
    import torch

    rows = view.shape[0]
    half = rows // 2
    src, dst = view[:half], view[half : 2 * half]
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
    dst.zero_()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_gpu = [src[i].to("cuda", non_blocking=True) for i in range(half)]
        for i in range(half):
            dst[i].copy_(on_gpu[i], non_blocking=True)
    stream.synchronize()
    assert torch.equal(src, dst)


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_round_trip_from_pinned_slot_views(make_pool: PoolFactory, backend: str) -> None:
    """Interleaved TP2 pool, rank 1: its strided slot view is pinned and copies byte-exact."""
    import torch

    pool = make_pool("kv", capacity=128 * MiB, layout_type="Interleaved", ranks=2, slot_bytes=1 * MiB)
    with attach(pool, rank=1) as region:
        stats = region.pin(backend)
        assert stats.bytes_registered == 64 * MiB  # slot-selective: its own half
        view = region.slot_view()
        assert view.shape == (64, 1 * MiB) and view.stride() == (2 * MiB, 1)
        assert view.data_ptr() == region.address + 1 * MiB
        assert view.is_pinned()  # torch asks about the storage's first byte: rank 1's slot 0
        assert host_flags(view[-1].data_ptr()) is not None
        round_trip(view)
        other = region.slot_view(rank=0)  # rank 0's slots: mapped but not pinned by rank 1
        assert not other.is_pinned() and host_flags(other[5].data_ptr()) is None
        wide = region.slot_view(dtype=torch.bfloat16)
        assert wide.shape == (64, 512 * 1024) and wide.dtype == torch.bfloat16
        del view, other, wide
    torch_works()


def test_round_trip_whole_region_tensor(gpu_pool: Path) -> None:
    import torch

    with attach(gpu_pool) as region:
        region.pin("cuda")
        flat = region.tensor()
        assert flat.is_pinned() and flat.numel() == 256 * MiB
        round_trip(flat.view(256, 1 * MiB))
        assert region.tensor(torch.float16).numel() == 128 * MiB
        del flat
    torch_works()


@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_failed_pin_rolls_back_and_leaves_no_sticky_error(gpu_pool: Path, backend: str) -> None:
    """Someone already registered our third chunk: pinning fails there with the driver's
    error, the two chunks before it are unregistered, and CUDA keeps working (no sticky or
    pending error); once the range is free again the same pin succeeds."""
    import torch

    torch.cuda.init()
    with attach(gpu_pool) as region:
        third = region.plan()[2]
        squatter = CudaDriverBackend()
        squatter.activate()
        squatter.register(region.address + third.offset, third.length)
        squatter.deactivate()
        try:
            with pytest.raises(PinError) as info:
                region.pin(backend)
            message = str(info.value)
            assert f"chunk offset {third.offset}" in message and "mnt/r0-s002" in message
            assert "rolled back 2 registered ranges" in message
            assert "(712)" in message  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, either API
            assert not region.pinned
            first = region.plan()[0]
            assert host_flags(region.address + first.offset) is None  # rolled back
            torch_works()
        finally:
            squatter.activate()
            squatter.unregister(region.address + third.offset, third.length)
            squatter.deactivate()
            squatter.close()
        stats = region.pin(backend)
        assert stats.bytes_registered == 256 * MiB
    torch_works()


def test_background_cuda_pin(gpu_pool: Path) -> None:
    with attach(gpu_pool) as region:
        future = region.pin("cuda", background=True)
        stats = future.result(timeout=300)
        assert stats.backend == "cuda" and region.pinned
        assert host_flags(region.address) is not None
    torch_works()
