"""From an OffloadPool (YAML file or model) and command-line overrides to a PoolRequest.

The region engine takes plain numbers only; this is the one place that turns the API's
models (``offloadpool.api``, defaults included) into them, so the CLI and the agent read a
pool the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from offloadpool.api import OffloadPool
from offloadpool.api.quantity import parse_quantity
from offloadpool.region.request import PoolRequest


class PoolFileError(ValueError):
    """The file is not a readable OffloadPool; the message names the file and the field."""


def load_pool(path: str | Path) -> OffloadPool:
    """Read the first OffloadPool document of ``path`` and validate it with the API models."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise PoolFileError(f"{path}: {exc}") from exc
    pools = [d for d in docs if isinstance(d, dict) and d.get("kind") == "OffloadPool"]
    if not pools:
        raise PoolFileError(f"{path}: no document of kind OffloadPool")
    try:
        return OffloadPool.model_validate(pools[0])
    except ValueError as exc:
        raise PoolFileError(f"{path}: {exc}") from exc


def request_from_pool(pool: OffloadPool) -> PoolRequest:
    """The PoolRequest one node provisions for ``pool`` (capacity is per node)."""
    spec = pool.spec
    vllm = spec.compat.vllm if spec.compat else None
    return PoolRequest(
        name=pool.name,
        capacity=spec.capacity_bytes(),
        medium=spec.medium,
        layout_type=spec.layout.type,
        ranks=spec.layout.rank_count,
        slot_bytes=spec.slot_size_bytes(),
        max_files=spec.segments.max_files,
        min_segment=spec.min_size_bytes(),
        workers=spec.prefault.workers,
        numa=spec.prefault.numa,
        uid=spec.consumers.uid,
        gid=spec.consumers.gid,
        mode=spec.mode_int(),
        compat_engine_id=vllm.engine_id if vllm else None,
        compat_row_bytes=vllm.row_bytes() if vllm else None,
        compat_segments=vllm.num_segments if vllm else 32,
        generation=max(1, pool.generation),
    )


def pool_from_flags(base: dict[str, Any] | None, **flags: Any) -> OffloadPool:
    """An OffloadPool from a parsed file (or nothing) with command-line flags laid over it.

    Flags use the spec's own names (camelCase in the document), so the result goes through the
    same validation as a file would and the error names the same field.
    """
    doc: dict[str, Any] = {"apiVersion": "offloadpool.io/v1alpha1", "kind": "OffloadPool",
                           "metadata": {}, "spec": {}}
    if base:
        doc.update({k: v for k, v in base.items() if k in ("metadata", "spec")})
        doc["metadata"] = dict(doc.get("metadata") or {})
        doc["spec"] = dict(doc.get("spec") or {})
    spec = doc["spec"]

    def nested(key: str) -> dict[str, Any]:
        spec[key] = dict(spec.get(key) or {})
        return spec[key]

    if flags.get("name") is not None:
        doc["metadata"]["name"] = flags["name"]
    for flag, key in (("capacity", "capacity"), ("medium", "medium")):
        if flags.get(flag) is not None:
            spec[key] = flags[flag]
    for flag, section, key in (
        ("layout", "layout", "type"), ("ranks", "layout", "ranks"), ("slot_size", "layout", "slotSize"),
        ("max_files", "segments", "maxFiles"), ("min_size", "segments", "minSize"),
        ("workers", "prefault", "workers"), ("numa", "prefault", "numa"),
        ("uid", "consumers", "uid"), ("gid", "consumers", "gid"), ("mode", "consumers", "mode"),
    ):
        if flags.get(flag) is not None:
            nested(section)[key] = flags[flag]
    if flags.get("engine_id") is not None:
        compat = nested("compat")
        compat["vllm"] = {**(compat.get("vllm") or {}), "engineId": flags["engine_id"]}
    if not doc["metadata"].get("name"):
        raise PoolFileError("the pool needs a name: give -f POOL.yaml or --name")
    if "capacity" not in spec:
        raise PoolFileError("the pool needs spec.capacity: give -f POOL.yaml or --capacity")
    try:
        return OffloadPool.model_validate(doc)
    except ValueError as exc:
        raise PoolFileError(str(exc)) from exc


def read_document(path: str | Path) -> dict[str, Any]:
    """The first OffloadPool document of a YAML file, unvalidated (flags may still fix it)."""
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise PoolFileError(f"{path}: {exc}") from exc
    for d in docs:
        if isinstance(d, dict) and d.get("kind") == "OffloadPool":
            return d
    raise PoolFileError(f"{path}: no document of kind OffloadPool")


def parse_size(text: str) -> int:
    """A size such as ``4Gi`` or ``268435456`` in bytes (Kubernetes quantity syntax)."""
    return parse_quantity(text)
