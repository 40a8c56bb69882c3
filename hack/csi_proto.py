"""Regenerate the node plugins' gRPC stubs (``agent/offloadpool/{csi,dra}/proto``) from the pinned protos.

Why: the CSI node plugin speaks the CSI spec's gRPC protocol and the kubelet's plugin
registration, the DRA plugin the kubelet's ``dra.v1`` and the same registration; their Python
stubs are committed (the plugin's image then needs only ``grpcio``
and ``protobuf``, no protoc), so where they came from must be repeatable. For each pinned proto
(``PINNED``: ``offloadpool.csi.proto.PINNED`` and ``offloadpool.dra.proto.PINNED``) this
fetches the file from its Go module (``go mod
download``, the Go module proxy: how every other pinned source of the project arrives), refuses
one whose sha256 is not the pinned one, and compiles it with grpcio-tools' protoc::

    .venv/bin/pip install grpcio-tools   # in the `test` extra
    python3 -m hack.csi_proto            # writes csi.proto, pluginregistration.proto, dra.proto, their stubs

To move to another release, change the pin's ``version`` and ``sha256`` in
``offloadpool/csi/proto/__init__.py`` or ``offloadpool/dra/proto/__init__.py`` (and
``GENERATED_BY`` if protoc changed), run this, and run ``tests/test_csi_proto.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hack.controlplane_build import BuildError, go_env
from offloadpool.csi import proto as pin
from offloadpool.dra import proto as dra_pin

REPO = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO / "agent"
#: every pinned proto of the project, each committed at its ``path`` under ``OUT_ROOT``
PINNED: tuple[pin.PinnedProto, ...] = (*pin.PINNED, *dra_pin.PINNED)


def proto_dir(pinned: pin.PinnedProto) -> Path:
    """The folder the proto and its stubs are committed in (``agent/offloadpool/csi/proto``)."""
    return OUT_ROOT / Path(pinned.path).parent


def fetch_proto(proto: pin.PinnedProto) -> bytes:
    """The pinned proto from the Go module proxy, checked against its sha256."""
    module = f"{proto.module}@{proto.version}"
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            ["go", "mod", "download", "-json", module],
            cwd=cwd,
            env=go_env(),
            capture_output=True,
            text=True,
        )
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or info.get("Error") or "Dir" not in info:
        raise BuildError(f"go mod download {module}: {info.get('Error') or out.stderr.strip()}")
    data = (Path(info["Dir"]) / proto.source).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != proto.sha256:
        raise BuildError(f"{module}'s {proto.source} has sha256 {digest}, pinned {proto.sha256}")
    return data


def compile_proto(
    pinned: pin.PinnedProto, proto: bytes, out_dir: Path, *, descriptor_set: Path | None = None
) -> None:
    """protoc (grpcio-tools) over ``proto`` laid out at ``pinned.path``: the stubs go under
    ``out_dir`` (``out_dir/<pinned.path's folder>/``), or only a descriptor set when asked."""
    from grpc_tools import protoc  # the `test` extra: only this script and its test need it

    includes = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as src:
        where = Path(src) / pinned.path
        where.parent.mkdir(parents=True)
        where.write_bytes(proto)
        outputs = (
            [f"--descriptor_set_out={descriptor_set}"]
            if descriptor_set is not None
            else [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
        )
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{includes}", *outputs, pinned.path]
        if protoc.main(args) != 0:
            raise BuildError(f"protoc failed: {' '.join(args)}")


def generate(pinned: pin.PinnedProto) -> None:
    proto = fetch_proto(pinned)
    with tempfile.TemporaryDirectory() as out:
        compile_proto(pinned, proto, Path(out))
        made = Path(out) / Path(pinned.path).parent
        for name in pinned.generated:
            shutil.copyfile(made / name, proto_dir(pinned) / name)
    (proto_dir(pinned) / pinned.name).write_bytes(proto)
    print(
        f"wrote {pinned.name} ({pinned.module}@{pinned.version}, sha256 {pinned.sha256})"
        f" and {', '.join(pinned.generated)}"
    )


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python3 -m hack.csi_proto", description=__doc__).parse_args(argv)
    try:
        for pinned in PINNED:
            generate(pinned)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
