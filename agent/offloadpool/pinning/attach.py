"""Attach a provisioned pool: validate, take the lease, map every segment into one range.

The order matters:

1. read the manifest and refuse what cannot work (unknown version, not Ready, rank out of
   range) with an error that says why, before anything is created, mapped or locked;
2. take the shared lease, so the node cannot re-provision the region under us, and read the
   manifest again under it (the node may have changed it between 1 and 2);
3. open every segment and check it against the manifest (present, regular file, exact size);
4. reserve one contiguous range and map the segments into it back to back.

A failure at any step undoes the earlier ones: nothing stays mapped, open or leased.
The attachment holds the lease until ``close()``; if the engine dies, the kernel drops it.

A pool of several shares (``spec.partitions``) is attached through one of them: the pool's
lease is taken, a share is claimed for this engine (``offloadpool.region.holding.shares.claim``: the
share its other workers hold, else a free one) and that share's directory is attached as a
pool. Attaching a share's directory itself claims that share. Either way the attachment holds
the pool's lease and the claim until ``close()``.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import contextlib
import ctypes
import os
import stat
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from offloadpool.pinning import mapping
from offloadpool.pinning.backends import get_backend
from offloadpool.pinning.backends.base import PinBackend
from offloadpool.pinning.errors import AttachError, PinError
from offloadpool.pinning.pin import PinRange, PinStats, register_plan, unregister_all
from offloadpool.pinning.plan import (
    DEFAULT_MAX_CHUNK,
    DEFAULT_MAX_RANGES,
    PinGeometry,
    plan_pin_ranges,
    split_at,
)
from offloadpool.region.files.manifest import LEASE_NAME, Manifest, Region, load
from offloadpool.region.holding import shares
from offloadpool.region.holding.lease import Lease, LeaseHeld
from offloadpool.region.memory import numa_check
from offloadpool.region.memory.media import is_hugetlbfs
from offloadpool.region.vocabulary import INTERLEAVED, PER_RANK, READY

DEFAULT_LEASE_TIMEOUT = 60.0


def _close_all(fds: list[int]) -> None:
    """Close a region's segment fds (undoing _open_segments when attach fails half-way)."""
    for fd in fds:
        os.close(fd)


def _check_request(manifest: Manifest, pool_dir: Path, rank: int) -> Region:
    """Refuse a pool that is not attachable or a rank it does not have; return the region."""
    if manifest.state != READY:
        raise AttachError(
            f"pool {manifest.pool!r} at {pool_dir} is {manifest.state}, not Ready: the node is "
            f"releasing it; wait for it to be provisioned again"
        )
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise AttachError(f"rank must be an int, got {type(rank).__name__}")
    ranks = manifest.layout.ranks
    if not 0 <= rank < ranks:
        raise AttachError(
            f"rank {rank} is out of range: pool {manifest.pool!r} is laid out "
            f"{manifest.layout.type} for {ranks} rank{'s' if ranks != 1 else ''} (0..{ranks - 1})"
        )
    if manifest.layout.type == PER_RANK:
        region = manifest.regions[rank]
        if region.rank is not None and region.rank != rank:
            raise AttachError(f"manifest region {rank} belongs to rank {region.rank}")
        return region
    return manifest.regions[0]


