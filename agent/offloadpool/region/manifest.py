"""The region manifest: the contract between the node that provisions memory and the engine
that attaches it.

The node-side engine writes it (atomically, last, once the region is fully populated); the
pinning helper reads it and refuses anything it does not understand. It is plain JSON in the
pool directory so that an engine image needs nothing but the standard library to read it.

Pool directory layout (``<root>/<pool>/``)::

    manifest.json   this file; present and ``state == "Ready"`` means attachable
    lease           engines hold a shared flock on it while attached
    mnt/            the pool's dedicated tmpfs/hugetlbfs mount holding the segment files

Segment paths in the manifest are relative to the pool directory (``mnt/r0-s000``), so the
same pool directory can be bind-mounted anywhere inside a pod.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "offloadpool.io/region-manifest"
VERSION = 1
MANIFEST_NAME = "manifest.json"
LEASE_NAME = "lease"
MOUNT_NAME = "mnt"

MEDIA = ("HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP")
LAYOUTS = ("Replicated", "PerRank", "Interleaved")
STATES = ("Ready", "Draining")


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
    state: str = "Ready"
    uid: int = 0
    gid: int = 0
    mode: int = 0o660
    compat_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    # -- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ManifestError unless every size and offset agrees with every other."""
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
        if self.state not in STATES:
            raise ManifestError(f"unknown state {self.state!r}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ManifestError(f"page size {self.page_size} is not a power of two")
        if self.layout.ranks < 1:
            raise ManifestError(f"layout.ranks must be >= 1, got {self.layout.ranks}")
        expected_regions = self.layout.ranks if self.layout.type == "PerRank" else 1
        if len(self.regions) != expected_regions:
            raise ManifestError(
                f"{self.layout.type} layout with {self.layout.ranks} ranks needs "
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
                if os.path.isabs(seg.file) or ".." in Path(seg.file).parts:
                    raise ManifestError(f"segment path {seg.file!r} must be relative to the pool")
                offset += seg.bytes
            if offset != region.bytes:
                raise ManifestError(f"region {i}: segments add up to {offset}, region says {region.bytes}")
            total += region.bytes
        if total != self.total_bytes:
            raise ManifestError(f"regions add up to {total} bytes, manifest says {self.total_bytes}")
        lay = self.layout
        if lay.type == "Interleaved" and lay.row_bytes is not None:
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
                    index=int(r["index"]),
                    bytes=int(r["bytes"]),
                    rank=None if r.get("rank") is None else int(r["rank"]),
                    segments=tuple(
                        Segment(file=str(s["file"]), offset=int(s["offset"]), bytes=int(s["bytes"]))
                        for s in r["segments"]
                    ),
                )
                for r in data["regions"]
            )
            layout = Layout(**data["layout"])
            fields = {k: v for k, v in data.items() if k not in ("regions", "layout")}
            manifest = cls(regions=regions, layout=layout, **fields)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed region manifest: {exc!r}") from exc
        manifest.validate()
        return manifest

    def write(self, pool_dir: str | os.PathLike[str]) -> Path:
        """Write atomically (temp file, fsync, rename) so a reader never sees half a manifest."""
        self.validate()
        pool_dir = Path(pool_dir)
        target = pool_dir / MANIFEST_NAME
        fd, tmp = tempfile.mkstemp(dir=pool_dir, prefix=".manifest.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(pool_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return target


def load(pool_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<pool_dir>/manifest.json``; raise ManifestError with the reason."""
    path = Path(pool_dir) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(
            f"no region manifest at {path}: the pool is not provisioned (or not yet Ready) on this node"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"region manifest {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"region manifest {path} is not a JSON object")
    return Manifest.from_dict(data)
