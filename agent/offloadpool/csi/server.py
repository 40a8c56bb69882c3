"""The plugin's gRPC server on its unix socket, and its command line.

At start the holders are rebuilt from the records and the mount table
(``publication.rebuild``) before the socket is served: the kubelet's first call after a
restart sees exactly the volumes that are still mounted.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent import futures

import grpc

from offloadpool.csi import publication
from offloadpool.csi.config import CsiConfig
from offloadpool.csi.identity import Identity
from offloadpool.csi.node import Node
from offloadpool.csi.proto import csi_pb2_grpc
from offloadpool.region.published import Published


def serve(config: CsiConfig, *, workers: int = 4) -> tuple[grpc.Server, list[Published]]:
    """The started server and the volumes that hold their pools (kept by the rebuild)."""
    kept = publication.rebuild(config)
    os.makedirs(os.path.dirname(config.endpoint), mode=0o750, exist_ok=True)
    try:  # a socket a killed plugin left: its name must be free to bind
        os.unlink(config.endpoint)
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    csi_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    csi_pb2_grpc.add_NodeServicer_to_server(Node(config), server)
    server.add_insecure_port(f"unix://{config.endpoint}")
    server.start()
    return server, kept


def main(argv: Sequence[str] | None = None) -> int:
    config = CsiConfig.from_args(argv)
    server, kept = serve(config)
    print(f"serving {config.endpoint} for node {config.node_id}; {len(kept)} published volumes", flush=True)
    server.wait_for_termination()
    return 0
