"""Build the real node: kubelet, kube-scheduler, containerd, runc, CNI plugins and local images.

Why: a real node — the kubelet with containerd, runc and the CNI plugins — is what admits a pod
requesting huge pages, mounts its hugetlbfs volume and propagates a Bidirectional hostPath mount
to the host; those are the contracts the agent's DaemonSet relies on. :mod:`hack.node_run` runs
it; this module only builds.

Everything comes from pinned sources, as the control plane does:
  * kubelet and kube-scheduler from the same k8s.io/kubernetes module, replaces and version
    stamps as the control plane (:mod:`hack.controlplane_build`);
  * containerd (+ ctr, the runc shim) and the CNI plugins (bridge, host-local, portmap,
    loopback) from their Go modules, static (CGO_ENABLED=0);
  * runc from Debian's package: a runc without seccomp support fails every non-privileged pod,
    and Debian's is built with it;
  * the sandbox (pause) image and a busybox test image, written here as OCI image layouts
    (stdlib only: a tar layer, the config, the manifest, index.json) because no registry is
    reachable; the node imports them with ``ctr -n k8s.io images import``.

Binaries go to ``${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}/node/<key>/bin``, a cache of its
own keyed by every version that goes into it, so the control plane's cache key never changes
because of the node. Standard library only (it runs before any virtual environment exists).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hack import controlplane_build as cp
from hack.controlplane_build import BuildError, GoModuleGroup, log

# containerd v2.4.2 (go.mod `go 1.26.6`) and CNI plugins v1.10.0 (`go 1.26.8`): the newest
# releases the local Go (go1.26.8) builds; containerd 2.4 is the line Kubernetes 1.37's CRI tests
# run against.
CONTAINERD_VERSION = "v2.4.2"
CNI_PLUGINS_VERSION = "v1.10.0"
#: Bump when the recipe (flags, tags, image contents) changes, so old caches are not reused.
NODE_RECIPE_REVISION = 1
#: Build tags that drop the snapshotters needing cgo or kernel features this node does not use.
CONTAINERD_TAGS = "no_btrfs,no_devmapper,no_zfs"

#: Names the images are imported under; the containerd config pins PAUSE_IMAGE as sandbox image.
PAUSE_IMAGE = "offloadpool.local/pause:3.10"
BUSYBOX_IMAGE = "offloadpool.local/busybox:1.35"
#: The same busybox under the name docs/user-guide.md's pods use (``--image=busybox:1.35``):
#: ``python3 -m hack.node up`` tags it so, so the guide's ``kubectl run`` runs as written with
#: its default pull policy (IfNotPresent for a tag other than ``latest``) and no registry.
GUIDE_BUSYBOX_IMAGE = "docker.io/library/busybox:1.35"

#: The Debian packages the node needs: runc (with seccomp) and the busybox of the test image.
APT_PACKAGES = {"runc": "/usr/sbin/runc", "busybox-static": "/bin/busybox"}
#: ... and to build the static pause and hugetouch (only when the images are missing).
BUILD_APT_PACKAGES = {"gcc": "/usr/bin/gcc", "libc6-dev": "/usr/include/stdio.h"}

#: A pause process: PID 1 of every sandbox. It holds the namespaces, reaps orphans, and exits
#: on SIGINT/SIGTERM (PID 1 has no default action for them).
PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
    struct sigaction stop = {0}, child = {0};
    stop.sa_handler = on_stop;
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP;
    if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) ||
        sigaction(SIGCHLD, &child, NULL))
        return 1;
    for (;;)
        pause();
}
"""


