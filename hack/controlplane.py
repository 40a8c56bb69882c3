"""Run a real Kubernetes control plane: etcd, kube-apiserver and kube-controller-manager on free
loopback ports, with their own certificates and data under one work directory.

Why real: offloadpool's contracts (CRD schemas and CEL rules, status subresources, RBAC, owner
references and garbage collection, DaemonSets, admission webhooks) are enforced by the API server
and the controllers, so only the real binaries can tell that they hold. The binaries come from
:mod:`hack.controlplane_build`; the test fixture (tests/fixtures/controlplane.py) and the dev
cluster (``python3 -m hack.node up``) start the control plane through :class:`ControlPlane`.

    python3 -m hack.controlplane build [--check]   build what is missing into the cache
    python3 -m hack.controlplane paths              print the cache layout as JSON

Standard library only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hack import controlplane_build as build
from hack.controlplane_build import BuildError, log
from hack.pki import Pki, PkiError, write_kubeconfig
from hack.process import Process, free_ports


class ControlPlaneError(RuntimeError):
    """The control plane did not come up; the message carries the tails of the logs."""


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

    def __init__(self, bin_dir: Path, workdir: Path, log: Callable[[str], None] = log):
        self.bin_dir = bin_dir
        self.workdir = workdir
        self._say = log
        self._procs: list[Process] = []
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
                f"missing binaries in {self.bin_dir}: {missing}; run `python3 -m hack.controlplane build`"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            self.pki = Pki.create(self.workdir / "pki")
        except PkiError as err:
            raise ControlPlaneError(str(err)) from None
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
                # The apiserver would publish 127.0.0.1 as the `kubernetes` Service endpoint, which
                # Endpoints validation rejects; nothing in-cluster needs to reach it here.
                "--endpoint-reconciler-type=none",
                # Webhooks (and aggregated APIs) are called at their Service's endpoints, not its
                # ClusterIP: there is no kube-proxy to make a ClusterIP reachable, and pod IPs on
                # the real node's bridge are reachable from the host.
                "--enable-aggregator-routing=true",
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

    # -- use --------------------------------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl as the admin (system:masters); the caller checks ``returncode``."""
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), *args],
            input=input,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def outage(self, seconds: float, ready_timeout: float = 120.0) -> float:
        """Stop etcd and kube-apiserver for ``seconds``, then start them again as they were.

        What a control plane outage looks like to clients: connections refused, then the same
        server at the same address with the same certificates and the same data (etcd's data
        dir is kept; only a fresh start wipes it). The controller manager keeps running and
        reconnects by itself. Returns the seconds the API was unreachable, restart included.
        """
        procs = {p.name: p for p in self._procs}
        t0 = time.monotonic()
        for name in ("kube-apiserver", "etcd"):
            procs[name].stop()
        time.sleep(seconds)
        deadline = time.monotonic() + ready_timeout
        for name in ("etcd", "kube-apiserver"):
            argv = procs[name].argv
            fresh = Process(name, argv, self.workdir / f"{name}.restarted.log")
            self._procs[self._procs.index(procs[name])] = fresh
            if name == "kube-apiserver":
                ready: Callable[[], bool] = self._readyz_ok
            else:
                url = next(a for a in argv if a.startswith("--listen-client-urls=")).split("=", 1)[1]
                ready = functools.partial(self._http_ok, url + "/health")
            self._wait(fresh, deadline, ready, f"{name} after the outage")
        return time.monotonic() - t0

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

    def _spawn(self, name: str, argv: list[str]) -> Process:
        proc = Process(name, argv, self.workdir / f"{name}.log")
        self._procs.append(proc)
        return proc

    def _wait(self, proc: Process, deadline: float, ready: Callable[[], bool], what: str) -> None:
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
        lay = build.layout()
        missing = lay.missing()
        print(json.dumps({"bin_dir": str(lay.bin_dir), "missing": missing}))
        return 1 if missing else 0
    started = time.monotonic()
    bin_dir = build.ensure_built()
    log(f"build step done in {time.monotonic() - started:.1f}s")
    print(bin_dir)
    return 0


def _cmd_paths(args: argparse.Namespace) -> int:
    lay = build.layout()
    print(
        json.dumps(
            {
                "cache_root": str(build.cache_root()),
                "key": lay.key_dir.name,
                "bin_dir": str(lay.bin_dir),
                "src_dir": str(lay.src_dir),
                "binaries": {b: str(lay.binary(b)) for b in build.BINARIES},
                "missing": lay.missing(),
                "versions": {
                    "kubernetes": build.KUBERNETES_VERSION,
                    "etcd": build.ETCD_VERSION,
                    "helm": build.HELM_VERSION,
                    "go": lay.key_dir.name.split("_")[-2],
                },
            },
            indent=2,
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m hack.controlplane", description=(__doc__ or "").split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build missing binaries into the cache")
    p_build.add_argument("--check", action="store_true", help="build nothing; exit 1 if a binary is missing")
    p_build.set_defaults(func=_cmd_build)
    sub.add_parser("paths", help="print the cache layout as JSON").set_defaults(func=_cmd_paths)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except BuildError as err:
        log(f"error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
