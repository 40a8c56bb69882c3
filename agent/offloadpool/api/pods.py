"""What an inference pod sees of a pool: the label it asks with, where the pool appears inside
it, the environment it is given, and the names of what the admission webhook adds.

The operator's webhook writes these, the pinning helper and the lease sidecar read them, the
docs and examples show them: one module, so the three never disagree on a name. Plain strings
and functions only (no pydantic), like ``constants``.
"""

from __future__ import annotations

from offloadpool.region.files import vllm_compat
from offloadpool.region.files.manifest import LEASE_NAME, MOUNT_NAME
from offloadpool.region.vocabulary import ENV_POD_UID as ENV_POD_UID
from offloadpool.region.vocabulary import ENV_POOL_DIR as ENV_POOL_DIR

from .constants import GROUP, POOL_NAME_LABEL

#: The one label a user puts on an inference pod: ``offloadpool.io/pool: <pool>``. It is the key
#: the operator already puts on what it renders for a pool (agent DaemonSet pods), which is why
#: the webhook never sees the operator's namespace, where those pods run. No label a pod sets
#: exempts it from the webhook.
POD_POOL_LABEL = POOL_NAME_LABEL
#: A namespace labelled ``offloadpool.io/admission: disabled`` is never sent to the webhook.
ADMISSION_NAMESPACE_LABEL = f"{GROUP}/admission"
ADMISSION_DISABLED = "disabled"
#: Namespaces whose pods never reach the webhook, whatever they are labelled (the operator's own
#: namespace is added to these).
SYSTEM_NAMESPACES = ("kube-system", "kube-public", "kube-node-lease")

#: Where the pool directory (``manifest.json``, ``lease``, ``mnt/``) appears in every container.
POD_MOUNT_ROOT = "/offloadpool"
#: Where stock vLLM looks for its region file (``/dev/shm/vllm_offload_<engineId>.mmap``).
VLLM_SHM_DIR = "/dev/shm"

#: Environment given to every container of a labelled pod.
ENV_POOL = "OFFLOADPOOL_POOL"
ENV_MEDIUM = "OFFLOADPOOL_MEDIUM"
ENV_LAYOUT = "OFFLOADPOOL_LAYOUT"
ENV_RANKS = "OFFLOADPOOL_RANKS"
ENV_SLOT_BYTES = "OFFLOADPOOL_SLOT_BYTES"
ENV_CAPACITY_BYTES = "OFFLOADPOOL_CAPACITY_BYTES"
ENV_VLLM_ENGINE_ID = "OFFLOADPOOL_VLLM_ENGINE_ID"
#: The share of a partitioned pool a DRA claim was given (its CDI spec sets it; informational:
#: the pod sees that share alone, as a plain pool, at ``OFFLOADPOOL_POOL_DIR``).
ENV_SHARE = "OFFLOADPOOL_SHARE"

#: The CSI node plugin's driver name: the CSIDriver object, the plugin's registration and every
#: pod's inline ``csi`` volume say it (``spec.consumers.delivery: CSI``).
CSI_DRIVER = GROUP
#: The ``volumeAttributes`` key of an inline ``csi`` volume naming the pool (``{pool: kv}``).
CSI_POOL_ATTRIBUTE = "pool"

#: The native sidecar (an init container with ``restartPolicy: Always``) holding the lease.
LEASE_SIDECAR_NAME = "offloadpool-lease"
#: The sidecar writes this file once it holds the lease; its startup probe waits for it, so the
#: pod's own containers start only with the lease held.
LEASE_READY_FILE = "/tmp/offloadpool-lease-held"
#: The name of the webhook configurations (Mutating and Validating), as installed.
WEBHOOK_CONFIGURATION_NAME = "offloadpool"
#: Webhook names inside the configurations (fully qualified, as the API server requires).
MUTATING_WEBHOOK_NAME = f"pods.mutate.{GROUP}"
VALIDATING_WEBHOOK_NAME = f"pods.validate.{GROUP}"
#: The second validating webhook: every pod, labelled or not, holding a hostPath volume or an
#: ``offloadpool.io/*`` resource (matchConditions), checked for what it holds of the host root.
GUARD_WEBHOOK_NAME = f"pods.guard.{GROUP}"
#: URL paths of the webhooks on the operator's webhook server (= the kopf handler ids).
MUTATE_PATH = "mutate-pod"
VALIDATE_PATH = "validate-pod"
GUARD_PATH = "guard-pod"


def pod_pool_dir(pool: str) -> str:
    """``/offloadpool/<pool>``: the pool directory inside a container (``OFFLOADPOOL_POOL_DIR``)."""
    return f"{POD_MOUNT_ROOT}/{pool}"


def pool_volume_name(pool: str) -> str:
    """``offloadpool-<pool>``: the volume of the pool directory, hostPath or csi (≤ 52 characters)."""
    return f"offloadpool-{pool}"


def compat_volume_name(pool: str) -> str:
    """``offloadpool-<pool>-vllm``: the hostPath volume of the stock-vLLM region file."""
    return f"offloadpool-{pool}-vllm"


def vllm_region_file(engine_id: str) -> str:
    """``vllm_offload_<engineId>.mmap``: the file name stock vLLM gives its region."""
    return vllm_compat.region_file(engine_id)


def compat_files(engine_id: str, count: int = 1) -> list[tuple[str, str]]:
    """(path relative to the pool directory, path inside the container) of each file stock vLLM
    maps for ``engine_id``: the agent hard-links segment i of a compat pool as
    ``mnt/vllm_offload_<id>.mmap`` (i = 0) or ``….mmap.<i>``, split as vLLM splits its region
    (``count`` files: ``OffloadPoolSpec.vllm_compat_file_count``); vLLM looks in /dev/shm."""
    return [
        (f"{MOUNT_NAME}/{name}", f"{VLLM_SHM_DIR}/{name}")
        for name in vllm_compat.file_names(engine_id, count)
    ]


def lease_file(pool_dir: str) -> str:
    """The lease file inside a pool directory."""
    return f"{pool_dir.rstrip('/')}/{LEASE_NAME}"
