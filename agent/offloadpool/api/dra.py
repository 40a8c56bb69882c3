"""The DRA driver's names: what its ResourceSlices, its DeviceClass and its claims say
(docs/dra.md). Written once here; the agent (which publishes the slices), the kubelet plugin,
the chart and the tests read them from here.
"""

from __future__ import annotations

from typing import Final

from offloadpool.api.constants import GROUP, extended_resource_name, node_object_name

#: The DRA driver's name: every ResourceSlice's ``spec.driver``, the DeviceClass's selector, the
#: kubelet plugin's registration. The same name as the CSI driver (the kubelet keeps CSI and DRA
#: drivers apart by the registration's type).
DRA_DRIVER: Final = GROUP
#: The DeviceClass the chart installs: claims ask for ``deviceClassName: offloadpool.io``.
DEVICE_CLASS: Final = GROUP
#: A DRA pool's own DeviceClass (``spec.consumers.delivery: DRA``), which the operator renders:
#: ``<pool>.offloadpool.io`` (``pool_device_class``). Its label names the pool, as the agent
#: DaemonSet's does.
DEVICE_CLASS_SUFFIX: Final = f".{GROUP}"
DEVICE_CLASS_PLURAL: Final = "deviceclasses"
DEVICE_CLASS_KIND: Final = "DeviceClass"
#: resource.k8s.io as the agent writes it
RESOURCE_GROUP: Final = "resource.k8s.io"
RESOURCE_VERSION: Final = "v1"
RESOURCE_API_VERSION: Final = f"{RESOURCE_GROUP}/{RESOURCE_VERSION}"
SLICE_PLURAL: Final = "resourceslices"
SLICE_KIND: Final = "ResourceSlice"

#: A device's attributes (unqualified names are the driver's own: ``offloadpool.io/pool``).
ATTR_POOL: Final = "pool"
ATTR_MEDIUM: Final = "medium"
ATTR_PAGE_SIZE: Final = "pageSize"
ATTR_LAYOUT: Final = "layout"
ATTR_RANKS: Final = "ranks"
#: the share a device is (partitioned pools), absent on a whole pool's device
ATTR_SHARE: Final = "share"
#: Kubernetes' standard NUMA attribute (KEP-6072), matched across drivers by a claim's
#: ``matchAttribute`` constraint; set where every region of the device is on one NUMA node
ATTR_NUMA_NODE: Final = "resource.kubernetes.io/numaNode"
#: the capacity every device has: its bytes
CAPACITY_MEMORY: Final = "memory"

#: The device of a pool without shares, and the prefix of a share's device (``share-0``).
POOL_DEVICE: Final = "pool"
SHARE_DEVICE_PREFIX: Final = "share-"


def slice_name(pool: str, node: str) -> str:
    """The ResourceSlice of ``pool`` on ``node``: named as its OffloadPoolNode (``<pool>.<node>``),
    and the DRA pool (``spec.pool.name``) the same, so each agent is the one writer of its own
    DRA pool and the node-restriction policy reads the node from the name."""
    return node_object_name(pool, node)


def share_device(index: int) -> str:
    """The device name of share ``index``."""
    return f"{SHARE_DEVICE_PREFIX}{index}"


def share_of_device(device: str) -> int | None:
    """The share a device name says (``share-3`` -> 3); None for the whole pool's device or a
    name that is not one of ours."""
    if device.startswith(SHARE_DEVICE_PREFIX):
        rest = device[len(SHARE_DEVICE_PREFIX) :]
        if rest.isdigit() and rest == str(int(rest)):
            return int(rest)
    return None


def pool_device_class(pool: str) -> str:
    """The DeviceClass of a DRA pool: ``<pool>.offloadpool.io``. Never the chart's class
    (``offloadpool.io``): a pool's name is not empty."""
    return f"{pool}{DEVICE_CLASS_SUFFIX}"


def pool_device_selector(pool: str) -> str:
    """The CEL selector of a DRA pool's DeviceClass: the driver's devices of that pool (the
    attribute ``pool`` every device of the agent's slices carries; a pool's name is a DNS label,
    so it needs no escaping inside the string literal)."""
    return f'device.driver == "{DRA_DRIVER}" && device.attributes["{DRA_DRIVER}"].{ATTR_POOL} == "{pool}"'


def pool_extended_resource(pool: str) -> str:
    """The extended resource a DRA pool's DeviceClass stands for (``spec.extendedResourceName``):
    the name HostPath and CSI pools advertise on their nodes, ``offloadpool.io/<pool>``, so a pod
    asks the same way whatever the delivery."""
    return extended_resource_name(pool)
