"""The plugin's gRPC servers on their unix sockets, and its command line.

At start the holders are rebuilt from the records and the mount table
(``publication.rebuild``) before the CSI socket is served: the kubelet's first call after a
restart sees exactly the volumes that are still mounted. The registration socket is served
only after the CSI socket (the kubelet dials the CSI endpoint as soon as it reads it), by a
server of its own (a gRPC server takes no socket once started), and removed first at a stop:
the kubelet then deregisters the driver instead of calling a plugin that is gone.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from types import FrameType

import grpc

from offloadpool.csi import bind, probe, publication
from offloadpool.csi.config import CsiConfig
from offloadpool.csi.identity import Identity
from offloadpool.csi.node import Node
from offloadpool.csi.proto import csi_pb2_grpc, pluginregistration_pb2_grpc
from offloadpool.csi.registration import Registration
from offloadpool.region.published import Published


@dataclass
class Plugin:
    """The running plugin: its two servers and the volumes the rebuild kept."""

    config: CsiConfig
    csi: grpc.Server
    registration: grpc.Server
    registrar: Registration
    kept: list[Published]

    def stop(self, grace: float | None = None) -> None:
        """Deregistered first (server stopped, socket removed), then the CSI server."""
        self.registration.stop(grace).wait()
        _unlink(self.config.registration)
        self.csi.stop(grace).wait()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: the longest path a unix socket takes (``sun_path`` is 108 bytes, NUL included)
SOCKET_PATH_MAX = 107


def _listen(server: grpc.Server, path: str) -> None:
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise ValueError(f"socket path {path!r} is longer than {SOCKET_PATH_MAX} bytes")
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    _unlink(path)  # a socket a killed plugin left: its name must be free to bind
    server.add_insecure_port(f"unix://{path}")


def serve(config: CsiConfig, *, workers: int = 4) -> Plugin:
    """The started plugin: CSI served, then registration."""
    bind.prepare_stage(config.stage)
    kept = publication.rebuild(config)
    csi = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), csi)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(config), csi)
    _listen(csi, config.endpoint)
    csi.start()
    registrar = Registration(config.endpoint)
    registration = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registrar, registration)
    _listen(registration, config.registration)
    registration.start()
    return Plugin(config, csi, registration, registrar, kept)


def main(argv: Sequence[str] | None = None) -> int:
    """The plugin; ``probe`` first: the liveness probe (``csi.probe``) with the same flags."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["probe"]:
        return probe.main(args[1:])
    config = CsiConfig.from_args(args)
    plugin = serve(config)

    def stop(signum: int, frame: FrameType | None) -> None:
        plugin.stop(grace=5)

    signal.signal(signal.SIGTERM, stop)
    print(
        f"serving {config.endpoint} (registration {config.registration}) for node {config.node_id};"
        f" {len(plugin.kept)} published volumes",
        flush=True,
    )
    plugin.csi.wait_for_termination()
    return 0
