"""The kubelet's DRA plugin protocol, as Python stubs generated from the pinned proto.

- ``dra.proto``: the kubelet's ``DRAPlugin`` service (``NodePrepareResources``,
  ``NodeUnprepareResources``), the file ``pkg/apis/dra/v1/api.proto`` of the Go module
  ``k8s.io/kubelet`` at ``DRA.version`` (Apache-2.0): the release of the cluster's kubelet, the
  one the CSI plugin's registration proto is taken from.

Made and checked exactly as the CSI plugin's stubs are (``offloadpool.csi.proto``): the committed
proto is the module's file byte for byte (``sha256``), its ``*_pb2.py`` and ``*_pb2_grpc.py``
were made from it by ``python3 -m hack.csi_proto`` (which writes every pinned proto of the
project), and ``tests/test_csi_proto.py`` fails when either drifts. The package stays
``k8s.io.kubelet.pkg.apis.dra.v1``: the gRPC method names the kubelet calls are unchanged.

The plugin-registration proto is not compiled a second time here: the DRA plugin uses the CSI
plugin's stubs (``offloadpool.csi.proto.pluginregistration_pb2``). Two compiled copies would
define the package ``pluginregistration`` twice in protobuf's one descriptor pool, which refuses
the second in a process that imports both.
"""

from __future__ import annotations

from offloadpool.csi.proto import REGISTRATION, PinnedProto

DRA = PinnedProto(
    module="k8s.io/kubelet",
    version=REGISTRATION.version,
    source="pkg/apis/dra/v1/api.proto",
    sha256="b3066ad7f6abcfd0003c47b06ceb801d76997d78d6be505597478d3905b9cc57",
    path="offloadpool/dra/proto/dra.proto",
)
PINNED = (DRA,)
