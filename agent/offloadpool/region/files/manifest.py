"""The region manifest: the contract between the node that provisions memory and the engine
that attaches it.

The node-side engine writes it (atomically, last, once the region is fully populated); the
pinning helper reads it and refuses anything it does not understand. It is plain JSON in the
pool directory so that an engine image needs nothing but the standard library to read it.

Pool directory layout (``<root>/<pool>/``)::

    manifest.json   this file; present with ``state`` Ready means attachable
    lease           engines hold a shared flock on it while attached
    mnt/            the pool's dedicated tmpfs/hugetlbfs mount holding the segment files

Segment paths in the manifest are relative to the pool directory (``mnt/r0-s000``), so the
same pool directory can be bind-mounted anywhere inside a pod.

A pool of several shares (``shares`` > 1) lists every share's regions, and gives each share a
directory of its own that looks like a pool directory (``region.holding.shares``)::

    shares/<i>/manifest.json   share i's regions alone (``share`` = i), attachable as a pool
    shares/<i>/lease           the share's claim: an flock, and who holds it (written by the engine)
    shares/<i>/mnt             a link to ``../../mnt``, so the share's segment paths read the same

``shares`` and ``share`` are written only when set: a manifest of a pool without shares reads
exactly as before, and an older library refuses a partitioned pool (an unknown field) rather
than map every share as one region.

A pod can write the pool directory, so the manifest is hostile input to whoever reads it: it is
read without following links (``beneath``), decoded only within bounds (``bounded``: at most
``beneath.MAX_READ`` bytes, nesting and number length bounded), and every field is checked for
its type and range, every file name for being a plain name in ``mnt/``, before any of it is
used: whatever it holds, ``load`` raises ManifestError and nothing else.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from offloadpool.region.files import beneath, bounded
from offloadpool.region.vocabulary import INTERLEAVED, LAYOUTS, MANIFEST_STATES, MEDIA, PER_RANK, READY

FORMAT = "offloadpool.io/region-manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"
LEASE_NAME = "lease"
MOUNT_NAME = "mnt"


class ManifestError(ValueError):
    """The manifest is missing, malformed, of an unknown version, or contradicts itself."""


@dataclass(frozen=True)
class Segment:
    """One file of a region: ``bytes`` bytes at ``offset`` within the region."""

    file: str
    offset: int
    bytes: int


@dataclass(frozen=True)
class Region:
    """One contiguous logical region; ``rank`` is set for PerRank layouts only."""

    index: int
    bytes: int
    segments: tuple[Segment, ...]
    rank: int | None = None


@dataclass(frozen=True)
class Layout:
    """How ranks share the memory.

    Interleaved regions are rows of ``row_bytes``, each holding ``ranks`` slots of
    ``slot_bytes`` (rank ``r``'s slot starts at ``r * slot_bytes`` in every row), as vLLM's
    CPU KV tier lays out blocks. ``row_bytes``/``slot_bytes`` are ``None`` when unknown.
    """

    type: str
    ranks: int = 1
    row_bytes: int | None = None
    slot_bytes: int | None = None


@dataclass(frozen=True)
class Manifest:
    pool: str
    generation: int
    medium: str
    page_size: int
    layout: Layout
    regions: tuple[Region, ...]
    total_bytes: int
    alignment: int
    state: str = READY
    uid: int = 0
    gid: int = 0
    mode: int = 0o660
    compat_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION
    #: independent shares the pool is split into; ``regions`` lists share 0's first
    shares: int = 1
    #: which share of its pool this manifest describes (a share directory's); None: a pool's
    share: int | None = None

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ManifestError unless every field has its type and every size and offset agrees
        with every other."""
        _check_types(self)
        if self.format != FORMAT:
            raise ManifestError(f"not a region manifest: format {self.format!r}, expected {FORMAT!r}")
        if self.version != VERSION:
            raise ManifestError(
                f"region manifest version {self.version} is not understood by this library "
                f"(it reads version {VERSION}); upgrade offloadpool in the engine image"
            )
        if self.medium not in MEDIA:
            raise ManifestError(f"unknown medium {self.medium!r}; known: {', '.join(MEDIA)}")
        if self.layout.type not in LAYOUTS:
            raise ManifestError(f"unknown layout {self.layout.type!r}; known: {', '.join(LAYOUTS)}")
        if self.state not in MANIFEST_STATES:
            raise ManifestError(f"unknown state {self.state!r}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ManifestError(f"page size {self.page_size} is not a power of two")
        if self.layout.ranks < 1:
            raise ManifestError(f"layout.ranks must be >= 1, got {self.layout.ranks}")
        if self.shares < 1 or (self.share is not None and (self.shares != 1 or self.share < 0)):
            raise ManifestError(f"shares {self.shares} / share {self.share} is not a pool's or a share's")
        expected_regions = (self.layout.ranks if self.layout.type == PER_RANK else 1) * self.shares
        if len(self.regions) != expected_regions:
            raise ManifestError(
                f"{self.layout.type} layout with {self.layout.ranks} ranks"
                f"{f' in {self.shares} shares' if self.shares > 1 else ''} needs "
                f"{expected_regions} regions, manifest lists {len(self.regions)}"
            )
        total = 0
        for i, region in enumerate(self.regions):
            if region.index != i:
                raise ManifestError(f"region {i} is listed with index {region.index}")
            if not region.segments:
                raise ManifestError(f"region {i} has no segments")
            offset = 0
            for seg in region.segments:
                if seg.offset != offset:
                    raise ManifestError(
                        f"region {i}: segment {seg.file} starts at {seg.offset}, expected {offset}"
                    )
                if seg.bytes <= 0 or seg.bytes % self.page_size:
                    raise ManifestError(
                        f"region {i}: segment {seg.file} size {seg.bytes} is not a positive "
                        f"multiple of the page size {self.page_size}"
                    )
                if not is_mount_file(seg.file):
                    raise ManifestError(f"segment path {seg.file!r} must be a plain name in {MOUNT_NAME}/")
                offset += seg.bytes
            if offset != region.bytes:
                raise ManifestError(f"region {i}: segments add up to {offset}, region says {region.bytes}")
            total += region.bytes
        if total != self.total_bytes:
            raise ManifestError(f"regions add up to {total} bytes, manifest says {self.total_bytes}")
        files = [s.file for r in self.regions for s in r.segments]
        if len(set(files)) != len(files):
            raise ManifestError("a segment file is listed twice")
        if self.compat_file is not None and not is_mount_file(self.compat_file):
            raise ManifestError(f"compat file {self.compat_file!r} must be a plain name in {MOUNT_NAME}/")
        if not 0 <= self.mode <= 0o7777 or not 0 <= self.uid < 2**32 - 1 or not 0 <= self.gid < 2**32 - 1:
            raise ManifestError(f"uid {self.uid}, gid {self.gid} or mode {self.mode:o} is out of range")
        lay = self.layout
        if lay.type == INTERLEAVED and lay.row_bytes is not None:
            if lay.slot_bytes is None or lay.slot_bytes * lay.ranks > lay.row_bytes:
                raise ManifestError(
                    f"interleaved row of {lay.row_bytes} bytes cannot hold {lay.ranks} slots of "
                    f"{lay.slot_bytes} bytes"
                )
            if self.regions[0].bytes % lay.row_bytes:
                raise ManifestError(
                    f"interleaved region of {self.regions[0].bytes} bytes is not a whole number "
                    f"of {lay.row_bytes}-byte rows"
                )

    # -- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.shares == 1:
            del d["shares"]
        if self.share is None:
            del d["share"]
        d["regions"] = [{**asdict(r), "segments": [asdict(s) for s in r.segments]} for r in self.regions]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        try:
            if data.get("format") != FORMAT:
                raise ManifestError(f"not a region manifest: format {data.get('format')!r}")
            if data.get("version") != VERSION:
                raise ManifestError(
                    f"region manifest version {data.get('version')!r} is not understood by this "
                    f"library (it reads version {VERSION}); upgrade offloadpool in the engine image"
                )
            regions = tuple(
                Region(
                    index=r["index"],
                    bytes=r["bytes"],
                    rank=r.get("rank"),
                    segments=tuple(
                        Segment(file=s["file"], offset=s["offset"], bytes=s["bytes"]) for s in r["segments"]
                    ),
                )
                for r in data["regions"]
            )
            layout = Layout(**data["layout"])
            fields = {k: v for k, v in data.items() if k not in ("regions", "layout")}
            manifest = cls(regions=regions, layout=layout, **fields)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestError(f"malformed region manifest: {exc!r}") from exc
        manifest.validate()
        return manifest

    def encode(self) -> bytes:
        """The manifest's file content (validated first)."""
        self.validate()
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n").encode()

    def write(self, pool_dir: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename) so a reader never sees half a manifest.

        Whatever a pod left at the manifest's name (a link included) is replaced as a name,
        never written through."""
        data = self.encode()
        fd = _open_pool_dir(pool_dir)
        try:
            beneath.write_file(fd, MANIFEST_NAME, data, 0o644)
        finally:
            os.close(fd)
        return Path(pool_dir) / MANIFEST_NAME


def load(pool_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<pool_dir>/manifest.json``; raise ManifestError with the reason."""
    try:
        fd: int | None = _open_pool_dir(pool_dir)
    except FileNotFoundError:
        fd = None
    try:
        return load_at(fd, Path(pool_dir))
    finally:
        if fd is not None:
            os.close(fd)


def load_at(dir_fd: int | None, pool_dir: Path) -> Manifest:
    """``load`` of the manifest beneath the pool directory's descriptor ``dir_fd`` (None: there
    is no pool directory); ``pool_dir`` names it in messages."""
    path = pool_dir / MANIFEST_NAME
    try:
        if dir_fd is None:
            raise FileNotFoundError(path)
        text = beneath.read_file(dir_fd, MANIFEST_NAME)
    except FileNotFoundError:
        raise ManifestError(
            f"no region manifest at {path}: the pool is not provisioned (or not yet Ready) on this node"
        ) from None
    except beneath.WrongEntry as exc:
        raise ManifestError(f"region manifest {pool_dir / exc.name} {exc.reason}: not read") from None
    try:
        data = bounded.loads(text)
    except bounded.Malformed as exc:
        raise ManifestError(f"region manifest {path} {exc}: not read") from None
    if not isinstance(data, dict):
        raise ManifestError(f"region manifest {path} is not a JSON object")
    return Manifest.from_dict(data)


def is_mount_file(name: object) -> bool:
    """Whether ``name`` is ``mnt/<plain name>``: the only place a pool's memory files live."""
    if not isinstance(name, str):
        return False
    head, _, tail = name.partition("/")
    return head == MOUNT_NAME and tail not in ("", ".", "..") and "/" not in tail and "\0" not in tail


def _open_pool_dir(pool_dir: str | os.PathLike[str]) -> int:
    """The pool directory, followed as a path: its name is the caller's (the node's host root
    and a checked pool name, or an engine's own mount path); the names in it never are."""
    return os.open(pool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(m: Manifest) -> None:
    """Raise ManifestError naming the first field of the wrong JSON type."""
    wanted: list[tuple[str, object, bool]] = [
        (name, getattr(m, name), _is_int(getattr(m, name)))
        for name in ("generation", "page_size", "total_bytes", "alignment", "uid", "gid", "mode", "version")
    ]
    for name in ("pool", "medium", "state"):
        wanted.append((name, getattr(m, name), isinstance(getattr(m, name), str)))
    wanted += [
        ("compat_file", m.compat_file, m.compat_file is None or isinstance(m.compat_file, str)),
        ("extra", m.extra, isinstance(m.extra, dict)),
        ("layout.type", m.layout.type, isinstance(m.layout.type, str)),
        ("layout.ranks", m.layout.ranks, _is_int(m.layout.ranks)),
        ("shares", m.shares, _is_int(m.shares)),
        ("share", m.share, m.share is None or _is_int(m.share)),
    ]
    for name in ("row_bytes", "slot_bytes"):
        value = getattr(m.layout, name)
        wanted.append((f"layout.{name}", value, value is None or _is_int(value)))
    for r in m.regions:
        wanted += [
            (f"regions[{r.index}].index", r.index, _is_int(r.index)),
            (f"regions[{r.index}].bytes", r.bytes, _is_int(r.bytes)),
            (f"regions[{r.index}].rank", r.rank, r.rank is None or _is_int(r.rank)),
        ]
        for s in r.segments:
            wanted += [
                (f"segment {s.file!r} file", s.file, isinstance(s.file, str)),
                (f"segment {s.file!r} offset", s.offset, _is_int(s.offset)),
                (f"segment {s.file!r} bytes", s.bytes, _is_int(s.bytes)),
            ]
    for name, value, ok in wanted:
        if not ok:
            raise ManifestError(f"region manifest field {name} has the wrong type: {value!r}")
