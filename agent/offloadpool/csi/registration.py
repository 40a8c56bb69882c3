"""The kubelet's plugin registration (``pluginregistration.Registration``), served by the plugin.

The kubelet's plugin watcher finds a socket in ``<kubelet>/plugins_registry/``, calls ``GetInfo``
on it, checks the type and versions, dials the ``endpoint`` it is told, calls ``NodeGetInfo``
there (and writes the node id into the node's ``CSINode`` object), and then reports the outcome
with ``NotifyRegistrationStatus``. Removing the socket deregisters the driver.

Served by the plugin itself rather than by the node-driver-registrar sidecar: one process and
one image (no second Go binary to build, pin and ship), and grpcio is already the plugin's; the
sidecar only answers these two calls from its flags.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from offloadpool.csi.config import DRIVER_NAME
from offloadpool.csi.proto import pluginregistration_pb2, pluginregistration_pb2_grpc

#: the plugin type the kubelet's CSI plugin handler registers
PLUGIN_TYPE = "CSIPlugin"
#: the CSI versions the plugin speaks, in the form the kubelet's handler parses (semver; it
#: accepts a major version 1)
SUPPORTED_VERSIONS = ("1.0.0",)


class Registration(pluginregistration_pb2_grpc.RegistrationServicer):
    """One plugin's registration: the CSI plugin's by default; the DRA plugin (``offloadpool.dra``)
    serves the same with its own type and versions."""

    def __init__(
        self,
        endpoint: str,
        *,
        plugin_type: str = PLUGIN_TYPE,
        name: str = DRIVER_NAME,
        versions: tuple[str, ...] = SUPPORTED_VERSIONS,
    ) -> None:
        self.endpoint = endpoint
        self.plugin_type = plugin_type
        self.name = name
        self.versions = versions
        self._lock = threading.Lock()
        self._status: tuple[bool, str] | None = None

    @property
    def status(self) -> tuple[bool, str] | None:
        """The kubelet's last word (registered, its error), or None before it spoke."""
        with self._lock:
            return self._status

    def GetInfo(self, request: Any, context: Any) -> Any:
        """The CSI socket as the kubelet must dial it: a host path (the DaemonSet mounts the
        kubelet's directory at the same path)."""
        return pluginregistration_pb2.PluginInfo(
            type=self.plugin_type,
            name=self.name,
            endpoint=self.endpoint,
            supported_versions=list(self.versions),
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        """Kept and logged: a refusal is the kubelet's (a version it does not take, a
        ``NodeGetInfo`` that failed), and it retries while the socket is there."""
        with self._lock:
            self._status = (request.plugin_registered, request.error)
        if request.plugin_registered:
            print(f"registered with the kubelet as {self.name} ({self.plugin_type})", flush=True)
        else:
            print(f"the kubelet refused the registration: {request.error}", file=sys.stderr, flush=True)
        return pluginregistration_pb2.RegistrationStatusResponse()
