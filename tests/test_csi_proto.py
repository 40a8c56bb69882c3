"""The committed CSI stubs are the pinned spec's: the proto's hash is the pin, and the stubs'
descriptor is exactly what protoc compiles from that proto (hack/csi_proto.py made both)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from google.protobuf import descriptor_pb2

from hack.csi_proto import PROTO_DIR, compile_proto
from offloadpool.csi import proto as pin
from offloadpool.csi.proto import csi_pb2, csi_pb2_grpc


def test_the_committed_proto_is_the_pinned_one():
    data = (PROTO_DIR / "csi.proto").read_bytes()
    assert hashlib.sha256(data).hexdigest() == pin.CSI_PROTO_SHA256
    assert pin.SPEC_VERSION in pin.__doc__ and pin.CSI_PROTO_SHA256 == (
        "8c5604cb76fefff19c01cf88ebd229e4f8c88c419898b07e4914318d25d84af3"
    )


def _without_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for f in message.field:
        f.ClearField("json_name")
    for nested in message.nested_type:
        _without_json_names(nested)


def test_the_stubs_are_compiled_from_the_committed_proto(tmp_path: Path):
    """Compared as descriptors, not bytes: another protoc release writes other Python around
    the same descriptor, which is what defines the messages and the services. protoc's Python
    output leaves out the derived ``json_name`` of each field; the descriptor set keeps it."""
    out = tmp_path / "csi.desc"
    compile_proto((PROTO_DIR / "csi.proto").read_bytes(), tmp_path, descriptor_set=out)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (ours,) = [f for f in compiled.file if f.name == pin.PROTO_PATH]
    for message in ours.message_type:
        _without_json_names(message)
    for extension in ours.extension:
        extension.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(csi_pb2.DESCRIPTOR.serialized_pb)
    assert committed == ours
    assert committed.package == "csi.v1"
    assert {s.name for s in committed.service} >= {"Identity", "Node", "Controller"}
    assert hasattr(csi_pb2_grpc, "add_NodeServicer_to_server")
