"""Typed models of the offloadpool.io/v1alpha1 API (pydantic v2), its names and its quantities.

The CRDs in ``crds/`` are the API's source of truth; these models mirror them for the operator,
the agent and the CLI, and hold the defaults in one place (``offloadpool.api.spec``).
Importing this package needs pydantic (the ``agent`` extra); the engine-side library
(``offloadpool.region``, ``offloadpool.pinning``) never imports it.
"""

from .constants import (
    AGENT_HTTP_PORT,
    API_VERSION,
    CATEGORY,
    CRD_NAMES,
    FINALIZER,
    GROUP,
    HOST_ROOT,
    MAX_POOL_NAME,
    NODE_KIND,
    NODE_PLURAL,
    PLURALS,
    POOL_KIND,
    POOL_LABEL_PREFIX,
    POOL_LABEL_READY,
    POOL_NAME_LABEL,
    POOL_PLURAL,
    RESERVED_POOL_NAMES,
    RESERVED_POOL_PREFIXES,
    SHORT_NAMES,
    VERSION,
    extended_resource_name,
    node_object_name,
    pool_label_key,
    pool_name_error,
    split_node_object_name,
)
from .base import format_micro_time, format_time, now, parse_time
from .conversion import SpecError, pool_request
from .media import (
    HUGEPAGE_MEDIA,
    LAYOUTS,
    MEDIA,
    NODE_PHASES,
    NUMA_POLICIES,
    PAGE_SIZES,
    RECLAIM_POLICIES,
    SCHEDULING_RESOURCE,
    is_hugetlbfs,
    page_size,
)
from .node import OffloadPoolNode, OffloadPoolNodeSpec, OffloadPoolNodeStatus
from .pool import OffloadPool
from .quantity import QuantityError, format_quantity, parse_quantity
from .spec import (
    CompatSpec,
    ConsumersSpec,
    LayoutSpec,
    OffloadPoolSpec,
    PrefaultSpec,
    SegmentsSpec,
    Toleration,
    VllmCompatSpec,
)
from .status import MAX_FAILING_NODES, Condition, FailingNode, OffloadPoolStatus

import types as _types

__all__ = [
    _name
    for _name, _value in dict(globals()).items()
    if not _name.startswith("_") and not isinstance(_value, _types.ModuleType)
]