def _take_lease(pool_dir: Path, timeout: float | None) -> Lease:
    """Shared lease; waits (up to ``timeout``) only while the node holds it exclusively."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return Lease.shared(pool_dir, blocking=deadline is None)
        except OSError as exc:  # ENOENT/EACCES: no lease, or the pod may not read it
            raise AttachError(
                f"cannot take the pool lease {pool_dir / LEASE_NAME}: {exc.strerror}; the pod "
                f"must mount the pool directory and match the pool's uid/gid/mode "
                f"(uid {os.getuid()}, gid {os.getgid()})"
            ) from None
        except LeaseHeld:
            assert deadline is not None
            if time.monotonic() >= deadline:
                raise AttachError(
                    f"the node holds pool {pool_dir} exclusively (re-provisioning or releasing "
                    f"it) and did not let go within {timeout:g} s"
                ) from None
            time.sleep(0.05)


def _open_segments(pool_dir: Path, region: Region) -> list[int]:
    fds: list[int] = []
    try:
        for seg in region.segments:
            path = pool_dir / seg.file
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                raise AttachError(
                    f"segment {seg.file} listed in the manifest is missing from {pool_dir}"
                ) from None
            except PermissionError:
                raise AttachError(
                    f"no permission to open segment {path}: check the pool's uid/gid/mode for "
                    f"this pod (uid {os.getuid()}, gid {os.getgid()})"
                ) from None
            fds.append(fd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise AttachError(f"segment {path} is not a regular file")
            if st.st_size != seg.bytes:
                raise AttachError(
                    f"segment {seg.file} is {st.st_size} bytes on disk but the manifest says "
                    f"{seg.bytes}: the region does not match its manifest"
                )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


class _State:
    """Everything ``close()`` must undo, kept apart from the Attachment so a finalizer can run it."""

    def __init__(self, base: int, size: int, fds: list[int], lease: Lease) -> None:
        self.base = base
        self.size = size
        self.fds = fds
        self.lease: Lease | None = lease
        #: what a share's attachment holds besides its lease: the claim, the pool's lease
        self.also: list[Lease | shares.Claim] = []
        self.backend: PinBackend | None = None
        self.registered: list[tuple[int, int]] = []
        self.exports: list[weakref.ref[Any]] = []  # views handed out (ctypes arrays: unhashable)
        self.mapped = True
        self.fenced = False

    def live_exports(self) -> int:
        self.exports = [ref for ref in self.exports if ref() is not None]
        return len(self.exports)

    def export_died(self) -> None:
        """A view's buffer is gone: once the last one goes, lift a fence left by close()."""
        if self.fenced and not self.live_exports():
            self.fenced = False
            mapping.unmap(self.base, self.size)

    def unpin(self) -> list[str]:
        errors: list[str] = []
        if self.backend is not None:
            errors = unregister_all(self.backend, self.registered)
            self.backend.close()
            self.backend = None
        return errors

    def release(self) -> list[str]:
        """Unpin (reverse order), unmap, close the files, drop the lease. Idempotent."""
        errors = self.unpin()
        if self.mapped:
            self.mapped = False
            if self.live_exports():
                mapping.fence(self.base, self.size)
                self.fenced = True
            else:
                mapping.unmap(self.base, self.size)
        while self.fds:
            os.close(self.fds.pop())
        if self.lease is not None:
            self.lease.close()
            self.lease = None
        while self.also:
            self.also.pop().close()
        return errors


