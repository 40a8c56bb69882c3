"""The committed stubs of the node plugins (CSI, DRA) are the pinned protos': each proto's hash is its
pin, and its stubs' descriptor is exactly what protoc compiles from that proto (hack/csi_proto.py
made them all)."""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from hack.csi_proto import OUT_ROOT, PINNED, compile_proto, proto_dir
from offloadpool.csi import proto as pin
from offloadpool.dra import proto as dra_pin

#: the hashes written out again: a changed pin must change this test too
HASHES = {
    "csi.proto": "8c5604cb76fefff19c01cf88ebd229e4f8c88c419898b07e4914318d25d84af3",
    "pluginregistration.proto": "7a67a0000a1a167c155286834bc9ccb489f8bcdb394e006daba270189c272afa",
    "dra.proto": "b3066ad7f6abcfd0003c47b06ceb801d76997d78d6be505597478d3905b9cc57",
}
#: the package and the services the kubelet calls (gRPC method names are /<package>.<service>/...)
SERVICES = {
    "csi.proto": ("csi.v1", {"Identity", "Node", "Controller"}),
    "pluginregistration.proto": ("pluginregistration", {"Registration"}),
    "dra.proto": ("k8s.io.kubelet.pkg.apis.dra.v1", {"DRAPlugin"}),
}
#: the folders the stubs are committed in, and the module docstring naming each folder's pins
DOCS = {"offloadpool/csi/proto": pin.__doc__, "offloadpool/dra/proto": dra_pin.__doc__}


@pytest.mark.parametrize("pinned", PINNED, ids=lambda p: p.name)
def test_the_committed_proto_is_the_pinned_one(pinned: pin.PinnedProto):
    data = (proto_dir(pinned) / pinned.name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == pinned.sha256 == HASHES[pinned.name]
    doc = DOCS[str(Path(pinned.path).parent)]
    assert doc is not None and pinned.module in doc and pinned.source in doc
    assert pinned.version in (pin.CSI.version, pin.REGISTRATION.version)


def test_the_pins_cover_every_committed_proto():
    committed = {f.name for folder in DOCS for f in (OUT_ROOT / folder).glob("*.proto")}
    assert {p.name for p in PINNED} == committed == set(HASHES)


def test_the_dra_plugin_speaks_the_kubelets_release():
    """The DRA proto is the cluster's kubelet's (the registration proto's release), and the DRA
    plugin registers through the CSI plugin's registration stubs (one compiled copy)."""
    assert dra_pin.DRA.version == pin.REGISTRATION.version
    assert not list((OUT_ROOT / "offloadpool/dra/proto").glob("pluginregistration*"))


def _without_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for f in message.field:
        f.ClearField("json_name")
    for nested in message.nested_type:
        _without_json_names(nested)


@pytest.mark.parametrize("pinned", PINNED, ids=lambda p: p.name)
def test_the_stubs_are_compiled_from_the_committed_proto(tmp_path: Path, pinned: pin.PinnedProto):
    """Compared as descriptors, not bytes: another protoc release writes other Python around
    the same descriptor, which is what defines the messages and the services. protoc's Python
    output leaves out the derived ``json_name`` of each field; the descriptor set keeps it."""
    # imported first: the stubs register the proto's option extensions (csi.proto's
    # ``csi_secret`` ...), which the descriptor set's options are then parsed with
    pb2, pb2_grpc = (
        importlib.import_module(f"{Path(pinned.path).parent.as_posix().replace('/', '.')}.{Path(name).stem}")
        for name in pinned.generated
    )
    out = tmp_path / "proto.desc"
    compile_proto(pinned, (proto_dir(pinned) / pinned.name).read_bytes(), tmp_path, descriptor_set=out)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (ours,) = [f for f in compiled.file if f.name == pinned.path]
    for message in ours.message_type:
        _without_json_names(message)
    for extension in ours.extension:
        extension.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb2.DESCRIPTOR.serialized_pb)
    assert committed == ours
    package, services = SERVICES[pinned.name]
    assert committed.package == package
    assert {s.name for s in committed.service} >= services
    for service in services:
        assert hasattr(pb2_grpc, f"add_{service}Servicer_to_server")
