#!/usr/bin/env python3
"""Build the chart's container image without a container engine, as an OCI image layout.

Why: the development and CI machines have no Docker daemon and reach no container registry, yet
the image the chart names must exist to be tested (docs/real-node.md). So the image is made from
Debian packages and the project's own source, with nothing but debootstrap, chroot, overlayfs
and the standard library:

1. base layer: ``debootstrap --variant=minbase`` of Debian bookworm with ``python3`` and
   ``python3-venv`` (the Dockerfile's ``FROM debian:bookworm-slim`` + the same two packages);
   cached under ``$OFFLOADPOOL_CACHE/image/base-<key>`` keyed by the recipe (suite, mirror,
   packages), so it is made once per machine (about 2 minutes);
2. application layer: the source is copied into an overlay over the base and
   ``python3 /src/hack/image.py install /src`` runs there in a chroot — the very command the
   Dockerfile runs — which makes a venv at ``/opt/offloadpool`` and pip-installs
   ``offloadpool[operator]`` (the wheel built from the source, and its dependencies); the
   overlay's upper directory is exactly that layer;
3. the OCI layout (``oci-layout``, ``index.json``, ``blobs/sha256/…``) is written with
   tarfile/gzip/hashlib/json to ``$OFFLOADPOOL_CACHE/image/<key>``, keyed by the base key and
   the content of every file that goes into the wheel, so an unchanged tree rebuilds nothing.

    python3 hack/image.py build       make (or reuse) the image; print its layout directory
    python3 hack/image.py archive     the same, as one tar for ``ctr images import``; its path
    python3 hack/image.py key         print the key the current source gives
    python3 hack/image.py install SRC install SRC[operator] into /opt/offloadpool (in the image)

Import it with ``containerd``: ``ctr -n k8s.io images import`` of the archive (the index names
it ``ghcr.io/offloadpool/offloadpool:<version>``, the chart's default image).
Standard library only; build needs root (debootstrap, mounts, chroot).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = "/var/cache/offloadpool"

# The base: the Dockerfile's `FROM debian:bookworm-slim` plus the packages it installs.
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv")
# Bump when the recipe (steps, layout, what is removed from the base) changes.
RECIPE_REVISION = 1

PREFIX = "/opt/offloadpool"  # the venv inside the image; its bin/ is first on PATH
EXTRAS = "operator"  # the operator's extras include the agent's: one image runs both
REPOSITORY = "ghcr.io/offloadpool/offloadpool"
CMD = ["offloadpool-operator", "--standalone"]
ENV = [
    f"PATH={PREFIX}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
]
# What the wheel is built from: these paths of the source tree (plus this script, which runs
# the install) make the application layer's key.
SOURCE_PATHS = ("agent", "operator", "pyproject.toml", "README.md", "hack/image.py")

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
KEEP_IMAGES = 3
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# pip's settings passed into the chroot (the index, its certificate, timeouts, a proxy).
PASS_ENV = (
    "PIP_INDEX_URL",
    "PIP_EXTRA_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_CERT",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "NO_PROXY",
    "https_proxy",
    "http_proxy",
    "no_proxy",
)
GZIP_LEVEL = 3  # a build-time trade: level 9 doubles the time for ~5% smaller blobs


def _log(msg: str) -> None:
    print(f"[image] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", DEFAULT_CACHE)) / "image"


def version() -> str:
    text = (ROOT / "agent" / "offloadpool" / "__init__.py").read_text()
    m = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    if not m:
        raise SystemExit("no __version__ in agent/offloadpool/__init__.py")
    return m[1]


def image_name() -> str:
    return f"{REPOSITORY}:{version()}"


def base_key() -> str:
    recipe = {
        "suite": SUITE,
        "mirror": MIRROR,
        "packages": PACKAGES,
        "revision": RECIPE_REVISION,
        "variant": "minbase",
        "arch": "amd64",
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def source_files() -> list[str]:
    """The files the application layer is made from: git's view (tracked, and untracked but
    not ignored) when this is a clone, else every file under SOURCE_PATHS."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "--", *SOURCE_PATHS],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        files = [f for f in out.splitlines() if (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = [
            str(p.relative_to(ROOT))
            for s in SOURCE_PATHS
            for p in ([ROOT / s] if (ROOT / s).is_file() else sorted((ROOT / s).rglob("*")))
            if p.is_file()
        ]
    return sorted(f for f in files if "__pycache__" not in f and not f.endswith(".pyc"))


def deps_key() -> str:
    """The dependency layer's key: the base, the dependency declaration, the install recipe."""
    h = hashlib.sha256(base_key().encode())
    for f in ("pyproject.toml", "hack/image.py"):
        h.update(hashlib.sha256((ROOT / f).read_bytes()).digest())
    return h.hexdigest()[:16]