#: hugetouch PATH BYTES: creates PATH (on hugetlbfs), maps it shared, writes every byte (the
#: pages are faulted in, so they are allocated and charged), reads it back, prints a line. The
#: busybox test image carries it as /bin/hugetouch: hugetlbfs has no write(2), so a shell cannot
#: put data there, and the huge page tests need pages that are really in use.
HUGETOUCH_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: hugetouch PATH BYTES\n"); return 2; }
    size_t n = strtoull(argv[2], NULL, 0);
    int fd = open(argv[1], O_CREAT | O_RDWR, 0644);
    if (fd < 0 || ftruncate(fd, n)) { perror(argv[1]); return 1; }
    unsigned char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 1; }
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i % 251);
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i % 251)) { fprintf(stderr, "mismatch at %zu\n", i); return 1; }
    printf("hugetouch: %zu bytes written and verified in %s\n", n, argv[1]);
    return 0;
}
"""


def _log(msg: str) -> None:
    log(msg, who="node")


def go_groups() -> tuple[GoModuleGroup, ...]:
    """The Go modules the node's binaries come from."""
    kube = cp.KUBERNETES_VERSION
    return (
        GoModuleGroup(
            name="kubernetes-node",
            module="k8s.io/kubernetes",
            version=kube,
            local_replace_version=cp.staging_version(kube),
            binaries={
                "kubelet": "k8s.io/kubernetes/cmd/kubelet",
                "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
            },
            ldflags_x=cp.kube_version_ldflags(kube),
        ),
        GoModuleGroup(
            name="containerd",
            module="github.com/containerd/containerd/v2",
            version=CONTAINERD_VERSION,
            local_replace_version=CONTAINERD_VERSION,
            binaries={
                "containerd": "github.com/containerd/containerd/v2/cmd/containerd",
                "ctr": "github.com/containerd/containerd/v2/cmd/ctr",
                "containerd-shim-runc-v2": "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            },
            ldflags_x={
                "github.com/containerd/containerd/v2/version.Version": CONTAINERD_VERSION,
                "github.com/containerd/containerd/v2/version.Revision": "offloadpool",
            },
        ),
        GoModuleGroup(
            name="cni-plugins",
            module="github.com/containernetworking/plugins",
            version=CNI_PLUGINS_VERSION,
            local_replace_version=CNI_PLUGINS_VERSION,
            binaries={
                "bridge": "github.com/containernetworking/plugins/plugins/main/bridge",
                "host-local": "github.com/containernetworking/plugins/plugins/ipam/host-local",
                "portmap": "github.com/containernetworking/plugins/plugins/meta/portmap",
                "loopback": "github.com/containernetworking/plugins/plugins/main/loopback",
            },
            ldflags_x={
                "github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion": (
                    CNI_PLUGINS_VERSION
                )
            },
        ),
    )


GO_BINARIES: tuple[str, ...] = tuple(b for g in go_groups() for b in g.binaries)
#: The CNI plugins go to their own directory (the containerd config's bin_dir).
CNI_BINARIES = ("bridge", "host-local", "portmap", "loopback")
IMAGE_ARCHIVES = {"pause": PAUSE_IMAGE, "busybox": BUSYBOX_IMAGE}


def cache_key(go: str) -> str:
    """Every input that changes the node's bytes, readable at a glance."""
    return (
        f"k8s-{cp.KUBERNETES_VERSION}_containerd-{CONTAINERD_VERSION}_cni-{CNI_PLUGINS_VERSION}"
        f"_{go}_r{NODE_RECIPE_REVISION}"
    )


@dataclass(frozen=True)
class NodeLayout:
    """Where the node's binaries and image archives live in the cache."""

    key_dir: Path

    @property
    def bin_dir(self) -> Path:
        return self.key_dir / "bin"

    @property
    def cni_bin_dir(self) -> Path:
        return self.key_dir / "cni-bin"

    @property
    def image_dir(self) -> Path:
        return self.key_dir / "images"

    def binary(self, name: str) -> Path:
        return (self.cni_bin_dir if name in CNI_BINARIES else self.bin_dir) / name

    def image_archive(self, name: str) -> Path:
        return self.image_dir / f"{name}.oci.tar"

    def missing(self) -> list[str]:
        gone = [b for b in GO_BINARIES if not os.access(self.binary(b), os.X_OK)]
        gone += [f"image:{n}" for n in IMAGE_ARCHIVES if not self.image_archive(n).is_file()]
        gone += [p for p, path in APT_PACKAGES.items() if not os.access(path, os.X_OK)]
        return gone


def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", cp.DEFAULT_CACHE)) / "node"


def layout(go: str | None = None) -> NodeLayout:
    """The node cache for the Go that would build now; without a Go, a complete cache built
    by any Go for these pins (running needs no compiler)."""
    if go is None:
        try:
            go = cp.go_version()
        except BuildError:
            for key_dir in sorted(cache_root().glob(cache_key("GO").replace("GO", "*")), reverse=True):
                if not NodeLayout(key_dir).missing():
                    return NodeLayout(key_dir)
            raise
    return NodeLayout(cache_root() / cache_key(go))


def ensure_apt_packages(packages: dict[str, str]) -> None:
    """Debian packages (runc, busybox-static; gcc to build the images) by apt-get, once."""
    need = [p for p, path in packages.items() if not os.path.exists(path)]
    if not need:
        return
    if not shutil.which("apt-get"):
        raise BuildError(f"need the Debian packages {need} and there is no apt-get")
    _log(f"apt-get install {' '.join(need)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *need],
    ):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"`{' '.join(argv)}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


# --------------------------------------------------------------------------------------------
# OCI image layouts (no registry: the images are written here)
# --------------------------------------------------------------------------------------------


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _tar_info(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid = 0, 0, 0
    return info


def rootfs_layer(files: dict[str, bytes], symlinks: dict[str, str], dirs: tuple[str, ...]) -> bytes:
    """An uncompressed tar layer: directories, executables (0755) and symlinks, owned by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(_tar_info(d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755))
        for name, data in sorted(files.items()):
            tar.addfile(_tar_info(name, tarfile.REGTYPE, 0o755, len(data)), io.BytesIO(data))
        for name, target in sorted(symlinks.items()):
            tar.addfile(_tar_info(name, tarfile.SYMTYPE, 0o777, link=target))
    return buf.getvalue()


def oci_archive(ref: str, layer: bytes, entrypoint: list[str], cmd: list[str]) -> bytes:
    """A tar of an OCI image layout (oci-layout, index.json, blobs/sha256/...) for one
    linux/amd64 image named ``ref`` — what ``ctr images import`` reads."""
    layer_digest, _ = _blob(layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Cmd": cmd, "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "offloadpool hack/node_build.py", "created": "1970-01-01T00:00:00Z"}],
        "created": "1970-01-01T00:00:00Z",
    }
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": len(layer),
            }
        ],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1],
                },
            }
        ],
    }
    entries = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
    }
    for digest, data in (
        (layer_digest, layer),
        (config_digest, config_bytes),
        (manifest_digest, manifest_bytes),
    ):
        entries[f"blobs/sha256/{digest.split(':', 1)[1]}"] = data
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("blobs", "blobs/sha256"):
            tar.addfile(_tar_info(d, tarfile.DIRTYPE, 0o755))
        for name, data in entries.items():
            tar.addfile(_tar_info(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    return buf.getvalue()


def build_static(workdir: Path, name: str, source: str) -> bytes:
    """A static C program (gcc -static): the images carry no libc."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise BuildError(f"no C compiler (gcc) for the static {name} binary; apt-get install gcc libc6-dev")
    src, out = workdir / f"{name}.c", workdir / name
    src.write_text(source)
    proc = subprocess.run(
        [cc, "-static", "-Os", "-s", "-o", str(out), str(src)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise BuildError(f"building {name} failed:\n{proc.stderr[-4000:]}")
    return out.read_bytes()


_IMAGE_DIRS = ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "run", "root")


def busybox_layer(hugetouch: bytes) -> bytes:
    """/bin/busybox (Debian's busybox-static) with a symlink per applet, so `sh`, `mount`,
    `cat` ... resolve on PATH=/bin; and /bin/hugetouch."""
    busybox = Path(APT_PACKAGES["busybox-static"])
    listing = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True)
    applets = {f"bin/{a}": "busybox" for a in listing.stdout.split() if a and a != "busybox"}
    files = {"bin/busybox": busybox.read_bytes(), "bin/hugetouch": hugetouch}
    return rootfs_layer(files, applets, _IMAGE_DIRS)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}-", delete=False) as tmp:
        tmp.write(data)
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, path)


