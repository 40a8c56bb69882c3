"""Build the control plane's binaries (etcd, kube-apiserver, kube-controller-manager, kubectl,
helm) from their published Go modules at pinned versions, into a cache outside the clone.

Why from source: offloadpool is never tested against a mock of Kubernetes, and no container
registry or release download is reachable on the machines it is developed on; Go and the Go
module proxy are. The node's builder (:mod:`hack.node_build`) uses the same machinery.

Binaries go to ``${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}/controlplane/<key>/bin``, keyed by
every version that goes into them (and the Go that built them), so a second run — or a second
clone — rebuilds nothing. Each binary is linked into a temporary directory and renamed into
place, so an interrupted build never leaves a half-written binary behind, and a lock file
serialises concurrent builds of the same key.

Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------------------------
# Pinned versions
# --------------------------------------------------------------------------------------------

# Kubernetes v1.37.2 is the newest release whose go.mod (`go 1.26.0`) the Go on the development
# and CI machines (go1.26.8) satisfies; newer Kubernetes would need a newer Go. We build with the
# local toolchain only (GOTOOLCHAIN=local) so a build never fetches a compiler behind our back.
KUBERNETES_VERSION = "v1.37.2"
# etcd v3.7.3 (go.mod `go 1.26.0`): the etcd line Kubernetes 1.37 is tested against.
ETCD_VERSION = "v3.7.3"
# helm v3.22.0 (go.mod `go 1.26.0`): the newest Helm 3, built against client-go 0.37.
HELM_VERSION = "v3.22.0"
# Bump when the build recipe (flags, ldflags, CGO) changes, so old caches are not reused.
RECIPE_REVISION = 1

DEFAULT_CACHE = "/var/cache/offloadpool"


def staging_version(version: str) -> str:
    """k8s.io/kubernetes vX.Y.Z publishes its staging modules (k8s.io/api, ...) as v0.Y.Z."""
    major, minor, patch = version.lstrip("v").split(".")
    return f"v0.{minor}.{patch}"


@dataclass(frozen=True)
class GoModuleGroup:
    """One generated Go module that requires one upstream module and builds binaries from it.

    Upstream go.mod files replace their sibling modules with local paths (``=> ./staging/...``)
    that do not exist in the module zip; ``local_replace_version`` says which published version
    each such sibling must be replaced with instead.
    """

    name: str
    module: str
    version: str
    local_replace_version: str
    binaries: dict[str, str]  # binary name -> main package
    ldflags_x: dict[str, str] = field(default_factory=dict)


def kube_version_ldflags(version: str) -> dict[str, str]:
    """What Kubernetes' hack/lib/version.sh stamps in, so `kubectl version` reports v1.37.2."""
    major, minor, _ = version.lstrip("v").split(".")
    values = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = {}
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        for var, value in values.items():
            flags[f"{pkg}.{var}"] = value
    return flags


GROUPS: tuple[GoModuleGroup, ...] = (
    GoModuleGroup(
        name="kubernetes",
        module="k8s.io/kubernetes",
        version=KUBERNETES_VERSION,
        local_replace_version=staging_version(KUBERNETES_VERSION),
        binaries={
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        },
        ldflags_x=kube_version_ldflags(KUBERNETES_VERSION),
    ),
    GoModuleGroup(
        name="etcd",
        # The etcd binary's main package is the root of the server module (server/main.go).
        module="go.etcd.io/etcd/server/v3",
        version=ETCD_VERSION,
        local_replace_version=ETCD_VERSION,
        binaries={"etcd": "go.etcd.io/etcd/server/v3"},
    ),
    GoModuleGroup(
        name="helm",
        module="helm.sh/helm/v3",
        version=HELM_VERSION,
        local_replace_version=HELM_VERSION,
        binaries={"helm": "helm.sh/helm/v3/cmd/helm"},
        ldflags_x={"helm.sh/helm/v3/internal/version.version": HELM_VERSION},
    ),
)

BINARIES: tuple[str, ...] = tuple(b for g in GROUPS for b in g.binaries)


# --------------------------------------------------------------------------------------------
# Cache layout and build
# --------------------------------------------------------------------------------------------