def image_key() -> str:
    h = hashlib.sha256(deps_key().encode())
    for f in source_files():
        h.update(f.encode() + b"\0" + hashlib.sha256((ROOT / f).read_bytes()).digest())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


# ---- layers ---------------------------------------------------------------------------------


class _Hashing:
    """A write-only file that hashes and counts what passes through to ``sink``."""

    def __init__(self, sink: IO[bytes] | None) -> None:
        self.sink, self.sha, self.size = sink, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.sink is not None:
            self.sink.write(data)
        return len(data)

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()


def _overlay_whiteout(path: Path, st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def write_layer(tree: Path, out: Path) -> dict[str, object]:
    """tar+gzip ``tree`` (its contents at the layer's root) into ``out``; return its digests.

    Overlayfs whiteouts (0/0 character devices) become OCI ``.wh.`` files; sockets are left out.
    Entries are sorted and mtimes kept, ownership is numeric (the image's own /etc/passwd
    decides names)."""
    with open(out, "wb") as raw:
        blob = _Hashing(raw)
        with gzip.GzipFile(fileobj=blob, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as gz:
            diff = _Hashing(gz)  # type: ignore[arg-type]
            with tarfile.open(fileobj=diff, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for dirpath, dirnames, filenames in os.walk(tree):
                    dirnames.sort()
                    base = Path(dirpath)
                    for name in sorted(dirnames) + sorted(filenames):
                        path = base / name
                        arc = str(path.relative_to(tree))
                        st = path.lstat()
                        if _overlay_whiteout(path, st):
                            info = tarfile.TarInfo(str(Path(arc).parent / f".wh.{name}"))
                            info.mtime = int(st.st_mtime)
                            tar.addfile(info)
                            continue
                        if stat.S_ISSOCK(st.st_mode):
                            continue
                        info = tar.gettarinfo(str(path), arcname=arc)
                        info.uname = info.gname = ""
                        if info.isreg():
                            with open(path, "rb") as fh:
                                tar.addfile(info, fh)
                        else:
                            tar.addfile(info)
    return {
        "digest": f"sha256:{blob.sha.hexdigest()}",
        "size": blob.size,
        "diff_id": f"sha256:{diff.sha.hexdigest()}",
    }


# ---- base -----------------------------------------------------------------------------------


def ensure_base() -> tuple[Path, dict[str, object]]:
    """The cached base root file system and its layer (made once per recipe)."""
    d = cache_root() / f"base-{base_key()}"
    done = d / "layer.json"
    with _lock(cache_root() / f".base-{base_key()}.lock"):
        if done.exists():
            return d / "rootfs", json.loads(done.read_text())
        if not shutil.which("debootstrap"):
            _log("installing debootstrap")
            subprocess.run(["apt-get", "update", "-qq"], check=True)
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "debootstrap"],
                check=True,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        t0 = time.monotonic()
        _log(f"debootstrap {SUITE} ({', '.join(PACKAGES)}) from {MIRROR}")
        proc = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(d / "rootfs"),
                MIRROR,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        rootfs = d / "rootfs"
        # What a slim image leaves out: downloaded .debs and package lists; the runtime brings
        # its own resolv.conf.
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / sub).glob("*"):
                if p.is_file():
                    p.unlink()
        (rootfs / "etc/resolv.conf").write_text("")
        _log(f"base root file system in {time.monotonic() - t0:.0f} s; writing its layer")
        layer = write_layer(rootfs, d / "layer.tar.gz")
        done.write_text(json.dumps(layer))
        return rootfs, layer


# ---- application layer ------------------------------------------------------------------------


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def build_layer(lowers: list[Path], work: Path, stage: str) -> dict[str, object]:
    """Run ``install /src --stage STAGE`` in a chroot on an overlay over ``lowers`` (topmost
    first); the overlay's upper dir (``work/upper``) is the layer, written to ``work/layer.tar.gz``."""
    upper, wd, merged = work / "upper", work / "work", work / "merged"
    for p in (upper, wd, merged):
        p.mkdir()
    mounted: list[Path] = []
    try:
        _mount(
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={wd}",
            str(merged),
        )
        mounted.append(merged)
        src = merged / "src"
        src.mkdir()
        for f in source_files():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
        # The build machine's network settings, for pip only (bind mounts: nothing of them
        # lands in the layer): its resolver, and its CA bundle over the image's (a TLS-
        # intercepting egress proxy signs with its own CA).
        binds = [
            ("proc", merged / "proc", ["-t", "proc"]),
            ("/dev", merged / "dev", ["--rbind"]),
            ("/etc/resolv.conf", merged / "etc/resolv.conf", ["--bind"]),
        ]
        if Path(HOST_CA_BUNDLE).is_file() and (merged / HOST_CA_BUNDLE.lstrip("/")).is_file():
            binds.append((HOST_CA_BUNDLE, merged / HOST_CA_BUNDLE.lstrip("/"), ["--bind"]))
        for what, target, opts in binds:
            _mount(*opts, what, str(target))
            mounted.append(target)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
        env.update({k: v for k, v in os.environ.items() if k in PASS_ENV})
        proc = subprocess.run(
            [
                "chroot",
                str(merged),
                "/usr/bin/python3",
                "/src/hack/image.py",
                "install",
                "/src",
                "--stage",
                stage,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            raise SystemExit(
                f"install in the image failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                f"{proc.stderr[-4000:]}"
            )
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-R", str(target)], check=False)
    if any(os.path.ismount(t) for t in mounted):
        raise SystemExit(f"could not unmount the build's mounts under {merged}")
    # made in the upper dir only, so removing them there needs no whiteout
    shutil.rmtree(upper / "src", ignore_errors=True)
    for junk in ("root/.cache", "tmp"):
        p = upper / junk
        if p.is_dir():
            for child in p.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    shutil.rmtree(wd, ignore_errors=True)
    return write_layer(upper, work / "layer.tar.gz")


STAGES = ("all", "deps", "app")
#: The chart runs the operator (and the lease sidecar) as this uid/gid (runAsUser in
#: charts/offloadpool and deploy/). It must have a passwd entry: kopf asks getpass.getuser(),
#: which ends in pwd.getpwuid() and raises KeyError for an unknown uid (the operator pod then
#: crash-loops with "getpwuid(): uid not found: 65532").
RUN_AS = 65532
RUN_AS_NAME = "offloadpool"


def add_run_as_user(etc: Path = Path("/etc")) -> None:
    """Give the chart's uid a name in the image (passwd and group), once."""
    passwd, group = etc / "passwd", etc / "group"
    if not any(line.split(":")[2:3] == [str(RUN_AS)] for line in passwd.read_text().splitlines()):
        with passwd.open("a") as fh:
            fh.write(f"{RUN_AS_NAME}:x:{RUN_AS}:{RUN_AS}:offloadpool:/nonexistent:/usr/sbin/nologin\n")
    if not any(line.split(":")[2:3] == [str(RUN_AS)] for line in group.read_text().splitlines()):
        with group.open("a") as fh:
            fh.write(f"{RUN_AS_NAME}:x:{RUN_AS}:\n")


def install(src: Path, prefix: str = PREFIX, stage: str = "all") -> None:
    """Inside the image (the Dockerfile's RUN, or the chroot above): a venv at ``prefix`` with
    ``src[operator]`` (the wheel built from src, and its dependencies) installed.

    ``all`` (the Dockerfile) does it in one go. The engine-less build splits it in two layers
    so a source change rebuilds only the small one: ``deps`` makes the venv and installs
    everything but leaves offloadpool itself out again (its layer is keyed by pyproject.toml),
    ``app`` adds the wheel without touching the dependencies. The end result is the same."""
    pip = [f"{prefix}/bin/pip", "--disable-pip-version-check", "-q"]
    if stage in ("all", "deps"):
        add_run_as_user()
        subprocess.run([sys.executable, "-m", "venv", prefix], check=True)
        subprocess.run([*pip, "install", "--no-cache-dir", f"{src}[{EXTRAS}]"], check=True)
    if stage == "deps":
        subprocess.run([*pip, "uninstall", "-y", "offloadpool"], check=True)
    if stage == "app":
        subprocess.run([*pip, "install", "--no-cache-dir", "--no-deps", str(src)], check=True)
    # pip's own build leftovers; nothing of src stays in the image
    for leftover in src.glob("build"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---- the OCI layout ---------------------------------------------------------------------------


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _place_layer(layout: Path, file: Path, layer: dict[str, object]) -> None:
    target = layout / "blobs" / "sha256" / str(layer["digest"]).split(":", 1)[1]
    try:
        os.link(file, target)  # the base layer's blob is shared with its cache entry
    except OSError:
        shutil.copyfile(file, target)


def write_layout(layout: Path, layers: list[tuple[Path, dict[str, object]]]) -> dict[str, str]:
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    for file, layer in layers:
        _place_layer(layout, file, layer)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ENV, "Cmd": CMD, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for _, layer in layers]},
        "history": [
            {
                "created": created,
                "created_by": f"debootstrap --variant=minbase {SUITE} +{','.join(PACKAGES)}",
            },
            {
                "created": created,
                "created_by": f"python3 hack/image.py install /src --stage deps  # {PREFIX}",
            },
            {"created": created, "created_by": f"python3 hack/image.py install /src --stage app  # {PREFIX}"},
        ],
    }
    config_digest, config_size = _blob(layout, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": config_size},
        "layers": [
            {"mediaType": MEDIA_LAYER, "digest": layer["digest"], "size": layer["size"]}
            for _, layer in layers
        ],
    }
    manifest_digest, manifest_size = _blob(layout, json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "org.opencontainers.image.ref.name": version(),
                    "io.containerd.image.name": image_name(),
                },
            }
        ],
    }
    (layout / "index.json").write_text(json.dumps(index, indent=2))
    return {"name": image_name(), "manifest": manifest_digest, "config": config_digest}