def build_images(lay: NodeLayout) -> None:
    with tempfile.TemporaryDirectory(prefix=".cc-", dir=lay.key_dir) as tmp:
        pause = build_static(Path(tmp), "pause", PAUSE_C)
        hugetouch = build_static(Path(tmp), "hugetouch", HUGETOUCH_C)
    _write_atomic(
        lay.image_archive("pause"),
        oci_archive(PAUSE_IMAGE, rootfs_layer({"pause": pause}, {}, ()), ["/pause"], []),
    )
    _write_atomic(
        lay.image_archive("busybox"), oci_archive(BUSYBOX_IMAGE, busybox_layer(hugetouch), [], ["sh"])
    )


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def ensure_built() -> NodeLayout:
    """Build whatever is missing; return the layout. Seconds when everything is cached."""
    lay = layout()
    if not lay.missing():
        return lay
    total = time.monotonic()
    ensure_apt_packages(APT_PACKAGES)
    if any(m.startswith("image:") for m in lay.missing()):
        ensure_apt_packages(BUILD_APT_PACKAGES)
    go = cp.go_version()
    env = cp.go_env()
    with cp.build_lock(lay.key_dir):
        missing = lay.missing()
        _log(f"building {', '.join(missing) or 'nothing'} with {go} into {lay.key_dir}")
        for group in go_groups():
            todo = [b for b in group.binaries if b in missing]
            if not todo:
                continue
            started = time.monotonic()
            genv = dict(env)
            if group.name == "containerd":
                genv["GOFLAGS"] = f"{env.get('GOFLAGS', '')} -tags={CONTAINERD_TAGS}".strip()
            src = lay.key_dir / "src" / group.name
            cp.prepare_module(group, src, genv)
            _log(f"{group.name}: module ready in {time.monotonic() - started:.0f}s")
            for binary in todo:
                _log(f"building {binary} ...")
                seconds = cp.build_binary(group, binary, src, lay.binary(binary), genv)
                _log(f"built {binary} in {seconds:.0f}s")
        if any(m.startswith("image:") for m in missing):
            started = time.monotonic()
            build_images(lay)
            _log(f"images written in {time.monotonic() - started:.1f}s")
    if lay.missing():
        raise BuildError(f"still missing after the build: {lay.missing()}")
    _log(f"node binaries ready in {time.monotonic() - total:.0f}s: {lay.key_dir}")
    return lay
