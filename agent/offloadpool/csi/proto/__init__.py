"""The gRPC protocols the CSI node plugin speaks, as Python stubs generated from pinned protos.

- ``csi.proto``: the CSI spec v1 (Identity, Node), from the Go module
  ``github.com/container-storage-interface/spec`` at ``CSI.version`` (Apache-2.0).
- ``pluginregistration.proto``: the kubelet's plugin registration (``Registration``:
  ``GetInfo``, ``NotifyRegistrationStatus``), the file ``pkg/apis/pluginregistration/v1/api.proto``
  of the Go module ``k8s.io/kubelet`` at ``REGISTRATION.version`` (Apache-2.0).

Each committed proto is its module's file byte for byte (``sha256``; ``go mod download -json
<module>@<version>`` names the folder holding it); its ``*_pb2.py`` and ``*_pb2_grpc.py`` were
made from it by ``python3 -m hack.csi_proto`` (grpcio-tools' protoc, ``GENERATED_BY``), which
fetches the pinned modules, checks the hashes and writes all of them. ``tests/test_csi_proto.py``
fails when a committed proto's hash differs from its pin or its stubs' descriptor differs from
what protoc compiles from it.

Each proto is compiled as ``offloadpool/csi/proto/<name>.proto`` so that the generated modules
import each other as ``offloadpool.csi.proto.*`` (protoc writes imports from the proto's path).
Their packages stay ``csi.v1`` and ``pluginregistration``: the gRPC method names the kubelet
calls are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class PinnedProto:
    module: str
    """The Go module that publishes the proto."""
    version: str
    """Its pinned version (what ``go mod download`` fetches)."""
    source: str
    """The proto's path inside the module."""
    sha256: str
    """sha256 of that file at ``version`` (the file the Go module proxy serves)."""
    path: str
    """The path the proto is committed and compiled under (see above)."""

    @property
    def name(self) -> str:
        """The committed file's name (``csi.proto``)."""
        return PurePosixPath(self.path).name

    @property
    def generated(self) -> tuple[str, str]:
        """The stubs protoc makes from it (``csi_pb2.py``, ``csi_pb2_grpc.py``)."""
        stem = PurePosixPath(self.path).stem
        return (f"{stem}_pb2.py", f"{stem}_pb2_grpc.py")


CSI = PinnedProto(
    module="github.com/container-storage-interface/spec",
    version="v1.13.0",
    source="csi.proto",
    sha256="8c5604cb76fefff19c01cf88ebd229e4f8c88c419898b07e4914318d25d84af3",
    path="offloadpool/csi/proto/csi.proto",
)
#: the kubelet's release the registration API is taken from (the cluster's kubelet is 1.37)
REGISTRATION = PinnedProto(
    module="k8s.io/kubelet",
    version="v0.37.2",
    source="pkg/apis/pluginregistration/v1/api.proto",
    sha256="7a67a0000a1a167c155286834bc9ccb489f8bcdb394e006daba270189c272afa",
    path="offloadpool/csi/proto/pluginregistration.proto",
)
PINNED = (CSI, REGISTRATION)
#: what made the committed stubs
GENERATED_BY = "python3 -m hack.csi_proto (grpcio-tools 1.85.1)"