def ensure_deps(base_rootfs: Path) -> tuple[Path, dict[str, object]]:
    """The cached dependency layer (its tree, an overlay lower for the application layer)."""
    key = deps_key()
    d = cache_root() / f"deps-{key}"
    with _lock(cache_root() / f".deps-{key}.lock"):
        if not (d / "layer.json").exists():
            with tempfile.TemporaryDirectory(prefix="offloadpool-image-", dir=cache_root()) as tmp:
                work = Path(tmp)
                layer = build_layer([base_rootfs], work, "deps")
                (work / "layer.json").write_text(json.dumps(layer))
                shutil.rmtree(work / "merged", ignore_errors=True)
                shutil.rmtree(d, ignore_errors=True)
                work.rename(d)
                work.mkdir()  # for TemporaryDirectory's cleanup
            for old in cache_root().glob("deps-*"):  # one per pyproject.toml: keep the newest
                if old != d:
                    shutil.rmtree(old, ignore_errors=True)
        return d / "upper", json.loads((d / "layer.json").read_text())


def ensure_image() -> Path:
    """The OCI layout for the current source, built unless the cache has it; its directory."""
    key = image_key()
    layout = cache_root() / key
    with _lock(cache_root() / f".{key}.lock"):
        if (layout / "index.json").exists():
            _log(f"cached: {layout}")
            return layout
        t0 = time.monotonic()
        base_rootfs, base_layer = ensure_base()
        t1 = time.monotonic()
        deps_tree, deps_layer = ensure_deps(base_rootfs)
        t2 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="offloadpool-image-", dir=cache_root()) as tmp:
            work = Path(tmp)
            app_layer = build_layer([deps_tree, base_rootfs], work, "app")
            staging = work / "layout"
            info = write_layout(
                staging,
                [
                    (base_rootfs.parent / "layer.tar.gz", base_layer),
                    (deps_tree.parent / "layer.tar.gz", deps_layer),
                    (work / "layer.tar.gz", app_layer),
                ],
            )
            info["seconds"] = (
                f"base {t1 - t0:.0f} s, dependencies {t2 - t1:.0f} s, "
                f"application layer and layout {time.monotonic() - t2:.0f} s"
            )
            (staging / "image.json").write_text(json.dumps(info, indent=2))
            staging.rename(layout)
        _log(f"built {image_name()} in {time.monotonic() - t0:.0f} s: {layout}")
        prune(keep=KEEP_IMAGES)
        return layout