def log(msg: str, who: str = "controlplane") -> None:
    """A timestamped progress line on stderr (stdout carries the commands' results)."""
    print(f"[{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BuildError(RuntimeError):
    """The control plane binaries could not be built (missing Go, network, compile error)."""


GO_MIN = (1, 26)  # k8s.io/kubernetes v1.37.2's go.mod says `go 1.26.0`


def _version_of(go: str) -> str | None:
    env = dict(os.environ, GOTOOLCHAIN="local")
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, env=env, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = out.stdout.strip()
    m = re.match(r"go(\d+)\.(\d+)", version)
    if out.returncode != 0 or not m or (int(m[1]), int(m[2])) < GO_MIN:
        return None
    return version


def find_go() -> tuple[str, str]:
    """(path, version) of the Go >= 1.26 on PATH (hack/test.sh puts a pinned toolchain
    there when the machine's Go is older)."""
    go = shutil.which("go")
    version = _version_of(go) if go else None
    if go and version:
        return go, version
    raise BuildError(
        f"no Go >= {GO_MIN[0]}.{GO_MIN[1]} on PATH: the control plane is built from source; "
        "run `bash hack/test.sh` (it switches an older Go to the pinned release) or install Go"
    )


def go_env() -> dict[str, str]:
    """The environment every `go` call runs with: local toolchain only, static binaries."""
    env = dict(os.environ)
    go, _ = find_go()
    env["PATH"] = f"{Path(go).parent}{os.pathsep}{env.get('PATH', '')}"
    env["GOTOOLCHAIN"] = "local"
    # Static, libc-free binaries like upstream release builds; no C compiler needed.
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def go_version() -> str:
    """`go1.26.8`, or BuildError when no suitable Go is installed."""
    return find_go()[1]


def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", DEFAULT_CACHE)) / "controlplane"


def cache_key(go: str) -> str:
    """Every input that changes the bytes of a binary, readable at a glance."""
    return f"k8s-{KUBERNETES_VERSION}_etcd-{ETCD_VERSION}_helm-{HELM_VERSION}_{go}_r{RECIPE_REVISION}"


@dataclass(frozen=True)
class Layout:
    key_dir: Path

    @property
    def bin_dir(self) -> Path:
        return self.key_dir / "bin"

    @property
    def src_dir(self) -> Path:
        return self.key_dir / "src"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def missing(self) -> list[str]:
        return [b for b in BINARIES if not os.access(self.binary(b), os.X_OK)]


def layout(go: str | None = None) -> Layout:
    """The cache layout for the Go that would build now. Without a Go, a complete cache built
    earlier by any Go for these same pins still serves (running needs no compiler)."""
    if go is None:
        try:
            go = go_version()
        except BuildError:
            pattern = cache_key("go*").replace("go*", "*")
            for key_dir in sorted(cache_root().glob(pattern), reverse=True):
                if not Layout(key_dir).missing():
                    return Layout(key_dir)
            raise
    return Layout(cache_root() / cache_key(go))


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"`{' '.join(cmd)}` failed in {cwd} (rc={proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


_REPLACE_LINE = re.compile(r"^\s*(\S+)(?:\s+\S+)?\s*=>\s*(\S+)(?:\s+\S+)?\s*$")


def local_replaces(gomod_text: str) -> list[str]:
    """Module paths an upstream go.mod replaces with a local directory (``=> ./x``, ``=> ../x``).

    These are the sibling modules (Kubernetes' staging repos, etcd's api/client/pkg) that the
    upstream repository builds from its own tree; a consumer must pin them to published versions.
    """
    found: list[str] = []
    in_block = False
    for raw in gomod_text.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        if in_block:
            if line == ")":
                in_block = False
                continue
            body = line
        elif line.startswith("replace"):
            rest = line[len("replace") :].strip()
            if rest == "(":
                in_block = True
                continue
            body = rest
        else:
            continue
        m = _REPLACE_LINE.match(body)
        if m and m.group(2).startswith(("./", "../")):
            found.append(m.group(1))
    return found


def _upstream_gomod(group: GoModuleGroup, env: dict[str, str], cwd: Path) -> str:
    out = _run(["go", "mod", "download", "-json", f"{group.module}@{group.version}"], cwd, env)
    info = json.loads(out)
    if info.get("Error"):
        raise BuildError(f"go mod download {group.module}@{group.version}: {info['Error']}")
    return Path(info["GoMod"]).read_text()


def _go_directive(gomod_text: str) -> str:
    m = re.search(r"^go\s+(\S+)\s*$", gomod_text, re.MULTILINE)
    if not m:
        raise BuildError("upstream go.mod has no `go` directive")
    return m.group(1)


def prepare_module(group: GoModuleGroup, src: Path, env: dict[str, str]) -> None:
    """Generate go.mod + tools.go requiring the pinned upstream module, then `go mod tidy`."""
    src.mkdir(parents=True, exist_ok=True)
    upstream = _upstream_gomod(group, env, src)
    replaces = local_replaces(upstream)
    lines = [
        f"module offloadpool.local/controlplane/{group.name}",
        "",
        f"go {_go_directive(upstream)}",
        "",
        f"require {group.module} {group.version}",
    ]
    if replaces:
        lines += ["", "replace ("]
        lines += [f"\t{mod} => {mod} {group.local_replace_version}" for mod in replaces]
        lines += [")"]
    (src / "go.mod").write_text("\n".join(lines) + "\n")
    imports = "\n".join(f'\t_ "{pkg}"' for pkg in group.binaries.values())
    (src / "tools.go").write_text(
        "//go:build tools\n\n// Package tools pins the main packages this module builds.\n"
        f"package tools\n\nimport (\n{imports}\n)\n"
    )
    log(f"{group.name}: {len(replaces)} local replaces pinned to {group.local_replace_version}; go mod tidy")
    _run(["go", "mod", "tidy"], src, env)


def build_binary(group: GoModuleGroup, binary: str, src: Path, target: Path, env: dict[str, str]) -> float:
    """Build one binary of ``group`` (its module prepared in ``src``) into a temporary directory
    beside ``target``, then rename it into place. Returns wall seconds."""
    ldflags = ["-s", "-w"] + [f"-X={k}={v}" for k, v in sorted(group.ldflags_x.items())]
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{binary}-", dir=target.parent) as tmp:
        _run(
            [
                "go",
                "build",
                "-trimpath",
                "-ldflags",
                " ".join(ldflags),
                "-o",
                str(Path(tmp) / binary),
                group.binaries[binary],
            ],
            src,
            env,
        )
        os.replace(Path(tmp) / binary, target)
    return time.monotonic() - started


@contextlib.contextmanager
def build_lock(key_dir: Path) -> Iterator[None]:
    """Held while building into ``key_dir``: a second build of the same key waits for the first."""
    key_dir.mkdir(parents=True, exist_ok=True)
    with open(key_dir / ".build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another build of {key_dir.name} is running; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def ensure_built() -> Path:
    """Build every missing binary; return the bin dir. Does nothing when all exist."""
    lay = layout()
    if not lay.missing():
        return lay.bin_dir
    go = go_version()
    total = time.monotonic()
    env = go_env()
    with build_lock(lay.key_dir):
        missing = lay.missing()  # another process may have built them while we waited
        log(f"building {', '.join(missing) or 'nothing'} with {go} into {lay.bin_dir}")
        for group in GROUPS:
            todo = [b for b in group.binaries if b in missing]
            if not todo:
                continue
            started = time.monotonic()
            prepare_module(group, lay.src_dir / group.name, env)
            log(f"{group.name}: module ready in {time.monotonic() - started:.0f}s")
            for binary in todo:
                log(f"building {binary} ({group.module}@{group.version}) ...")
                seconds = build_binary(group, binary, lay.src_dir / group.name, lay.binary(binary), env)
                log(f"built {binary} in {seconds:.0f}s")
    if lay.missing():
        raise BuildError(f"binaries still missing after build: {lay.missing()}")
    log(f"control plane binaries ready in {time.monotonic() - total:.0f}s: {lay.bin_dir}")
    return lay.bin_dir
