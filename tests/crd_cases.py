"""Invalid OffloadPools, each with the field its rejection must name.

Shared by tests/test_crd_validation.py (the real API server must reject each one, naming the
field) and tests/test_api_models.py (the Python models must reject each one too, naming the
same field), so the CRD's rules and the models' rules cannot drift apart unnoticed.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from offloadpool.api import API_VERSION, POOL_KIND

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"


@dataclass(frozen=True)
class InvalidPool:
    id: str
    spec: dict[str, Any] | None
    #: The field path the rejection must name, as the API server writes it.
    field: str
    name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": POOL_KIND,
            "metadata": {"name": self.name or name},
        }
        if self.spec is not None:
            obj["spec"] = copy.deepcopy(self.spec)
        obj.update(copy.deepcopy(self.extra))
        return obj


def _s(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"capacity": "64Mi", "medium": "Memory"}
    base.update(spec)
    return base


def _perrank(ranks: Any = None, **spec: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {"type": "PerRank"}
    if ranks is not None:
        layout["ranks"] = ranks
    return _s(layout=layout, **spec)


INVALID_POOLS: list[InvalidPool] = [
    InvalidPool("capacity-zero", _s(capacity="0"), "spec.capacity"),
    InvalidPool("capacity-negative-int", _s(capacity=-1073741824), "spec.capacity"),
    InvalidPool("capacity-negative-string", _s(capacity="-1Gi"), "spec.capacity"),
    InvalidPool("capacity-not-2mi-pages", _s(capacity="3Mi", medium="HugePages-2Mi"), "spec.capacity"),
    InvalidPool("capacity-not-4ki-pages", _s(capacity=1000), "spec.capacity"),
    InvalidPool("capacity-not-thp-granules", _s(capacity="1025Mi", medium="MemoryTHP"), "spec.capacity"),
    InvalidPool("capacity-not-1gi-pages", _s(capacity="1536Mi", medium="HugePages-1Gi"), "spec.capacity"),
    InvalidPool("capacity-fractional-bytes", _s(capacity="100m"), "spec.capacity"),
    InvalidPool("capacity-bad-suffix", _s(capacity="64GB"), "spec.capacity"),
    InvalidPool("capacity-not-a-quantity", _s(capacity="lots"), "spec.capacity"),
    InvalidPool("capacity-space", _s(capacity="64 Gi"), "spec.capacity"),
    InvalidPool("capacity-beyond-int64", _s(capacity="1e30"), "spec.capacity"),
    InvalidPool("capacity-missing", {"medium": "Memory"}, "spec.capacity"),
    InvalidPool("medium-unknown", _s(medium="Tape"), "spec.medium"),
    InvalidPool("layout-type-unknown", _s(layout={"type": "Striped", "ranks": 2}), "spec.layout.type"),
    InvalidPool("ranks-zero", _perrank(0), "spec.layout.ranks"),
    InvalidPool("ranks-too-many", _perrank(300, capacity="600Mi"), "spec.layout.ranks"),
    InvalidPool("perrank-without-ranks", _perrank(), "spec.layout.ranks"),
    InvalidPool("interleaved-without-ranks", _s(layout={"type": "Interleaved"}), "spec.layout.ranks"),
    InvalidPool(
        "perrank-capacity-not-divisible",
        _perrank(4, capacity="6Mi", medium="HugePages-2Mi"),
        "spec.capacity",
    ),
    InvalidPool(
        "perrank-1gi-capacity-not-divisible",
        _perrank(4, capacity="2Gi", medium="HugePages-1Gi", segments={"minSize": "1Gi"}),
        "spec.capacity",
    ),
    InvalidPool(
        "slotsize-on-replicated",
        _s(layout={"type": "Replicated", "slotSize": "1Mi"}),
        "spec.layout.slotSize",
    ),
    InvalidPool(
        "slotsize-not-dividing-capacity",
        _s(capacity="8Gi", layout={"type": "Interleaved", "ranks": 2, "slotSize": "3Mi"}),
        "spec.layout.slotSize",
    ),
    InvalidPool(
        "slotsize-larger-than-capacity",
        _s(capacity="64Mi", layout={"type": "Interleaved", "ranks": 2, "slotSize": "1Gi"}),
        "spec.layout.slotSize",
    ),
    InvalidPool(
        "slotsize-zero",
        _s(layout={"type": "Interleaved", "ranks": 2, "slotSize": "0"}),
        "spec.layout.slotSize",
    ),
    InvalidPool(
        "rowsize-on-interleaved",
        _s(layout={"type": "Interleaved", "ranks": 2, "rowSize": "1Mi"}),
        "spec.layout.rowSize",
    ),
    InvalidPool(
        "rowsize-not-dividing-capacity",
        _s(capacity="64Mi", layout={"type": "Replicated", "rowSize": "3Mi"}),
        "spec.layout.rowSize",
    ),
    InvalidPool(
        "rowsize-not-dividing-a-rank-region",
        _s(capacity="64Mi", layout={"type": "PerRank", "ranks": 4, "rowSize": "32Mi"}),
        "spec.layout.rowSize",
    ),
    InvalidPool(
        "rowsize-not-dividing-a-share",
        _s(capacity="64Mi", partitions=4, layout={"type": "Replicated", "rowSize": "32Mi"}),
        "spec.layout.rowSize",
    ),
    InvalidPool(
        "rowsize-zero",
        _s(layout={"type": "Replicated", "rowSize": "0"}),
        "spec.layout.rowSize",
    ),
    InvalidPool(
        "rowsize-with-compat",
        _s(
            capacity="8Mi",
            layout={"type": "Replicated", "rowSize": "1Mi"},
            segments={"maxFiles": 1},
            compat={"vllm": {"engineId": "e-1"}},
        ),
        "spec.layout.rowSize",
    ),
    InvalidPool("maxfiles-33", _s(segments={"maxFiles": 33}), "spec.segments.maxFiles"),
    InvalidPool("maxfiles-zero", _s(segments={"maxFiles": 0}), "spec.segments.maxFiles"),
    InvalidPool(
        "minsize-below-2mi-page",
        _s(capacity="1Gi", medium="HugePages-2Mi", segments={"minSize": "1Mi"}),
        "spec.segments.minSize",
    ),
    InvalidPool(
        "minsize-below-1gi-page",
        _s(capacity="2Gi", medium="HugePages-1Gi", segments={"minSize": "512Mi"}),
        "spec.segments.minSize",
    ),
    InvalidPool("minsize-below-4ki-page", _s(segments={"minSize": "1Ki"}), "spec.segments.minSize"),
    InvalidPool("minsize-bad-quantity", _s(segments={"minSize": "1 GiB"}), "spec.segments.minSize"),
    InvalidPool("prefault-workers-257", _s(prefault={"workers": 257}), "spec.prefault.workers"),
    InvalidPool("prefault-workers-negative", _s(prefault={"workers": -1}), "spec.prefault.workers"),
    InvalidPool("prefault-numa-unknown", _s(prefault={"numa": "Local"}), "spec.prefault.numa"),
    InvalidPool(
        "numa-nodes-wrong-length",
        _perrank(4, capacity="64Mi", prefault={"numaNodes": [0, 0, 1]}),
        "spec.prefault.numaNodes",
    ),
    InvalidPool("numa-nodes-not-perrank", _s(prefault={"numaNodes": [0]}), "spec.prefault.numaNodes"),
    InvalidPool(
        "numa-nodes-negative", _perrank(2, prefault={"numaNodes": [0, -1]}), "spec.prefault.numaNodes[1]"
    ),
    InvalidPool(
        "numa-nodes-beyond-1023", _perrank(2, prefault={"numaNodes": [0, 1024]}), "spec.prefault.numaNodes[1]"
    ),
    InvalidPool(
        "numa-nodes-with-policy",
        _perrank(2, prefault={"numa": "GPU", "numaNodes": [0, 1]}),
        "spec.prefault.numaNodes",
    ),
    InvalidPool("unknown-spec-field", _s(sizeGiB=64), "spec.sizeGiB"),
    InvalidPool("unknown-layout-field", _s(layout={"type": "Replicated", "stride": 4}), "spec.layout.stride"),
    InvalidPool("name-too-long", _s(), "metadata.name", name="p" * 41),
    InvalidPool("name-with-dot", _s(), "metadata.name", name="kv.cache"),
    InvalidPool("name-reserved", _s(), "metadata.name", name="all"),
    InvalidPool("name-reserved-prefix", _s(), "metadata.name", name="kube-cache"),
    InvalidPool("mode-not-octal", _s(consumers={"mode": "0999"}), "spec.consumers.mode"),
    InvalidPool("mode-without-leading-zero", _s(consumers={"mode": "660"}), "spec.consumers.mode"),
    InvalidPool("mode-symbolic", _s(consumers={"mode": "rw-rw----"}), "spec.consumers.mode"),
    InvalidPool("uid-negative", _s(consumers={"uid": -1}), "spec.consumers.uid"),
    InvalidPool("gid-beyond-int32", _s(consumers={"gid": 2**31}), "spec.consumers.gid"),
    InvalidPool(
        "namespace-not-dns-label", _s(consumers={"namespaces": ["Team_A"]}), "spec.consumers.namespaces[0]"
    ),
    InvalidPool(
        "namespace-duplicate", _s(consumers={"namespaces": ["ml", "ml"]}), "spec.consumers.namespaces[1]"
    ),
    InvalidPool(
        "toleration-operator-unknown",
        _s(tolerations=[{"key": "gpu", "operator": "Sometimes"}]),
        "spec.tolerations[0].operator",
    ),
    InvalidPool(
        "toleration-exists-with-value",
        _s(tolerations=[{"key": "gpu", "operator": "Exists", "value": "yes"}]),
        "spec.tolerations[0].value",
    ),
    InvalidPool(
        "toleration-empty-key-with-equal",
        _s(tolerations=[{"operator": "Equal", "value": "x"}]),
        "spec.tolerations[0].key",
    ),
    InvalidPool(
        "toleration-seconds-without-noexecute",
        _s(
            tolerations=[
                {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}
            ]
        ),
        "spec.tolerations[0].tolerationSeconds",
    ),
    InvalidPool(
        "toleration-effect-unknown",
        _s(tolerations=[{"key": "gpu", "operator": "Exists", "effect": "Evict"}]),
        "spec.tolerations[0].effect",
    ),
    InvalidPool("nodeselector-value-not-string", _s(nodeSelector={"gpu": 1}), "spec.nodeSelector.gpu"),
    InvalidPool("reclaim-policy-unknown", _s(reclaimPolicy="Keep"), "spec.reclaimPolicy"),
    InvalidPool("delivery-unknown", _s(consumers={"delivery": "Csi"}), "spec.consumers.delivery"),
    InvalidPool(
        "delivery-dra-with-compat",
        _s(consumers={"delivery": "DRA"}, segments={"maxFiles": 1}, compat={"vllm": {"engineId": "e-1"}}),
        "spec.consumers.delivery",
    ),
    InvalidPool(
        "engineid-path-traversal",
        _s(segments={"maxFiles": 1}, compat={"vllm": {"engineId": "../etc/passwd"}}),
        "spec.compat.vllm.engineId",
    ),
    InvalidPool(
        "engineid-missing", _s(segments={"maxFiles": 1}, compat={"vllm": {}}), "spec.compat.vllm.engineId"
    ),
    InvalidPool(
        "compat-with-perrank",
        _perrank(2, segments={"maxFiles": 1}, compat={"vllm": {"engineId": "e1"}}),
        "spec.compat.vllm",
    ),
    InvalidPool(
        "compat-several-vllm-files-without-row",
        _s(capacity="2Gi", compat={"vllm": {"engineId": "e1"}}),
        "spec.compat.vllm.rowSize",
    ),
    InvalidPool(
        "compat-row-not-dividing-capacity",
        _s(capacity="2Gi", compat={"vllm": {"engineId": "e1", "rowSize": "12Ki"}}),
        "spec.compat.vllm.rowSize",
    ),
    InvalidPool(
        "compat-row-not-whole-bytes",
        _s(capacity="64Mi", compat={"vllm": {"engineId": "e1", "rowSize": "0.5"}}),
        "spec.compat.vllm.rowSize",
    ),
    InvalidPool(
        "compat-row-not-4ki",
        _s(capacity="64Mi", compat={"vllm": {"engineId": "e1", "rowSize": 1000}}),
        "spec.compat.vllm.rowSize",
    ),
    InvalidPool(
        "compat-several-vllm-files-on-hugepages",
        _s(capacity="2Gi", medium="HugePages-1Gi", compat={"vllm": {"engineId": "e1", "rowSize": "512Ki"}}),
        "spec.compat.vllm",
    ),
    InvalidPool(
        "compat-segments-above-32",
        _s(compat={"vllm": {"engineId": "e1", "numSegments": 33}}),
        "spec.compat.vllm.numSegments",
    ),
    InvalidPool("spec-missing", None, "spec"),
]

assert len({case.id for case in INVALID_POOLS}) == len(INVALID_POOLS), "case ids must be distinct"


_INDEX = re.compile(r"\[\d*\]|\.\d+(?=[.\s]|$)")


def without_indices(text: str) -> str:
    """``spec.tolerations[0].value`` / ``spec.tolerations.0.value`` -> ``spec.tolerations.value``.

    The API server writes list indices in brackets, pydantic as path segments; the models'
    own messages use ``[]``. Comparing without indices checks the same field is named.
    """
    return _INDEX.sub("", text)


def names_field(message: str, field_path: str) -> bool:
    """True when ``message`` names ``field_path`` itself, not just a longer path starting so."""
    return re.search(re.escape(field_path) + r"(?![\w.\[])", message) is not None


@dataclass(frozen=True)
class ExamplePool:
    id: str
    path: Path
    doc: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.doc["metadata"]["name"])


def example_pools() -> list[ExamplePool]:
    """Every OffloadPool document anywhere under examples/ (other kinds, e.g. Pods, skipped)."""
    found = []
    for path in sorted(EXAMPLES_DIR.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == POOL_KIND:
                found.append(
                    ExamplePool(f"{path.relative_to(EXAMPLES_DIR)}:{doc['metadata']['name']}", path, doc)
                )
    return found


EXAMPLE_POOLS = example_pools()
