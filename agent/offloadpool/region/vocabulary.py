"""The words of the domain, each written once: media, layouts, NUMA and scrub policies,
reclaim policies, phases.

Every other module, in the engine, the API models, the agent, the CLI and the operator, imports
these names instead of writing the string (``tests/test_vocabulary.py`` greps the product
tree and fails on a second spelling). The engine owns them because it is the one layer
everything else may import: it stays standard-library only, and ``offloadpool.api`` builds its
pydantic types from the ``Literal`` types below, so the CRD, the models and the engine cannot
drift apart on a name. What a medium means to the kernel (file system, page size) is in
``offloadpool.region.memory.media``.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

# -- media: where a pool's memory comes from ------------------------------------------------
#: hugetlbfs with 2 MiB pages, reserved from the kernel's persistent huge page count up front
HUGEPAGES_2MI: Final = "HugePages-2Mi"
#: hugetlbfs with 1 GiB pages
HUGEPAGES_1GI: Final = "HugePages-1Gi"
#: tmpfs with base pages
MEMORY: Final = "Memory"
#: tmpfs with ``huge=always`` (transparent huge pages, best effort, nothing reserved)
MEMORY_THP: Final = "MemoryTHP"
MediumName = Literal["HugePages-2Mi", "HugePages-1Gi", "Memory", "MemoryTHP"]
MEDIA: Final[tuple[str, ...]] = get_args(MediumName)

# -- layouts: how ranks share a pool's memory -----------------------------------------------
#: one region every rank reads
REPLICATED: Final = "Replicated"
#: one region per rank
PER_RANK: Final = "PerRank"
#: one region of rows, each row holding one slot per rank (vLLM's CPU KV tier)
INTERLEAVED: Final = "Interleaved"
LayoutName = Literal["Replicated", "PerRank", "Interleaved"]
LAYOUTS: Final[tuple[str, ...]] = get_args(LayoutName)

# -- NUMA placement of the pages (the engine also takes a node list such as "0,1" and a per-region
#    list such as "ranks:0,0,1,1": ``region.memory.numa``) --
NUMA_NONE: Final = "None"
NUMA_INTERLEAVE: Final = "Interleave"
NUMA_SPREAD: Final = "Spread"
#: region i on the NUMA node of the node's i-th NVIDIA GPU in PCI bus order (``region.memory.numa``)
NUMA_GPU: Final = "GPU"
NumaPolicyName = Literal["None", "Interleave", "Spread", "GPU"]
NUMA_POLICIES: Final[tuple[str, ...]] = get_args(NumaPolicyName)

# -- scrub policies: when the node zeroes a pool's memory before handing it out again ----------
#: when the consumers change (or the pool is re-created over a retained region)
SCRUB_ON_CONSUMER_CHANGE: Final = "OnConsumerChange"
#: also whenever its holders left
SCRUB_ALWAYS: Final = "Always"
#: never (one tenant that wants its memory kept)
SCRUB_NEVER: Final = "Never"
ScrubPolicyName = Literal["OnConsumerChange", "Always", "Never"]
SCRUB_POLICIES: Final[tuple[str, ...]] = get_args(ScrubPolicyName)

# -- reclaim policies: what a node does with the memory when its pool goes away ---------------
RECLAIM_DELETE: Final = "Delete"
RECLAIM_RETAIN: Final = "Retain"
ReclaimPolicyName = Literal["Delete", "Retain"]
RECLAIM_POLICIES: Final[tuple[str, ...]] = get_args(ReclaimPolicyName)

# -- delivery: how a pod is given its pool (what the admission webhook injects) ------------------
#: a hostPath volume of the pool directory and a lease sidecar (the pod's namespace must allow
#: hostPath volumes: Pod Security ``privileged``)
DELIVERY_HOST_PATH: Final = "HostPath"
#: an inline ``csi`` volume the node plugin publishes, the publication being the hold (allowed
#: under Pod Security ``restricted``)
DELIVERY_CSI: Final = "CSI"
#: Dynamic Resource Allocation: the pod asks for the pool's extended resource, the scheduler
#: satisfies it with a device of the pool's DeviceClass, and the DRA kubelet plugin's CDI edits
#: bring the pool (allowed under Pod Security ``restricted``)
DELIVERY_DRA: Final = "DRA"
DeliveryName = Literal["HostPath", "CSI", "DRA"]
DELIVERIES: Final[tuple[str, ...]] = get_args(DeliveryName)

# -- what a consumer's containers are told ----------------------------------------------------
#: the environment variable naming the pool directory in a labelled pod's containers: the
#: admission webhook sets it (``api.pods``), the engine side reads it (``vllm.geometry``)
ENV_POOL_DIR: Final = "OFFLOADPOOL_POOL_DIR"
#: the pod's uid (the downward API's ``metadata.uid``), set by the webhook for a pool of several
#: shares: every worker of a pod claims the same share (``region.holding.shares.default_owner``)
ENV_POD_UID: Final = "OFFLOADPOOL_POD_UID"

# -- phases ------------------------------------------------------------------------------------
# One set of words for where a pool stands on a node. The engine's provisioning record
# (``region.files.record``) steps Provisioning -> Populating -> Ready, and Draining while it is torn
# down; ``region.lifecycle.status`` adds Scrubbing (memory being zeroed) and Absent (nothing there); the
# agent reports them as its OffloadPoolNode's phase, adding Pending (nothing done yet) and
# Released (memory given back). A manifest is Ready (attachable) or Draining.
#: the agent has not started on the pool yet
PENDING: Final = "Pending"
#: huge pages reserved, mount and files being made
PROVISIONING: Final = "Provisioning"
#: the files' pages being faulted in
POPULATING: Final = "Populating"
#: the memory being zeroed before it is handed out again
SCRUBBING: Final = "Scrubbing"
#: every page in place, the manifest written: engines may attach
READY: Final = "Ready"
#: the manifest withdrawn, the region being torn down
DRAINING: Final = "Draining"
#: the memory given back (the pool is gone from the node)
RELEASED: Final = "Released"
#: the last attempt failed; the message says why
FAILED: Final = "Failed"
#: nothing of the pool on this node (``region.lifecycle.status`` only)
ABSENT: Final = "Absent"
#: Ready memory no OffloadPool owns: its pool was deleted with reclaimPolicy Retain
#: (``region.lifecycle.status`` only, from the record's note)
ORPHANED: Final = "Orphaned"

NodePhaseName = Literal[
    "Pending", "Provisioning", "Populating", "Scrubbing", "Ready", "Draining", "Released", "Failed"
]
#: an OffloadPoolNode's ``status.phase`` (the CRD's enum; the agent's phase metric)
NODE_PHASES: Final[tuple[str, ...]] = get_args(NodePhaseName)
#: the provisioning record's phases (``region.files.record``)
RECORD_PHASES: Final = (PROVISIONING, POPULATING, READY, DRAINING, FAILED)
#: what ``region.lifecycle.status`` reads from disk and the kernel
STATE_PHASES: Final = (ABSENT, PROVISIONING, POPULATING, SCRUBBING, READY, ORPHANED, FAILED)
#: a manifest's ``state``: Ready means attachable
MANIFEST_STATES: Final = (READY, DRAINING)

# How a share of a partitioned pool is claimed (``region.holding.shares``): a csi volume's reservation
# for a pod, a DRA claim's reservation (the same record, owner ``claim/<uid>``), the node's
# reservation for a hostPath pod (owner ``pod/<uid>``), or an engine's flock on the share's lease
# alone (a pool made without an agent).
ShareViaName = Literal["CSI", "DRA", "HostPath", "Engine"]
VIA_CSI: Final = "CSI"
VIA_DRA: Final = "DRA"
VIA_HOSTPATH: Final = "HostPath"
VIA_ENGINE: Final = "Engine"
