"""The CSI Identity service: who the plugin is, and that it is up."""

from __future__ import annotations

from typing import Any

from offloadpool import __version__
from offloadpool.csi.config import DRIVER_NAME
from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc


class Identity(csi_pb2_grpc.IdentityServicer):
    def GetPluginInfo(self, request: Any, context: Any) -> Any:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def GetPluginCapabilities(self, request: Any, context: Any) -> Any:
        """None: ``CONTROLLER_SERVICE`` is for plugins that provision volumes through the API
        (inline ephemeral volumes have no controller side), and ``VOLUME_ACCESSIBILITY_CONSTRAINTS``
        for topology, which a node-local pool does not need: the pod is already on its node."""
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=[])

    def Probe(self, request: Any, context: Any) -> Any:
        return csi_pb2.ProbeResponse(ready={"value": True})