class Attachment:
    """A pool region mapped into this process as one contiguous range.

    Use as a context manager (or call ``close()``). Views handed out (``memoryview()``,
    ``tensor()``, ``slot_view()``) are valid only while the attachment is open; closing with
    views alive releases the memory anyway and leaves the range inaccessible (until the last
    view is gone), so a stale view faults instead of reading foreign memory.
    """

    #: the share of a partitioned pool this attachment claimed (``pool_dir`` is its
    #: directory); None for a pool without shares
    share: int | None = None

    def __init__(self, pool_dir: Path, rank: int, manifest: Manifest, region: Region, state: _State) -> None:
        self.pool_dir = pool_dir
        self.rank = rank
        self.manifest = manifest
        self.region = region
        self._state = state
        self._lock = threading.RLock()
        self._cancel = threading.Event()
        self._pin_future: concurrent.futures.Future[PinStats] | None = None
        self._pin_stats: PinStats | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _State.release, state)

    # -- geometry -----------------------------------------------------------------------------
    @property
    def address(self) -> int:
        """Virtual address of byte 0 of the region in this process."""
        return self._state.base

    @property
    def size(self) -> int:
        return self.region.bytes

    def __len__(self) -> int:
        return self.region.bytes

    @property
    def page_size(self) -> int:
        return self.manifest.page_size

    @property
    def closed(self) -> bool:
        return self._closed

    def row_geometry(self) -> tuple[int, int, int, int]:
        """``(rows, row_stride, slot_offset, slot_bytes)`` of this rank's data, in bytes.

        Interleaved: every row holds all ranks' slots; this rank's is at ``rank * slot_bytes``.
        PerRank: the region holds only this rank's slots, back to back. Replicated: whole rows.
        """
        lay = self.manifest.layout
        if lay.type == INTERLEAVED and lay.row_bytes and lay.slot_bytes:
            return self.size // lay.row_bytes, lay.row_bytes, self.rank * lay.slot_bytes, lay.slot_bytes
        # PerRank/Replicated record their block size as row_bytes (a PerRank region holds only
        # its own rank's blocks, back to back); older writers may have used slot_bytes.
        unit = lay.row_bytes or (lay.slot_bytes if lay.type == PER_RANK else None)
        if unit and self.size % unit == 0:
            return self.size // unit, unit, 0, unit
        raise AttachError(f"pool {self.manifest.pool!r} ({lay.type}) records no row geometry")

    def plan(
        self,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        max_ranges: int = DEFAULT_MAX_RANGES,
        *,
        geometry: PinGeometry | None = None,
    ) -> list[PinRange]:
        """The registration calls ``pin()`` would make: the rank's ranges, split at files.

        ``geometry`` (the engine's rows and this worker's slot in them) replaces the
        manifest's layout: the engine, not the pool, knows its block size."""
        if geometry is not None:
            if not 0 < geometry.total_bytes <= self.size:
                raise PinError(
                    f"the engine's rows span {geometry.total_bytes} bytes, the attached region "
                    f"holds {self.size}"
                )
            ranges = geometry.plan(self.page_size, max_chunk=max_chunk, max_ranges=max_ranges)
        else:
            try:
                _rows, row, slot_off, slot = self.row_geometry()
            except AttachError:
                row = slot = self.page_size  # unknown geometry: the whole region in page units
                slot_off = 0
            ranges = plan_pin_ranges(
                self.size, row, slot_off, slot, self.page_size, max_chunk=max_chunk, max_ranges=max_ranges
            )
        starts = [seg.offset for seg in self.region.segments]
        pieces = split_at(ranges, starts[1:])
        out = []
        seg = 0
        for off, length in pieces:
            while seg + 1 < len(starts) and starts[seg + 1] <= off:
                seg += 1
            out.append(PinRange(off, length, seg))
        return out

    # -- pinning ------------------------------------------------------------------------------
    @property
    def pinned(self) -> bool:
        return bool(self._state.registered)

    @property
    def pin_stats(self) -> PinStats | None:
        return self._pin_stats

    def pin(
        self,
        backend: str | PinBackend = "auto",
        *,
        background: bool = False,
        max_chunk: int = DEFAULT_MAX_CHUNK,
        max_ranges: int = DEFAULT_MAX_RANGES,
        device: int = 0,
        geometry: PinGeometry | None = None,
        worker: int | None = None,
    ) -> PinStats | concurrent.futures.Future[PinStats]:
        """Register this rank's ranges with ``backend`` ("cuda", "torch", "mlock" or "auto").

        All-or-nothing: on failure everything registered is unregistered in reverse and a
        ``PinError`` names the chunk and the driver's error. With ``background=True`` returns
        a ``concurrent.futures.Future`` (so the engine can overlap pinning with its own
        start-up); the plan, backend choice and limits are still checked before it returns.
        ``geometry``: the engine's own rows and slot (see ``plan``). ``worker`` (default: the
        attached rank) picks the file this worker registers first, so workers that pin one
        region at once start on different files' locks.
        """
        with self._lock:
            if self._closed:
                raise PinError("attachment is closed")
            if self._pin_future is not None or self._state.registered:
                raise PinError("attachment is already pinned (or pinning); unpin() first")
            plan = self.plan(max_chunk=max_chunk, max_ranges=max_ranges, geometry=geometry)
            impl = backend if isinstance(backend, PinBackend) else get_backend(backend, device)
            try:
                impl.preflight([r.length for r in plan], accounted=not is_hugetlbfs(self.manifest.medium))
            except BaseException:
                impl.close()
                raise
            first = self.rank if worker is None else worker
            if not background:
                return self._run_pin(impl, plan, first)  # holds the lock; close() cancels via the event
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offloadpool-pin")
            try:
                future = executor.submit(self._run_pin, impl, plan, first)
            finally:
                executor.shutdown(wait=False)
            self._pin_future = future
            future.add_done_callback(self._pin_finished)
            return future

    def _pin_finished(self, future: concurrent.futures.Future[PinStats]) -> None:
        with self._lock:
            if self._pin_future is future:
                self._pin_future = None

    def _run_pin(self, impl: PinBackend, plan: list[PinRange], worker: int) -> PinStats:
        names = [seg.file for seg in self.region.segments]
        first = worker % len(names)
        try:
            done, stats = register_plan(
                impl, self._state.base, plan, self._state.fds, names, first_segment=first, cancel=self._cancel
            )
        except BaseException:
            impl.close()
            raise
        with self._lock:
            self._state.backend = impl
            self._state.registered = done
            self._pin_stats = stats
        return stats

    def unpin(self) -> None:
        """Unregister everything, in reverse order of registration."""
        with self._lock:
            if self._pin_future is not None:
                raise PinError("a background pin is still running; wait for its future first")
            errors = self._state.unpin()
            self._pin_stats = None
        if errors:
            raise PinError("unpinning failed for: " + "; ".join(errors))

    # -- views --------------------------------------------------------------------------------
    def _export(self, offset: int = 0, length: int | None = None) -> ctypes.Array[Any]:
        """A ctypes byte array over the mapping that keeps this attachment alive."""
        if self._closed:
            raise AttachError("attachment is closed")
        length = self.size - offset if length is None else length
        arr = (ctypes.c_ubyte * length).from_address(self._state.base + offset)
        arr._offloadpool_attachment = self  # type: ignore[attr-defined]
        self._state.live_exports()  # prune dead ones
        self._state.exports.append(weakref.ref(arr))
        weakref.finalize(arr, self._state.export_died)
        return arr

    def memoryview(self) -> memoryview:
        """A writable byte memoryview of the whole region (format ``B``)."""
        return memoryview(self._export()).cast("B")

    # builtins.: in the class body, ``memoryview`` names the method above
    def slot_memoryview(self, row: int, rank: int | None = None) -> builtins.memoryview:
        """The bytes of ``rank``'s slot (default: this rank) in row ``row``."""
        rows, stride, slot_off, slot = self.row_geometry()
        if rank is not None and rank != self.rank:
            slot_off = self._slot_offset_of(rank)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} out of range (0..{rows - 1})")
        return memoryview(self._export(row * stride + slot_off, slot)).cast("B")

    def _slot_offset_of(self, rank: int) -> int:
        lay = self.manifest.layout
        if lay.type != INTERLEAVED or not lay.slot_bytes:
            raise AttachError(f"only an Interleaved layout holds other ranks' slots ({lay.type})")
        if not 0 <= rank < lay.ranks:
            raise AttachError(f"rank {rank} out of range (0..{lay.ranks - 1})")
        return rank * lay.slot_bytes

    def tensor(self, dtype: Any = None) -> Any:
        """The whole region as a 1-D torch tensor (``torch.frombuffer``; default uint8)."""
        return self._frombuffer(0, self.size, dtype)

    def _frombuffer(self, offset: int, length: int, dtype: Any) -> Any:
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if length % itemsize:
            raise ValueError(f"{length} bytes are not a whole number of {dtype}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about non-resizable buffers
            return torch.frombuffer(self._export(offset, length), dtype=dtype)

    def slot_view(self, rank: int | None = None, dtype: Any = None) -> Any:
        """``rank``'s slots as a strided 2-D tensor ``(rows, slot_bytes / itemsize)``.

        Rows are ``row_bytes`` apart and the slot starts at ``rank * slot_bytes`` in each, the
        geometry vLLM's CPU KV tier uses, so ``view[block]`` is that rank's part of a block.
        The tensor's storage starts at the rank's first slot, so ``is_pinned()`` (which torch
        answers for the storage's first byte) reflects this rank's own registration.
        """
        import torch

        rows, stride, slot_off, slot = self.row_geometry()
        if rank is not None and rank != self.rank:
            slot_off = self._slot_offset_of(rank)
        itemsize = torch.empty((), dtype=torch.uint8 if dtype is None else dtype).element_size()
        if stride % itemsize or slot_off % itemsize or slot % itemsize:
            raise ValueError(
                f"row {stride}, slot offset {slot_off} and slot {slot} bytes must be "
                f"multiples of the element size {itemsize}"
            )
        flat = self._frombuffer(slot_off, (rows - 1) * stride + slot, dtype)
        return torch.as_strided(flat, (rows, slot // itemsize), (stride // itemsize, 1), 0)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel a running background pin, unpin in reverse, unmap, drop the lease."""
        self._cancel.set()
        future = self._pin_future
        if future is not None:
            with contextlib.suppress(BaseException):
                future.result()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pin_stats = None
            errors = self._state.release()
            self._finalizer.detach()
        if self._state.fenced:
            warnings.warn(
                "offloadpool attachment closed while views into it were still alive; they now "
                "point at an inaccessible range",
                ResourceWarning,
                stacklevel=2,
            )
        if errors:
            raise PinError("unpinning on close failed for: " + "; ".join(errors))

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at 0x{self.address:x}"
        return (
            f"<Attachment pool={self.manifest.pool!r} rank={self.rank} "
            f"{self.manifest.layout.type} {self.size} B {state}>"
        )


def attach(
    pool_dir: str | os.PathLike[str],
    rank: int = 0,
    *,
    lease_timeout: float | None = DEFAULT_LEASE_TIMEOUT,
    owner: str | None = None,
    gpu_numa_node: int | None = None,
) -> Attachment:
    """Map this rank's region of the pool at ``pool_dir`` and hold the pool's shared lease.

    Replicated: the one region. PerRank: region ``rank``. Interleaved: the one region, in
    which this rank's data is its slot of every row (see ``Attachment.row_geometry``).
    A pool of several shares: this engine's share (see the module docstring): the one the node
    gives this process's pod where the pool's agent runs; else ``owner`` names the engine (every
    worker of one engine must give the same; default
    ``offloadpool.region.holding.shares.default_owner()``, the pod).
    Raises ``ManifestError``/``AttachError`` (a subclass) before anything is mapped.

    Once mapped, where the region's pages are is checked against the node's recorded
    placement and ``gpu_numa_node`` (the NUMA node of this rank's GPU, e.g.
    ``region.memory.gpus.gpu_numa_node(bus_id)``; None: the nodes of the CPUs this process may run
    on): a mismatch is logged as a warning, never refused (``region.memory.numa_check``).
    """
    pool_dir = Path(pool_dir)
    head = load(pool_dir)
    _check_request(head, pool_dir, rank)  # clear errors before creating anything
    if head.shares > 1 or head.share is not None:
        return _attach_share(pool_dir, head, rank, lease_timeout, owner, gpu_numa_node)
    return _attach(pool_dir, rank, lease_timeout, gpu_numa_node)


def _attach_share(
    pool_dir: Path,
    head: Manifest,
    rank: int,
    lease_timeout: float | None,
    owner: str | None,
    gpu_numa_node: int | None,
) -> Attachment:
    """Take the pool's lease, claim a share (``head.share`` when a share was named), attach it."""
    pool = pool_dir if head.share is None else shares.pool_of(pool_dir)
    with contextlib.ExitStack() as undo:
        pool_lease = _take_lease(pool, lease_timeout)
        undo.callback(pool_lease.close)
        now = load(pool)  # authoritative: read under the lease
        _check_request(now, pool, rank)
        if now.shares < 2 or (head.share is not None and head.share >= now.shares):
            raise AttachError(f"pool {now.pool!r} at {pool} has no share {head.share} now: attach the pool")
        try:
            claim = shares.claim(
                pool, now.shares, owner=owner, only=head.share, timeout=lease_timeout or 30.0
            )
        except shares.ShareRefused as exc:
            raise AttachError(str(exc)) from None
        except (OSError, ValueError) as exc:  # a share's name missing or of the wrong kind
            raise AttachError(f"cannot claim a share of pool {now.pool!r} at {pool}: {exc}") from None
        undo.callback(claim.close)
        attachment = _attach(claim.dir, rank, lease_timeout, gpu_numa_node)
        attachment._state.also += [claim, pool_lease]
        attachment.share = claim.index
        undo.pop_all()
    return attachment


def _attach(pool_dir: Path, rank: int, lease_timeout: float | None, gpu_numa_node: int | None) -> Attachment:
    """Attach the pool (or share) directory ``pool_dir``, whose request was checked."""
    with contextlib.ExitStack() as undo:
        lease = _take_lease(pool_dir, lease_timeout)
        undo.callback(lease.close)
        manifest = load(pool_dir)  # authoritative: read under the lease
        region = _check_request(manifest, pool_dir, rank)
        fds = _open_segments(pool_dir, region)
        undo.callback(_close_all, fds)
        alignment = max(manifest.page_size, manifest.alignment)
        base = mapping.reserve(region.bytes, alignment)
        undo.callback(mapping.unmap, base, region.bytes)
        mapping.map_segments(
            base, [(s.offset, s.bytes, fd) for s, fd in zip(region.segments, fds, strict=True)]
        )
        state = _State(base, region.bytes, fds, lease)
        undo.pop_all()
    numa_check.check(manifest, region, base, gpu_node=gpu_numa_node)
    return Attachment(pool_dir, rank, manifest, region, state)
