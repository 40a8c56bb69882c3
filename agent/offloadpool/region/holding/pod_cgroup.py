"""Which pod a process on the node belongs to, from the cgroup the kubelet put it in.

Why this exists: what a pod says about itself (``OFFLOADPOOL_SHARE_OWNER``, its uid in its
environment) is its own word. The node gives a hostPath pod its share by the pod it reads here
for the process that asks (``agent.share_service``), and over hostPath, where every pod given
the pool can still open every share's files, it sees which pods hold each share.
The kubelet and the container runtime place every container's processes in a cgroup below the
pod's, whose name carries the pod's uid:

* systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with
  _ for ->.slice/cri-containerd-<id>.scope``;
* cgroupfs driver: ``/kubepods/burstable/pod<uid>/<container id>`` (``/kubepods/pod<uid>/…``
  for a Guaranteed pod).

A pod cannot leave that cgroup (its cgroup file system is read-only, or, where writable, only
lets it move into cgroups below its own), so the *first* ``pod<uid>`` of the path — the
kubelet's level — is the node's evidence of the pod, unlike the owner an engine writes. A
process in no pod cgroup (the host, a test) has no pod.

``/proc/<pid>/cgroup`` is read as the node's ``/proc`` shows it (hostPID): in the host's cgroup
namespace the whole path is visible. At most ``LIMIT`` bytes are read.
"""

from __future__ import annotations

import re

from offloadpool.region.holding.views import process_ids

#: most bytes of ``/proc/<pid>/cgroup`` read (a path is at most a few hundred bytes)
LIMIT = 8192

#: the pod level of a kubelet-made cgroup path: ``pod`` and a uid, dashes or underscores
_POD = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?(?=/|$)"
)


def pod_of_path(path: str) -> str | None:
    """The pod uid (with dashes) of the first pod level in the cgroup ``path``, or None."""
    found = _POD.search(path)
    return found.group(1).replace("_", "-") if found else None


def pod_of(pid: int, proc: str = "/proc") -> str | None:
    """The uid of the pod process ``pid`` runs in, from its cgroup; None when it is in no pod's
    cgroup, or is gone. On cgroup v1 every hierarchy's line is looked at; the first with a pod
    level answers (the kubelet puts a pod's containers in the same pod level of each)."""
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as fh:
            text = fh.read(LIMIT).decode("utf-8", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        uid = pod_of_path(path)
        if uid is not None:
            return uid
    return None


def live_pods(proc: str = "/proc") -> set[str]:
    """The uids of every pod with a process on the node (one read of each ``/proc/<pid>/cgroup``).

    Why processes and not the kubelet's cgroup directories: the agent's own cgroup namespace may
    show only its container's subtree of ``/sys/fs/cgroup``, while ``/proc`` (hostPID) shows every
    process's path. A pod's sandbox and sidecars live as long as the pod, so a pod is live here
    from its first container's start until the kubelet has killed it."""
    return {uid for pid in process_ids(proc) if (uid := pod_of(pid, proc)) is not None}
