#!/usr/bin/env python3
"""Build and run a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
plus kubectl and helm) for offloadpool's tests.

Why this exists: offloadpool is never tested against a mock of Kubernetes. Every test that talks
to Kubernetes talks to real binaries, built here from their published Go modules at pinned
versions, so the suite needs nothing but Go (no C compiler) and the Go module proxy.

    python3 hack/controlplane.py build [--check]   build what is missing into the cache
    python3 hack/controlplane.py paths              print the cache layout as JSON
    python3 hack/controlplane.py up [--dir DIR]     start a control plane until Ctrl-C

Binaries go to ``${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}/controlplane/<key>/bin``, outside
the clone, keyed by every version that goes into them (and the Go that built them), so a second
run — or a second clone — rebuilds nothing. Each binary is linked into a temporary directory and
renamed into place, so an interrupted build never leaves a half-written binary behind, and a
lock file serialises concurrent builds of the same key.

Standard library only: it runs before any virtual environment exists. The test fixture
(tests/fixtures/controlplane.py) imports this file for :class:`ControlPlane`, so `up` and the
tests start the control plane the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
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


def _staging_version(version: str) -> str:
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


def _kube_version_ldflags(version: str) -> dict[str, str]:
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
        local_replace_version=_staging_version(KUBERNETES_VERSION),
        binaries={
            "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
            "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
            "kubectl": "k8s.io/kubernetes/cmd/kubectl",
        },
        ldflags_x=_kube_version_ldflags(KUBERNETES_VERSION),
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


def _log(msg: str) -> None:
    print(f"[controlplane {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
    _log(f"{group.name}: {len(replaces)} local replaces pinned to {group.local_replace_version}; go mod tidy")
    _run(["go", "mod", "tidy"], src, env)


def build_binary(group: GoModuleGroup, binary: str, lay: Layout, env: dict[str, str]) -> float:
    """Build one binary into a temp dir, then rename it into the cache. Returns wall seconds."""
    ldflags = ["-s", "-w"] + [f"-X={k}={v}" for k, v in sorted(group.ldflags_x.items())]
    src = lay.src_dir / group.name
    lay.bin_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f".{binary}-", dir=lay.key_dir) as tmp:
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
        os.replace(Path(tmp) / binary, lay.binary(binary))
    return time.monotonic() - started


@contextlib.contextmanager
def _build_lock(lay: Layout) -> Iterator[None]:
    lay.key_dir.mkdir(parents=True, exist_ok=True)
    with open(lay.key_dir / ".build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another build of {lay.key_dir.name} is running; waiting for it")
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
    with _build_lock(lay):
        missing = lay.missing()  # another process may have built them while we waited
        _log(f"building {', '.join(missing) or 'nothing'} with {go} into {lay.bin_dir}")
        for group in GROUPS:
            todo = [b for b in group.binaries if b in missing]
            if not todo:
                continue
            started = time.monotonic()
            prepare_module(group, lay.src_dir / group.name, env)
            _log(f"{group.name}: module ready in {time.monotonic() - started:.0f}s")
            for binary in todo:
                _log(f"building {binary} ({group.module}@{group.version}) ...")
                seconds = build_binary(group, binary, lay, env)
                _log(f"built {binary} in {seconds:.0f}s")
    if lay.missing():
        raise BuildError(f"binaries still missing after build: {lay.missing()}")
    _log(f"control plane binaries ready in {time.monotonic() - total:.0f}s: {lay.bin_dir}")
    return lay.bin_dir


# --------------------------------------------------------------------------------------------
# Running: PKI, etcd, kube-apiserver, kube-controller-manager on free loopback ports
# --------------------------------------------------------------------------------------------


class ControlPlaneError(RuntimeError):
    """The control plane did not come up; the message carries the tails of the logs."""


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ControlPlaneError("`openssl` is required to generate the control plane's certificates")
    proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Pki:
    """Certificates for one control plane: a CA, the apiserver serving cert, client certs and
    the service-account signing key pair. EC P-256 keys are quick to generate on a small VM."""

    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    @classmethod
    def create(cls, directory: Path) -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        pki = cls(directory)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(
            "req",
            "-x509",
            *ec,
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "3650",
            "-subj",
            "/CN=offloadpool-test-ca",
            cwd=directory,
        )
        pki._issue(
            "apiserver",
            "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        # system:masters: the tests' admin; the controller manager gets its own RBAC identity.
        pki._issue("admin", "/O=system:masters/CN=offloadpool-admin", "extendedKeyUsage=clientAuth\n")
        pki._issue(
            "controller-manager", "/CN=system:kube-controller-manager", "extendedKeyUsage=clientAuth\n"
        )
        _openssl(
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            "sa.key",
            cwd=directory,
        )
        _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
        return pki

    def _issue(self, name: str, subject: str, extensions: str) -> None:
        ext = self.dir / f"{name}.ext"
        ext.write_text(extensions)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        _openssl(
            "req",
            "-new",
            *ec,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            subject,
            cwd=self.dir,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-set_serial",
            str(int.from_bytes(os.urandom(8), "big")),
            "-days",
            "365",
            "-extfile",
            ext.name,
            "-out",
            f"{name}.crt",
            cwd=self.dir,
        )


def write_kubeconfig(
    path: Path, server: str, ca: Path, user: dict[str, str], name: str = "offloadpool-test"
) -> Path:
    """A kubeconfig that names its certificate files (``certificate-authority``,
    ``client-certificate``/``client-key``) instead of embedding them.

    Why not embed (``*-data``): the Python kubernetes client writes embedded certificates and
    keys to ``/tmp/tmpXXXX`` files and removes them only at interpreter exit, so every process a
    test kills with SIGKILL would leave them behind. The files live in the control plane's work
    dir for as long as it runs. JSON is valid kubeconfig YAML."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