def prune(keep: int) -> None:
    """Keep the newest ``keep`` image layouts (each source change makes one); bases stay."""
    layouts = sorted(
        (d for d in cache_root().iterdir() if (d / "index.json").exists()),
        key=lambda d: (d / "index.json").stat().st_mtime,
        reverse=True,
    )
    for old in layouts[keep:]:
        shutil.rmtree(old, ignore_errors=True)


ARCHIVE_NAME = "image.oci.tar"


def ensure_archive() -> Path:
    """The image as one tar of its OCI layout, what ``ctr images import`` reads; kept in the
    layout's directory (so it goes when the layout is pruned)."""
    layout = ensure_image()
    archive = layout / ARCHIVE_NAME
    with _lock(cache_root() / f".{layout.name}.lock"):
        if not archive.exists():
            partial = layout / f".{ARCHIVE_NAME}.partial"
            with tarfile.open(partial, "w") as tar:
                for name in ("oci-layout", "index.json", "blobs"):
                    tar.add(layout / name, arcname=name)
            partial.rename(archive)
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="make (or reuse) the image; print its OCI layout directory")
    sub.add_parser("archive", help="the image as a tar of its layout (for ctr images import); print its path")
    sub.add_parser("key", help="print the cache key of the current source")
    inst = sub.add_parser("install", help="(inside the image) install SRC[operator] into the venv")
    inst.add_argument("src", type=Path)
    inst.add_argument("--prefix", default=PREFIX)
    inst.add_argument("--stage", choices=STAGES, default="all", help="all (the Dockerfile), or deps then app")
    args = parser.parse_args(argv)
    if args.command == "key":
        print(image_key())
    elif args.command == "install":
        install(args.src, args.prefix, args.stage)
    else:
        if os.geteuid() != 0:
            raise SystemExit("hack/image.py build needs root (debootstrap, overlay mounts, chroot)")
        print(ensure_archive() if args.command == "archive" else ensure_image())
    return 0


if __name__ == "__main__":
    sys.exit(main())
