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
from offloadpool.region.holding.published import Published


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


#: The sockets and the CSI socket's own directory: root's only. The kubelet (root) dials them;
#: whoever else could connect could publish any pool to a target of its choosing.
SOCKET_MODE = 0o600
SOCKET_DIR_MODE = 0o700


def _listen(server: grpc.Server, path: str, *, own_dir: bool) -> None:
    """Serve ``server`` on the unix socket ``path``, made root-only: created under a umask that
    leaves no one else a bit (no window where it is another's), then moded again by name (the
    directory is root's). ``own_dir``: the directory is the plugin's alone (``plugins/<driver>``),
    made root's, 0700; the registration socket's is the kubelet's, shared, and left as it is."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise ValueError(f"socket path {path!r} is longer than {SOCKET_PATH_MAX} bytes")
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=SOCKET_DIR_MODE, exist_ok=True)
    if own_dir:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, SOCKET_DIR_MODE)
        finally:
            os.close(fd)
    _unlink(path)  # a socket a killed plugin left: its name must be free to bind
    old = os.umask(0o777 & ~SOCKET_MODE)
    try:
        server.add_insecure_port(f"unix://{path}")
    finally:
        os.umask(old)
    os.chmod(path, SOCKET_MODE)


def serve(config: CsiConfig, *, workers: int = 4) -> Plugin:
    """The started plugin: CSI served, then registration."""
    bind.prepare_stage(config.stage)
    kept = publication.rebuild(config)
    csi = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), csi)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(config), csi)
    _listen(csi, config.endpoint, own_dir=True)
    csi.start()
    registrar = Registration(config.endpoint)
    registration = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registrar, registration)
    _listen(registration, config.registration, own_dir=False)
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
