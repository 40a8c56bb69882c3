"""The DRA plugin's gRPC servers on their unix sockets, and its command line.

As the CSI plugin's (``csi.server``, whose socket handling it uses): the claims still prepared
are settled from the records and the mount table (``prepare.rebuild``) before ``dra.v1`` is
served; registration is served only after it, by a server of its own, and removed first at a
stop. Registration: type ``DRAPlugin``, name ``offloadpool.io``, version ``v1.DRAPlugin`` (the
service the kubelet 1.37 calls), on ``offloadpool.io-dra-reg.sock`` (the CSI plugin's
registration socket is ``offloadpool.io-reg.sock``).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from types import FrameType

import grpc
from kubernetes import client

from offloadpool.api.dra import DRA_DRIVER
from offloadpool.csi import bind
from offloadpool.csi.proto import pluginregistration_pb2_grpc
from offloadpool.csi.registration import Registration
from offloadpool.csi.server import _listen, _unlink
from offloadpool.dra import prepare
from offloadpool.dra.config import DraConfig
from offloadpool.dra.plugin import DraPlugin
from offloadpool.dra.proto import dra_pb2_grpc
from offloadpool.region.holding.published import Published

PLUGIN_TYPE = "DRAPlugin"
#: the kubelet's name of the dra.v1 service (``k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService``)
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)


@dataclass
class Plugin:
    config: DraConfig
    dra: grpc.Server
    registration: grpc.Server
    registrar: Registration
    kept: list[Published]

    def stop(self, grace: float | None = None) -> None:
        self.registration.stop(grace).wait()
        _unlink(self.config.registration)
        self.dra.stop(grace).wait()


def api_client(config: DraConfig) -> client.ApiClient:
    """The API the claims are read from: the kubeconfig given, else in-cluster, else the default."""
    from kubernetes import config as kube_config

    from offloadpool.agent.kube import configuration

    if config.kubeconfig:
        cfg = client.Configuration()
        kube_config.load_kube_config(config_file=config.kubeconfig, client_configuration=cfg)
        return client.ApiClient(cfg)
    return client.ApiClient(configuration())


def serve(config: DraConfig, api: client.ApiClient, *, workers: int = 4) -> Plugin:
    bind.prepare_stage(config.stage)
    kept = prepare.rebuild(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    dra_pb2_grpc.add_DRAPluginServicer_to_server(DraPlugin(config, api), server)
    _listen(server, config.endpoint, own_dir=True)
    server.start()
    registrar = Registration(
        config.endpoint, plugin_type=PLUGIN_TYPE, name=DRA_DRIVER, versions=SUPPORTED_VERSIONS
    )
    registration = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(registrar, registration)
    _listen(registration, config.registration, own_dir=False)
    registration.start()
    return Plugin(config, server, registration, registrar, kept)


def main(argv: Sequence[str] | None = None) -> int:
    config = DraConfig.from_args(list(sys.argv[1:] if argv is None else argv))
    plugin = serve(config, api_client(config))

    def stop(signum: int, frame: FrameType | None) -> None:
        plugin.stop(grace=5)

    signal.signal(signal.SIGTERM, stop)
    print(
        f"serving {config.endpoint} (registration {config.registration}) for node {config.node_id};"
        f" {len(plugin.kept)} prepared claims",
        flush=True,
    )
    plugin.dra.wait_for_termination()
    return 0
