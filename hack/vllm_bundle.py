#!/usr/bin/env python3
"""Build the bundle that lets a GPU machine without a package registry run the pinned vLLM.

Why this exists: ``hack/gpu-check.sh`` proves vLLM's own worker moving blocks GPU <-> pool, so
the GPU machine needs vLLM 0.33.0. The pinned environment (hack/vllm_env.py) is several GB; the
GPU machine of docs/testing.md ("The GPU check") reaches no registry and takes at most 64 MiB
with the repository. Its image already has torch (2.11), transformers and most of the import
chain; what it lacks fits in this bundle, built from the cached pinned environment:

    vllm-src.tar.xz              vLLM's Python tree and dist-info, without its compiled
                                 extensions, bytecode, the vllm-rs binary and the sources,
                                 headers and web assets no GPU check imports (EXCLUDED_*)
    _C_stable_libtorch.abi3.so.xz  the one extension the check needs (``swap_blocks_batch``;
                                 it calls torch through the stable C ABI only), its CUDA
                                 fatbins cut to what one GPU architecture loads (slim_fatbins;
                                 host code byte-identical), and SHA256SUMS of the cut .so
    whl/*.whl                    cp312 wheels of the distributions the image lacks (WHEELS)
    run.sh                       a copy of hack/vllm_bundle_run.sh: unpacks all of it and runs
                                 hack/gpu-check.sh with OFFLOADPOOL_VLLM_PYTHON set

    python3 hack/vllm_bundle.py build [--out DIR] [--sm 90]

then on the GPU machine, from the repository root: ``bash .gpuvllm/run.sh`` (with the device
tool: carry [".gpuvllm"]). ``build`` refuses a bundle over 56 MiB (the carry limit is 64 MiB,
repository included) and prints its size.

Standard library only, like hack/vllm_env.py (whose ``ensure`` it calls when the environment is
missing); pip is run as the pinned environment's own ``python -m pip``.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

VLLM_VERSION = "0.33.0"
ROOT = Path(__file__).resolve().parent.parent
VLLM_ENV = ROOT / "hack" / "vllm_env.py"
REQUIREMENTS = ROOT / "hack" / "vllm-requirements.txt"
RUN_SH = ROOT / "hack" / "vllm_bundle_run.sh"
DEFAULT_OUT = ROOT / ".gpuvllm"
# The carry limit of the device tool is 64 MiB for the bundle and the repository together.
SIZE_LIMIT = 56 * 2**20
# xz -9: a 64 MiB dictionary (what the hand-made bundle used); the compressed files are the
# ones that travel, so compression time is well spent.
XZ_PRESET: Final = 9

# The one compiled extension the GPU check loads (vllm._custom_ops' swap_blocks_batch).
# It travels slimmed and separately, never inside the tar.
EXTENSION = "_C_stable_libtorch.abi3.so"

# What of vLLM's tree is left out of vllm-src.tar.xz (paths relative to site-packages).
# Every compiled extension (*.so: flash attention, MoE, MLA, deep_gemm, ... several hundred MB;
# EXTENSION travels on its own) and every __pycache__ are left out as well.
EXCLUDED_DIRS = frozenset(
    {
        "vllm/third_party/fmha_sm100",  # Blackwell (sm_100) attention: CUDA sources and JIT
        "vllm/third_party/tml_fa4",  # FlashAttention 4, sm_100 kernels written in CuTe DSL
        "vllm/third_party/deep_gemm/include",  # CUTLASS/CuTe headers for deep_gemm's JIT
        "vllm/entrypoints/serve/instrumentator/static",  # swagger UI's JS/CSS for the server
    }
)
EXCLUDED_FILES = frozenset({"vllm/vllm-rs"})  # the Rust frontend binary (60 MB)

# Distributions whose cp312 manylinux wheels the bundle carries: each is in vLLM's import chain
# of the modules the gpu tests drive (hack/vllm_env.py's PROBE) and the GPU machine's image
# lacks it. Versions come from hack/vllm-requirements.txt. typing_extensions, urllib3 and
# aiohappyeyeballs the image may have in another version; run.sh installs them only if absent.
WHEELS: dict[str, str] = {
    "aiohappyeyeballs": "required by aiohttp, which vllm.multimodal.media.connector imports",
    "annotated-doc": "required by fastapi",
    "annotated-types": "required by pydantic",
    "apache-tvm-ffi": "required by xgrammar (import tvm_ffi)",
    "cachetools": "vllm.v1.structured_output.utils (LRUCache)",
    "cbor2": "vllm.utils.hashing (block hashes of the prefix cache)",
    "fastapi": "vLLM's serve entrypoints and KV-connector metadata servers",
    "httpcore2": "required by httpx2",
    "httpx2": "required by openai",
    "llguidance": "vllm.v1.structured_output.backend_guidance",
    "msgspec": "vLLM's engine messages (vllm.v1.serial_utils, fault_tolerance)",
    "openai": "vllm.parser (the OpenAI protocol types)",
    "oss-harmony": "openai_harmony, imported by vllm.parser.harmony",
    "partial-json-parser": "vllm.tool_parsers",
    "pybase64": "vllm.multimodal.media",
    "pydantic": "vllm.config (Field, validators), at the pinned version",
    "pydantic_core": "required by pydantic, at exactly the version it names",
    "pyzmq": "vllm.v1.engine (zmq)",
    "sniffio": "required by openai",
    "starlette": "required by fastapi; vllm.entrypoints.serve.middleware",
    "truststore": "required by httpx2 and httpcore2",
    "typing_extensions": "required by pydantic >= 2.14 (typing_extensions >= 4.16)",
    "typing-inspection": "required by pydantic and fastapi",
    "urllib3": "vllm.multimodal.media.connector",
    "xgrammar": "vllm.parser and structured output (xgrammar backend)",
}
# The GPU machine's Python, and the glibc manylinux tags its wheels may need: 2.17 up to 2.31,
# the newest that a wheel in WHEELS needs (llguidance); the image (Ubuntu 24.04) has 2.39.
PYTHON_VERSION = "3.12"
# Newest first: pip prefers the earlier tag, as it does with the local machine's own tags.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(31, 16, -1)] + ["manylinux2014_x86_64"]

# CUDA fatbin layout (as nvcc writes it into .nv_fatbin): a 16-byte header
# <magic u32, version u16, header size u16, payload size u64>, then entries of
# <kind u16, flags u16, header size u32, payload size u64, ..., arch u32 at offset 28>.
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX = 1
KIND_CUBIN = 2


def say(message: str) -> None:
    """Progress goes to stderr; stdout carries the summary of what was built."""
    print(f"vllm_bundle: {message}", file=sys.stderr, flush=True)


# -- the pinned environment ------------------------------------------------------------------


def env_layout() -> dict:
    """hack/vllm_env.py's cache layout; builds the environment first if it is not installed."""
    layout = json.loads(
        subprocess.run(
            [sys.executable, str(VLLM_ENV), "paths"], check=True, capture_output=True, text=True
        ).stdout
    )
    if layout["stamp"] is None:
        say("pinned vLLM environment missing: hack/vllm_env.py ensure")
        subprocess.run([sys.executable, str(VLLM_ENV), "ensure"], check=True, stdout=subprocess.DEVNULL)
        return env_layout()
    return layout


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1 or not (found[0] / "vllm").is_dir():
        raise SystemExit(f"vllm_bundle: no single site-packages with vllm under {venv}: {found}")
    return found[0]