class _Process:
    """One control plane process in its own process group, logging to a file.

    `setpriv --pdeathsig KILL` makes the kernel kill it if our process dies without cleaning
    up (SIGKILL of pytest), so a crashed test run leaves nothing listening.
    """

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name = name
        self.log_path = log_path
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            prefix + argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (children, a process that ignored SIGTERM).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()


# `--controllers=*` minus two controllers that serve kubelets. Kubernetes 1.37's controller
# manager has no cloud controllers left to disable (they live in cloud-controller-manager).
# There are no kubelets for most test Nodes, so the node lifecycle controller would taint every
# one `unreachable` about a minute after creation and make DaemonSet placement depend on test
# timing. The TTL controller annotates every Node with how long its kubelet may cache Secrets
# (`node.alpha.kubernetes.io/ttl`), again on every Node each time the count crosses a size
# step (100, 500, 1,000): on a cluster it does so as nodes join; here the scale test's Nodes
# are made just before their pool, and its ~1,600 patches of 1,000 Nodes (at the controller
# manager's 20 requests/s) ran through the pool's convergence, each a Node event the operator
# decodes. The test nodes with a real kubelet (tests/fixtures/node.py) do not need it: a
# kubelet without the annotation uses its default cache TTL.
DISABLED_CONTROLLERS = ("node-lifecycle-controller", "ttl-controller")
# The controller manager's client rate limits, as Kubernetes' own 5,000-node scale jobs set
# them (CONTROLLER_MANAGER_TEST_ARGS in kubernetes/test-infra): with the default 20 requests/s
# the DaemonSet controller takes 50 s to make the agent pods of a 1,000-node pool, and the
# scale test starts each agent when its pod is made, as a kubelet would.
CONTROLLER_MANAGER_QPS, CONTROLLER_MANAGER_BURST = 100, 100


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager on free loopback ports under `workdir`.

    `start()` returns once /readyz answers ok and the controller manager has started its
    controllers; `stop()` is idempotent and kills every process group it started.
    """

    def __init__(self, bin_dir: Path, workdir: Path, log: Callable[[str], None] = _log):
        self.bin_dir = bin_dir
        self.workdir = workdir
        self._say = log
        self._procs: list[_Process] = []
        self.server = ""
        self.kubeconfig = workdir / "admin.kubeconfig"
        self.pki = Pki(workdir / "pki")

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 180.0, attempts: int = 3) -> ControlPlane:
        missing = [
            b
            for b in ("etcd", "kube-apiserver", "kube-controller-manager")
            if not os.access(self.bin_dir / b, os.X_OK)
        ]
        if missing:
            raise ControlPlaneError(
                f"missing binaries in {self.bin_dir}: {missing}; run `python3 hack/controlplane.py build`"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        self.pki = Pki.create(self.workdir / "pki")
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                self._say(f"control plane ready at {self.server} in {time.monotonic() - started:.1f}s")
                return self
            except ControlPlaneError as err:
                self.stop()
                # Free ports are picked, released and then bound by the child: another process
                # can take one in between. Only that race is worth another attempt.
                if "address already in use" in str(err) and attempt < attempts:
                    self._say(f"port race on attempt {attempt}; retrying")
                    continue
                raise
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        etcd_client, etcd_peer, api_port, kcm_port = free_ports(4)
        data = self.workdir / "etcd-data"
        shutil.rmtree(data, ignore_errors=True)
        etcd_url = f"http://127.0.0.1:{etcd_client}"
        peer_url = f"http://127.0.0.1:{etcd_peer}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=offloadpool-test",
                f"--data-dir={data}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=offloadpool-test={peer_url}",
                "--initial-cluster-state=new",
                # Test data is thrown away: skip fsync, it only slows a shared VM down.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait(etcd, deadline, lambda: self._http_ok(f"{etcd_url}/health"), "etcd /health")

        self.server = f"https://127.0.0.1:{api_port}"
        pki = self.pki
        apiserver = self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.crt('apiserver')}",
                f"--tls-private-key-file={pki.key('apiserver')}",
                f"--client-ca-file={pki.ca_crt}",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--enable-aggregator-routing=true",
                # The apiserver would publish 127.0.0.1 as the `kubernetes` Service endpoint, which
                # Endpoints validation rejects; nothing in-cluster needs to reach it here.
                "--endpoint-reconciler-type=none",
                # Nodes here are Node objects created by tests (there are no kubelets). This
                # admission plugin would taint each one `not-ready:NoSchedule` on creation, and
                # only a kubelet reporting Ready ever removes that taint, so DaemonSets would never
                # place a pod. Without it, a test Node is a plain schedulable node; tests that want
                # taints add them explicitly.
                "--disable-admission-plugins=TaintNodesByCondition",
                "--profiling=false",
            ],
        )
        self.kubeconfig = write_kubeconfig(
            self.workdir / "admin.kubeconfig",
            self.server,
            pki.ca_crt,
            {"client-certificate": str(pki.crt("admin")), "client-key": str(pki.key("admin"))},
            name="offloadpool-admin",
        )
        self._wait(apiserver, deadline, self._readyz_ok, "kube-apiserver /readyz")

        kcm_kubeconfig = write_kubeconfig(
            self.workdir / "controller-manager.kubeconfig",
            self.server,
            pki.ca_crt,
            {
                "client-certificate": str(pki.crt("controller-manager")),
                "client-key": str(pki.key("controller-manager")),
            },
        )
        controllers = ",".join(["*"] + [f"-{c}" for c in DISABLED_CONTROLLERS])
        kcm = self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_kubeconfig}",
                f"--authentication-kubeconfig={kcm_kubeconfig}",
                f"--authorization-kubeconfig={kcm_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                f"--controllers={controllers}",
                f"--kube-api-qps={CONTROLLER_MANAGER_QPS}",
                f"--kube-api-burst={CONTROLLER_MANAGER_BURST}",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_crt}",
                f"--cluster-signing-cert-file={pki.ca_crt}",
                f"--cluster-signing-key-file={pki.ca_key}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        self._wait(
            kcm,
            deadline,
            lambda: self._http_ok(f"https://127.0.0.1:{kcm_port}/healthz", verify=False),
            "kube-controller-manager /healthz",
        )
        # The service-account controller creates `default` in every namespace: once it exists
        # the controllers are running, not just the health endpoint.
        self._wait(
            kcm,
            deadline,
            lambda: self._api_get("/api/v1/namespaces/default/serviceaccounts/default"),
            "the controller manager to create ServiceAccount default/default",
        )

    def stop(self) -> None:
        while self._procs:
            proc = self._procs.pop()
            proc.stop()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers ------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Process (and process group) ids of the running components."""
        return [p.proc.pid for p in self._procs]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU (user + system) each running component has used so far, by name: what a
        benchmark on this machine's few cores shares with the code it measures."""
        tick = os.sysconf("SC_CLK_TCK")
        used: dict[str, float] = {}
        for p in self._procs:
            try:
                with open(f"/proc/{p.proc.pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:  # stopped meanwhile
                continue
            used[p.name] = (int(fields[11]) + int(fields[12])) / tick
        return used

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.log_tail()}" for p in self._procs)

    def _spawn(self, name: str, argv: list[str]) -> _Process:
        proc = _Process(name, argv, self.workdir / f"{name}.log")
        self._procs.append(proc)
        return proc

    def _wait(self, proc: _Process, deadline: float, ready: Callable[[], bool], what: str) -> None:
        while True:
            if not proc.alive():
                raise ControlPlaneError(
                    f"{proc.name} exited (rc={proc.proc.returncode}) while "
                    f"waiting for {what}:\n{proc.log_tail()}"
                )
            if ready():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_crt))
        ctx.load_cert_chain(str(self.pki.crt("admin")), str(self.pki.key("admin")))
        return ctx

    @staticmethod
    def _http_ok(url: str, verify: bool = True) -> bool:
        ctx = None
        if url.startswith("https") and not verify:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _api_get(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.server + path, timeout=2, context=self._ssl_context()) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _readyz_ok(self) -> bool:
        return self._api_get("/readyz")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _cmd_build(args: argparse.Namespace) -> int:
    if args.check:
        lay = layout()
        missing = lay.missing()
        print(json.dumps({"bin_dir": str(lay.bin_dir), "missing": missing}))
        return 1 if missing else 0
    started = time.monotonic()
    bin_dir = ensure_built()
    _log(f"build step done in {time.monotonic() - started:.1f}s")
    print(bin_dir)
    return 0


