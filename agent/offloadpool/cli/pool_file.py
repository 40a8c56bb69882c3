"""From an OffloadPool YAML file and command-line overrides to a validated OffloadPool.

The CLI's flags are laid over the file's document and the result goes through the API's models,
so a flag fails with the same field named as the file would. Turning the pool into the engine's
numbers is ``offloadpool.api.conversion.pool_request``, the one the agent uses too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from offloadpool.api import API_VERSION, POOL_KIND, OffloadPool


class PoolFileError(ValueError):
    """The file is not a readable OffloadPool; the message names the file and the field."""


def pool_from_flags(base: dict[str, Any] | None, **flags: Any) -> OffloadPool:
    """An OffloadPool from a parsed file (or nothing) with command-line flags laid over it.

    Flags use the spec's own names (camelCase in the document), so the result goes through the
    same validation as a file would and the error names the same field.
    """
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": POOL_KIND, "metadata": {}, "spec": {}}
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
        ("layout", "layout", "type"),
        ("ranks", "layout", "ranks"),
        ("slot_size", "layout", "slotSize"),
        ("row_size", "layout", "rowSize"),
        ("max_files", "segments", "maxFiles"),
        ("min_size", "segments", "minSize"),
        ("workers", "prefault", "workers"),
        ("numa", "prefault", "numa"),
        ("numa_nodes", "prefault", "numaNodes"),
        ("uid", "consumers", "uid"),
        ("gid", "consumers", "gid"),
        ("mode", "consumers", "mode"),
        ("scrub", "consumers", "scrub"),
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
        if isinstance(d, dict) and d.get("kind") == POOL_KIND:
            return d
    raise PoolFileError(f"{path}: no document of kind OffloadPool")