def canonical(name: str) -> str:
    """PEP 503 name normalisation: `Typing_Extensions` and `typing-extensions` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions() -> dict[str, str]:
    """`name==version` lines of hack/vllm-requirements.txt, by canonical name."""
    pins: dict[str, str] = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


# -- vLLM's Python tree ----------------------------------------------------------------------


def excluded(rel: PurePosixPath) -> bool:
    """Whether a path of vLLM's tree (relative to site-packages) stays out of the tar."""
    if "__pycache__" in rel.parts or rel.suffix == ".so" or str(rel) in EXCLUDED_FILES:
        return True
    return any(str(parent) in EXCLUDED_DIRS for parent in (rel, *rel.parents))


def tree_members(site: Path) -> list[PurePosixPath]:
    """vllm/ and vllm-<version>.dist-info/, directories before their contents, sorted."""
    members: list[PurePosixPath] = []
    for top in ("vllm", f"vllm-{VLLM_VERSION}.dist-info"):
        for dirpath, dirnames, filenames in os.walk(site / top):
            rel_dir = PurePosixPath(Path(dirpath).relative_to(site).as_posix())
            dirnames[:] = sorted(d for d in dirnames if not excluded(rel_dir / d))
            members.append(rel_dir)
            members.extend(rel_dir / f for f in sorted(filenames) if not excluded(rel_dir / f))
    return members


def normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """The same tar whoever builds it: root-owned, modes and mtimes as installed."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def write_tree(site: Path, dest: Path) -> int:
    members = tree_members(site)
    with tarfile.open(dest, "w:xz", preset=XZ_PRESET) as tar:
        for rel in members:
            tar.add(site / rel, arcname=str(rel), recursive=False, filter=normalise)
    return len(members)


# -- the extension, its fatbins cut to one architecture --------------------------------------


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(file offset, size) of the named section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, shentsize, shnum, shstrndx = (
        struct.unpack_from("<Q", data, 0x28)[0],
        *struct.unpack_from("<HHH", data, 0x3A),
    )

    def header(index: int) -> tuple[int, int, int]:
        sh_name, _, _, _, sh_offset, sh_size = struct.unpack_from("<IIQQQQ", data, shoff + index * shentsize)
        return sh_name, sh_offset, sh_size

    _, strtab, _ = header(shstrndx)
    for index in range(shnum):
        sh_name, offset, size = header(index)
        end = data.index(b"\0", strtab + sh_name)
        if data[strtab + sh_name : end].decode() == name:
            return offset, size
    raise ValueError(f"no section {name}")


@dataclass
class Entry:
    kind: int  # KIND_PTX or KIND_CUBIN
    arch: int  # e.g. 90 for sm_90
    blob: bytes  # the entry's header and payload


@dataclass
class SlimStats:
    fatbins: int = 0
    unchanged: int = 0
    zeroed: int = 0
    kept: collections.Counter[tuple[int, int]] = field(default_factory=collections.Counter)


def fatbin_entries(data: bytes | bytearray, start: int, end: int) -> list[Entry]:
    entries = []
    pos = start
    while pos < end:
        kind, _, header_size, payload_size = struct.unpack_from("<HHIQ", data, pos)
        arch = struct.unpack_from("<I", data, pos + 28)[0]
        entries.append(Entry(kind, arch, bytes(data[pos : pos + header_size + payload_size])))
        pos += header_size + payload_size
    if pos != end:
        raise ValueError(f"fatbin entries overrun their fatbin ({pos:#x} != {end:#x})")
    return entries


def keep_entries(entries: list[Entry], sm: int) -> list[Entry] | None:
    """What a GPU of compute capability `sm` loads: its cubins, else the newest PTX <= sm it
    can JIT. None when there is neither (the fatbin is then left as it is)."""
    cubins = [e for e in entries if e.kind == KIND_CUBIN and e.arch == sm]
    if cubins:
        return cubins
    ptx = [e for e in entries if e.kind == KIND_PTX and e.arch <= sm]
    if not ptx:
        return None
    newest = max(e.arch for e in ptx)
    return [e for e in ptx if e.arch == newest]


def slim_fatbins(data: bytearray, sm: int) -> SlimStats:
    """Cut every fatbin in .nv_fatbin to keep_entries(), in place. Kept entries move to the
    front, the fatbin's size field shrinks, the freed tail is zeroed (it compresses to almost
    nothing); no offset changes, so host code and every other section stay byte-identical."""
    offset, size = elf_section(data, ".nv_fatbin")
    stats = SlimStats()
    pos, end = offset, offset + size
    while pos < end:
        magic, _, header_size, payload_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # fatbins are 8-byte aligned, padding between them
            pos += 8
            continue
        stats.fatbins += 1
        body_start, body_end = pos + header_size, pos + header_size + payload_size
        entries = fatbin_entries(data, body_start, body_end)
        keep = keep_entries(entries, sm)
        if keep is None:
            keep = entries
            stats.unchanged += 1
        body = b"".join(e.blob for e in keep)
        for e in keep:
            stats.kept[(e.kind, e.arch)] += len(e.blob)
        stats.zeroed += payload_size - len(body)
        data[body_start:body_end] = body + bytes(payload_size - len(body))
        struct.pack_into("<Q", data, pos + 8, len(body))
        pos = body_end
    return stats


def write_extension(site: Path, out: Path, sm: int) -> str:
    """The slimmed extension as <name>.xz and its SHA256SUMS; returns the checksum."""
    data = bytearray((site / "vllm" / EXTENSION).read_bytes())
    stats = slim_fatbins(data, sm)
    kept = {f"{'ptx' if kind == KIND_PTX else 'sm'}_{arch}": n for (kind, arch), n in stats.kept.items()}
    say(
        f"{EXTENSION}: {stats.fatbins} fatbins, {stats.unchanged} left unchanged, kept bytes "
        f"{kept}, {stats.zeroed / 1e6:.1f} MB zeroed; xz -{XZ_PRESET} of {len(data) / 1e6:.1f} MB"
    )
    digest = hashlib.sha256(data).hexdigest()
    with lzma.open(out / f"{EXTENSION}.xz", "wb", preset=XZ_PRESET) as fh:
        fh.write(data)
    (out / "SHA256SUMS").write_text(f"{digest}  {EXTENSION}\n")
    return digest


# -- the wheels ------------------------------------------------------------------------------


def download_wheels(python: Path, dest: Path) -> list[str]:
    pins = pinned_versions()
    missing = [name for name in WHEELS if canonical(name) not in pins]
    if missing:
        raise SystemExit(f"vllm_bundle: not pinned in {REQUIREMENTS.name}: {', '.join(missing)}")
    specs = [f"{name}=={pins[canonical(name)]}" for name in WHEELS]
    say(f"pip download {len(specs)} cp{PYTHON_VERSION.replace('.', '')} wheels into {dest}")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [str(python), "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
        + ["--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION, *platforms]
        + ["--dest", str(dest), *specs],
        check=True,
    )
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    got = collections.Counter(canonical(w.split("-", 1)[0]) for w in wheels)
    if got != collections.Counter(canonical(name) for name in WHEELS):
        raise SystemExit(f"vllm_bundle: expected one wheel per name in WHEELS, got {wheels}")
    return wheels


# -- build -----------------------------------------------------------------------------------


def bundle_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(out: Path, sm: int) -> int:
    layout = env_layout()
    venv = Path(layout["venv"])
    site = site_packages(venv)
    say(f"from {site} ({layout['stamp']['probe']}), keeping sm_{sm}")
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the destination and swap at the end: an interrupted build leaves the
    # previous bundle as it was.
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would become the bundle's mode
    try:
        (work / "whl").mkdir()
        wheels = download_wheels(Path(layout["python"]), work / "whl")
        say(f"vllm-src.tar.xz (xz -{XZ_PRESET} of vLLM's Python tree)")
        members = write_tree(site, work / "vllm-src.tar.xz")
        digest = write_extension(site, work, sm)
        shutil.copyfile(RUN_SH, work / "run.sh")
        total = bundle_bytes(work)
        if total > SIZE_LIMIT:
            raise SystemExit(
                f"vllm_bundle: bundle is {total / 2**20:.1f} MiB, over the {SIZE_LIMIT / 2**20:.0f} MiB "
                "limit (the device tool carries 64 MiB with the repository)"
            )
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    for name in ("vllm-src.tar.xz", f"{EXTENSION}.xz"):
        print(f"{name}: {(out / name).stat().st_size} bytes")
    print(f"vllm-src.tar.xz members: {members}")
    print(f"whl/: {len(wheels)} wheels, {bundle_bytes(out / 'whl')} bytes")
    print(f"SHA256 {EXTENSION} (sm_{sm}): {digest}")
    print(f"bundle {out}: {total} bytes ({total / 2**20:.1f} MiB, limit {SIZE_LIMIT / 2**20:.0f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_parser = sub.add_parser("build", help="build the bundle from the pinned vLLM environment")
    build_parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    build_parser.add_argument(
        "--sm", type=int, default=90, help="the GPU architecture whose images are kept (90: H100/H200)"
    )
    args = parser.parse_args(argv)
    return build(args.out, args.sm)


if __name__ == "__main__":
    sys.exit(main())
