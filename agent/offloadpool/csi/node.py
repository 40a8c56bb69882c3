"""The CSI Node service: the node's id, and publish/unpublish of inline ephemeral volumes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offloadpool.csi import publication, volume
from offloadpool.csi.config import CsiConfig
from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc
from offloadpool.csi.refusal import Refused


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, config: CsiConfig) -> None:
        self.config = config

    def NodeGetInfo(self, request: Any, context: Any) -> Any:
        """The node's name: the kubelet's ``--hostname-override``, as the agent is told it."""
        return csi_pb2.NodeGetInfoResponse(node_id=self.config.node_id)

    def NodeGetCapabilities(self, request: Any, context: Any) -> Any:
        """None: no staging (``STAGE_UNSTAGE_VOLUME``: nothing is shared between a node's pods
        of one volume), no stats or expansion of a pool through its volume."""
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[])

    def NodePublishVolume(self, request: Any, context: Any) -> Any:
        return _answer(
            context,
            lambda: publication.publish(
                self.config, volume.publish_request(request, self.config.kubelet_dir)
            ),
            csi_pb2.NodePublishVolumeResponse,
        )

    def NodeUnpublishVolume(self, request: Any, context: Any) -> Any:
        return _answer(
            context,
            lambda: publication.unpublish(
                self.config, volume.unpublish_request(request, self.config.kubelet_dir)
            ),
            csi_pb2.NodeUnpublishVolumeResponse,
        )


def _answer(context: Any, act: Callable[[], object], response: Callable[[], Any]) -> Any:
    """Run ``act``; a refusal ends the call with its gRPC status code and message."""
    try:
        act()
    except Refused as refused:
        context.abort(refused.code, refused.message)
    return response()
