"""Regenerate the CSI v1 stubs (``agent/offloadpool/csi/proto``) from the pinned spec.

Why: the CSI node plugin speaks the spec's gRPC protocol; its Python stubs are committed (the
plugin's image then needs only ``grpcio`` and ``protobuf``, no protoc), so where they came from
must be repeatable. This fetches ``csi.proto`` from the pinned Go module (``go mod download``,
the Go module proxy: how every other pinned source of the project arrives), refuses a file
whose sha256 is not the pinned one, and compiles it with grpcio-tools' protoc::

    .venv/bin/pip install grpcio-tools   # in the `test` extra
    python3 -m hack.csi_proto            # writes csi.proto, csi_pb2.py, csi_pb2_grpc.py

To move to another spec release, change ``SPEC_VERSION`` and ``CSI_PROTO_SHA256`` in
``offloadpool/csi/proto/__init__.py`` (and ``GENERATED_BY`` if protoc changed), run this, and
run ``tests/test_csi_proto.py``.
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

REPO = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO / "agent"
PROTO_DIR = OUT_ROOT / "offloadpool" / "csi" / "proto"
GENERATED = ("csi_pb2.py", "csi_pb2_grpc.py")


def fetch_proto() -> bytes:
    """The pinned ``csi.proto`` from the Go module proxy, checked against its sha256."""
    module = f"{pin.SPEC_MODULE}@{pin.SPEC_VERSION}"
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
    data = (Path(info["Dir"]) / "csi.proto").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != pin.CSI_PROTO_SHA256:
        raise BuildError(f"{module}'s csi.proto has sha256 {digest}, pinned {pin.CSI_PROTO_SHA256}")
    return data


def compile_proto(proto: bytes, out_dir: Path, *, descriptor_set: Path | None = None) -> None:
    """protoc (grpcio-tools) over ``proto`` laid out at ``PROTO_PATH``: the stubs go under
    ``out_dir`` (``out_dir/offloadpool/csi/proto/``), or only a descriptor set when asked."""
    from grpc_tools import protoc  # the `test` extra: only this script and its test need it

    includes = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory() as src:
        where = Path(src) / pin.PROTO_PATH
        where.parent.mkdir(parents=True)
        where.write_bytes(proto)
        outputs = (
            [f"--descriptor_set_out={descriptor_set}"]
            if descriptor_set is not None
            else [f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
        )
        args = ["grpc_tools.protoc", f"-I{src}", f"-I{includes}", *outputs, pin.PROTO_PATH]
        if protoc.main(args) != 0:
            raise BuildError(f"protoc failed: {' '.join(args)}")


def generate() -> None:
    proto = fetch_proto()
    with tempfile.TemporaryDirectory() as out:
        compile_proto(proto, Path(out))
        made = Path(out) / Path(pin.PROTO_PATH).parent
        for name in GENERATED:
            shutil.copyfile(made / name, PROTO_DIR / name)
    (PROTO_DIR / "csi.proto").write_bytes(proto)
    print(f"wrote csi.proto ({pin.SPEC_VERSION}, sha256 {pin.CSI_PROTO_SHA256}) and {', '.join(GENERATED)}")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python3 -m hack.csi_proto", description=__doc__).parse_args(argv)
    try:
        generate()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