def _cmd_paths(args: argparse.Namespace) -> int:
    lay = layout()
    print(
        json.dumps(
            {
                "cache_root": str(cache_root()),
                "key": lay.key_dir.name,
                "bin_dir": str(lay.bin_dir),
                "src_dir": str(lay.src_dir),
                "binaries": {b: str(lay.binary(b)) for b in BINARIES},
                "missing": lay.missing(),
                "versions": {
                    "kubernetes": KUBERNETES_VERSION,
                    "etcd": ETCD_VERSION,
                    "helm": HELM_VERSION,
                    "go": lay.key_dir.name.split("_")[-2],
                },
            },
            indent=2,
        )
    )
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    bin_dir = ensure_built()
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="offloadpool-cp-"))
    stop = {"now": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    # Handle SIGINT explicitly too: a shell that starts us in the background ignores SIGINT,
    # and then Python would not turn Ctrl-C/`kill -INT` into KeyboardInterrupt.
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    cp = ControlPlane(bin_dir, workdir)
    try:
        cp.start()
        print(f"export KUBECONFIG={cp.kubeconfig}")
        print(f"export PATH={bin_dir}:$PATH")
        print("control plane running; Ctrl-C stops it", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cp.stop()
        if not args.dir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        _log("control plane stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build missing binaries into the cache")
    p_build.add_argument("--check", action="store_true", help="build nothing; exit 1 if a binary is missing")
    p_build.set_defaults(func=_cmd_build)
    p_paths = sub.add_parser("paths", help="print the cache layout as JSON")
    p_paths.set_defaults(func=_cmd_paths)
    p_up = sub.add_parser("up", help="start a control plane until Ctrl-C")
    p_up.add_argument("--dir", help="working directory (kept); default: a temp dir")
    p_up.add_argument("--keep", action="store_true", help="keep the temp working directory")
    p_up.set_defaults(func=_cmd_up)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (BuildError, ControlPlaneError) as err:
        _log(f"error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
