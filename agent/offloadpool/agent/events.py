"""Events about this node's OffloadPoolNode, each distinct one once.

A failing step is retried every retry period, and a pool an engine holds says why at every
step: an Event for each would flood the namespace. So an Event is posted only when its reason
or note differs from the last one this process posted.
"""

from __future__ import annotations

from typing import Any

from offloadpool.agent import kube


class NodeEvents:
    """Posts core/v1 Events about the OffloadPoolNode, skipping a repeat of the last one."""

    def __init__(self, access: kube.KubeAccess) -> None:
        self.access = access
        self._last: tuple[str, str] | None = None

    def post(self, about: dict[str, Any] | None, type_: str, reason: str, note: str) -> None:
        """One Event about ``about`` (the OffloadPoolNode as last seen; None: nothing to post
        about yet) unless it repeats the last (reason, note)."""
        if about is None or self._last == (reason, note):
            return
        self._last = (reason, note)
        self.access.event(about, "OffloadPoolNode", reason, note, type_)
