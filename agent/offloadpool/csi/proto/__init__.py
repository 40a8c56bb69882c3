"""The CSI spec's v1 protocol, as Python stubs generated from its pinned ``csi.proto``.

Source: the Go module ``github.com/container-storage-interface/spec`` at ``SPEC_VERSION``
(``go mod download -json github.com/container-storage-interface/spec@v1.13.0`` names the folder
holding ``csi.proto``), Apache-2.0. ``csi.proto`` here is that file, byte for byte
(``CSI_PROTO_SHA256``); ``csi_pb2.py`` and ``csi_pb2_grpc.py`` were made from it by
``python3 -m hack.csi_proto`` (grpcio-tools' protoc, ``GENERATED_BY``), which fetches the
pinned module, checks the hash and writes all three. ``tests/test_csi_proto.py`` fails when
the committed proto's hash differs from the pin or the stubs' descriptor differs from what
protoc compiles from it.

The proto is compiled as ``offloadpool/csi/proto/csi.proto`` so that the generated modules
import each other as ``offloadpool.csi.proto.*`` (protoc writes imports from the proto's path).
Its package stays ``csi.v1``: the gRPC method names the kubelet calls are unchanged.
"""

SPEC_MODULE = "github.com/container-storage-interface/spec"
SPEC_VERSION = "v1.13.0"
#: sha256 of ``csi.proto`` at ``SPEC_VERSION`` (the file the Go module proxy serves)
CSI_PROTO_SHA256 = "8c5604cb76fefff19c01cf88ebd229e4f8c88c419898b07e4914318d25d84af3"
#: the path the proto is compiled under (see above)
PROTO_PATH = "offloadpool/csi/proto/csi.proto"
#: what made the committed stubs
GENERATED_BY = "python3 -m hack.csi_proto (grpcio-tools 1.85.1)"
