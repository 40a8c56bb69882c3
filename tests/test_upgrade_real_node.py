"""An upgrade from a release with engines running, and the rollback, on the real node.

Why real: what an upgrade must not do — restart an engine's container, lose a byte it wrote,
re-provision or re-fault its pool, unpublish its CSI volume, flip its pool's status — is decided
by the kubelet, the runtime, the DaemonSet and Deployment controllers and the two versions' own
code meeting in one cluster; only the real ones can say it holds. docs/user-guide.md §9.

One module-scoped release, tests in order: the release upgraded from (``upgrade_source``: the
first release of the working tree's minor line, the widest upgrade the line promises; the last
release when the line has none yet), built from its recorded commit by ``hack/release.py build``
(its own chart, its own image, its own CRDs), is installed with the CSI plugin; a HostPath pool
and a CSI pool become Ready; a consumer pod per pool attaches, writes a pattern over the whole
region and keeps it mapped. Then ``helm upgrade`` to the working tree's chart and image, the
guide's step 2 (agent pods deleted by hand: the DaemonSets are ``OnDelete``), the CRD fields
the working tree adds served and a shape change under an engine held back (``LeaseHeld``), and
the same checks after ``helm rollback``. In between, each direction's skew (an operator of one
version over agents of the other, as every rollout has) is held and shown to aggregate and
delete nothing. A watch of the pools and their OffloadPoolNodes runs throughout.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.chart_node import (
    CHART,
    REPO,
    ReleaseOnNode,
    host_mounts,
    import_offloadpool_image,
    node_values,
    remove_release,
)
from fixtures.crds import CRD_DIR
from fixtures.node import TOLERATION, RealNode
from offloadpool import __version__
from offloadpool.api.base import now, parse_time
from offloadpool.api.constants import (
    AGENT_HTTP_PORT,
    API_VERSION,
    NODE_PLURAL,
    POOL_NAME_LABEL,
    POOL_PLURAL,
    extended_resource_name,
    pool_label_key,
)
from offloadpool.csi.config import DRIVER_NAME
from offloadpool.region.files import manifest as manifests
from offloadpool.region.files import record as records
from offloadpool.region.holding import published

pytestmark = pytest.mark.node

RELEASE = "up"
POOL_BYTES = 16 << 20
AGENTS = "app.kubernetes.io/name=offloadpool-agent"
OPERATOR = "app.kubernetes.io/name=offloadpool-operator"
PLUGIN = "app.kubernetes.io/name=offloadpool-csi"
#: the engine: attach, write the pattern over every byte of the region, keep it mapped
ENGINE = """
import sys, time
from offloadpool.pinning import attach
pool_dir, shift = sys.argv[1], int(sys.argv[2])
with attach(pool_dir, rank=0) as region:
    block = bytes((j + shift) % 251 for j in range(251))
    view = region.memoryview()
    view[:] = (block * (region.size // 251 + 1))[: region.size]
    view.release()
    print(f"WROTE {region.size}", flush=True)
    time.sleep(3600)
"""
#: what the CSI pool's consumer runs as (the pool's files are given to uid/gid 1000)
AS_1000 = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


GUIDE = REPO / "docs" / "user-guide.md"
MARKED = re.compile(
    r"<!-- upgrade-test: (?P<name>[\w-]+) -->\n\s*```console\n(?P<body>.*?)\n\s*```", re.DOTALL
)


def guide_commands(name: str, substitutions: dict[str, str]) -> list[list[str]]:
    """The ``$`` lines of the guide's §9 block marked ``upgrade-test: NAME``, each
    substitution applied (each must find its text: a guide that changed under the test fails
    here rather than running unsubstituted), split into words."""
    blocks = {m["name"]: m["body"] for m in MARKED.finditer(GUIDE.read_text())}
    assert name in blocks, f"docs/user-guide.md has no block marked upgrade-test: {name}"
    lines = [line.strip()[2:] for line in blocks[name].splitlines() if line.strip().startswith("$ ")]
    text = "\n".join(lines)
    for old, new in substitutions.items():
        assert old in text, f"{old!r} is not in the guide's {name} block any more:\n{text}"
        text = text.replace(old, new)
    return [shlex.split(line) for line in text.splitlines()]


def pattern(shift: int, size: int) -> bytes:
    block = bytes((j + shift) % 251 for j in range(251))
    return (block * (size // 251 + 1))[:size]


def upgrade_source() -> dict[str, str]:
    """The release the test upgrades from: the first release of the working tree's minor line
    (``0.1.0`` for ``0.1.2-dev``), so the upgrade crosses every schema change the line made —
    the widest upgrade the line promises (docs/user-guide.md §9); the newest release when the
    line has none yet (a new minor line upgrades from the last release of the one before)."""
    releases = json.loads((REPO / "hack" / "releases.json").read_text())["releases"]
    line = __version__.split("-")[0].rsplit(".", 1)[0] + "."
    same_line = [r for r in releases if r["version"].startswith(line)]
    return same_line[0] if same_line else releases[-1]


def spec_fields(crd: dict) -> set[str]:
    """Every property path of an OffloadPool CRD's spec schema (``layout.rowSize``, ...)."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for name, sub in (node.get("properties") or {}).items():
            found.add(prefix + name)
            walk(sub, prefix + name + ".")

    walk(schema, "")
    return found


def crd_file_fields(crd_dir: Path) -> set[str]:
    return spec_fields(yaml.safe_load((crd_dir / "offloadpool.io_offloadpools.yaml").read_text()))


def build_release(helm: Path, version: str) -> dict[str, str]:
    """``hack/release.py build``: the release's image archive and chart (cached by commit)."""
    run = subprocess.run(
        [sys.executable, "hack/release.py", "build", version, "--helm", str(helm)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, f"hack/release.py build {version} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout[run.stdout.index("{") :])


def import_archive(node: RealNode, archive: str) -> str:
    """An image archive of hack/image.py imported into the node's containerd; its name."""
    index = json.loads((Path(archive).parent / "index.json").read_text())
    ref = index["manifests"][0]["annotations"]["io.containerd.image.name"]
    node.ctr("images", "import", "--platform", "linux/amd64", archive)
    assert ref in node.ctr("images", "ls", "-q").stdout.split()
    return ref


class Watch:
    """Every event of a resource, with the time it was read: the objects listed first (as
    ``ADDED``, as ``kubectl get -w`` shows them), then the API server's watch from that list's
    resourceVersion, resumed from the last version seen whenever the server ends it (it ends
    every watch of a custom resource when its CRD changes, as an upgrade's does). Where the
    server cannot resume (410 Gone: its new watch cache starts after that version), the objects
    are listed again (``relisted``): what changed between the two is not in ``events``, so the
    pools' condition times close that gap (``_move``)."""

    def __init__(self, kubectl: Path, env: dict[str, str], plural: str) -> None:
        self.kubectl, self.env = str(kubectl), env
        self.path = f"/apis/{API_VERSION}/{plural}"
        self.events: list[tuple[float, str, dict]] = []
        self.resumed = 0
        self.lost: str | None = None
        self.stopping = False
        self.proc: subprocess.Popen[str] | None = None
        self.relisted = 0
        self.version = self._list()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _list(self) -> str:
        """Every object now, as ADDED events; the list's resourceVersion."""
        listed = json.loads(
            subprocess.run(
                [self.kubectl, "get", "--raw", self.path],
                env=self.env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for obj in listed["items"]:
            self.events.append((time.monotonic(), "ADDED", obj))
        return str(listed["metadata"]["resourceVersion"])

    def _read(self) -> None:
        while not self.stopping and self.lost is None:
            query = f"?watch=1&allowWatchBookmarks=true&resourceVersion={self.version}"
            self.proc = subprocess.Popen(
                [self.kubectl, "get", "--raw", self.path + query],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event["object"]
                if event["type"] == "ERROR":
                    if obj.get("code") != 410:
                        self.lost = f"the watch from resourceVersion {self.version} failed: {obj}"
                        break
                    self.relisted += 1
                    self.version = self._list()
                    break
                self.version = obj["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self.events.append((time.monotonic(), event["type"], obj))
            self.proc.wait()
            if not self.stopping:
                self.resumed += 1
                time.sleep(0.2)

    def whole(self) -> str | None:
        """Why the history may have a gap, or None while every event since the list is in it."""
        if self.lost:
            return self.lost
        return None if self.thread.is_alive() else "the watch's reader stopped"

    def of(self, names: set[str], since: float) -> list[tuple[str, dict]]:
        return [(t, o) for at, t, o in list(self.events) if at >= since and o["metadata"]["name"] in names]

    def stop(self) -> None:
        self.stopping = True
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        self.thread.join(10)


@dataclass
class Upgrade(ReleaseOnNode):
    node: RealNode
    root: Path
    ns: str
    consumers_ns: str
    old: dict[str, str]  # version, chart, image
    new: dict[str, str]
    pools: dict[str, str]  # delivery -> pool
    kubelet_dir: str
    seen: dict[str, Any] = field(default_factory=dict)
    watches: list[Watch] = field(default_factory=list)

    def diagnostics(self) -> str:
        cp = self.cp
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.consumers_ns, check=False).stdout,
                cp.kubectl("get", "offloadpools,offloadpoolnodes", "-o", "yaml", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", AGENTS, "--tail=30", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", PLUGIN, "--tail=30", check=False).stdout,
                cp.kubectl("logs", "-n", self.ns, "-l", OPERATOR, "--tail=60", check=False).stdout,
            ]
        )

    def pods(self, selector: str, ns: str | None = None) -> list[dict]:
        found = self.get("pods", "-n", ns or self.ns, "-l", selector)
        return [] if found is None else found["items"]

    def pool_node(self, pool: str) -> dict:
        return self.get("offloadpoolnodes", f"{pool}.{self.node.name}") or {}

    def ready_pod(
        self, selector: str, image: str, not_uids: frozenset[str] | set[str] = frozenset()
    ) -> dict | None:
        for p in self.pods(selector):
            conditions = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            if (
                p["metadata"]["uid"] not in not_uids
                and not p["metadata"].get("deletionTimestamp")
                and p["spec"]["containers"][0]["image"] == image
                and conditions.get("Ready") == "True"
            ):
                return p
        return None

    def consumers(self) -> dict[str, dict[str, tuple[str, int]]]:
        """Each consumer pod's containers (the lease sidecar too): id and restart count."""
        found = {}
        for pool in self.pools.values():
            pod = self.get("pod", f"engine-{pool}", "-n", self.consumers_ns) or {}
            status = pod.get("status") or {}
            found[pool] = {
                c["name"]: (c.get("containerID", ""), c["restartCount"])
                for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", [])
            }
        return found

    def node_side(self, pool: str) -> dict[str, Any]:
        """What the node keeps of the pool: the record (less its write time and the request as
        the writing version spells it), the manifest's generation, mount id, segment inodes."""
        pool_dir = self.root / pool
        rec = records.load(pool_dir)
        assert rec is not None, f"no record of {pool}"
        kept = {k: v for k, v in vars(rec).items() if k not in ("updated", "request")}
        manifest = manifests.load(pool_dir)
        mount_ids = {}
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                f = line.split()
                if f[4].startswith(f"{pool_dir}/"):
                    mount_ids[f[4]] = f[0]
        inodes = {s.file: (pool_dir / s.file).stat().st_ino for r in manifest.regions for s in r.segments}
        return {"record": kept, "generation": manifest.generation, "mounts": mount_ids, "inodes": inodes}

    def region_bytes(self, pool: str) -> bytes:
        pool_dir = self.root / pool
        out = b""
        for seg in manifests.load(pool_dir).regions[0].segments:
            with open(pool_dir / seg.file, "rb") as fh:
                out += fh.read(seg.bytes)
        return out

    def served_fields(self) -> set[str]:
        """The spec fields the API server's OffloadPool CRD has now."""
        crd = self.get("crd", "offloadpools.offloadpool.io")
        assert crd is not None
        return spec_fields(crd)

    def agent_metrics(self, pod: dict) -> str:
        url = f"http://{pod['status']['podIP']}:{AGENT_HTTP_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.read().decode()

    def operator_first_line(self, pod: dict) -> str:
        """The message of the operator pod's first log line (less the time, logger and level
        logging puts before it), once the kubelet has one to give."""
        name = pod["metadata"]["name"]

        def first() -> str | None:
            out = self.cp.kubectl("logs", "-n", self.ns, name, check=False)
            return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None

        line = str(self.wait(f"a log line of {name}", first, 60))
        logged = re.fullmatch(r"\[[^\]]*\] \S+ \[[^\]]*\] (?P<message>.*)", line)
        assert logged is not None, f"not a log line of the operator's: {line!r}"
        return logged["message"]


@pytest.fixture(scope="module")
def upgrade(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[Upgrade]:
    """The last release installed with its own chart and image (the CSI plugin on); the working
    tree's image imported for the upgrade. Afterwards: consumers, pools, release, namespaces."""
    cp = real_node.cp
    t0 = time.monotonic()
    release = upgrade_source()
    built = build_release(cp.bin_dir / "helm", release["version"])
    # The release's own CRDs, exactly as a user of it has them (the session's are the working
    # tree's): replaced whole, so no field the tree added survives under another field manager.
    release_crds = Path(built["source"]) / "crds"
    cp.kubectl("replace", "-f", str(release_crds))
    old_image = import_archive(real_node, built["image_archive"])
    new_image = import_offloadpool_image(real_node)
    assert old_image != new_image, "the working tree's image carries the release's tag"
    suffix = uuid.uuid4().hex[:6]
    kubelet_dir = str(real_node.workdir / "kubelet")
    up = Upgrade(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-up-{suffix}",
        consumers_ns=f"up-consumers-{suffix}",
        old={
            "version": release["version"],
            "chart": built["chart"],
            "image": old_image,
            "source": built["source"],
        },
        new={"version": __version__, "chart": str(CHART), "image": new_image},
        pools={"HostPath": f"up-hp-{suffix}", "CSI": f"up-csi-{suffix}"},
        kubelet_dir=kubelet_dir,
    )
    up.seen["new fields"] = crd_file_fields(CRD_DIR) - crd_file_fields(release_crds)
    print(f"upgrade: {release['version']} built and both images imported in {time.monotonic() - t0:.1f}s")
    try:
        cp.kubectl("create", "namespace", up.consumers_ns)
        cp.helm(
            "install",
            RELEASE,
            up.old["chart"],
            "--namespace",
            up.ns,
            "--create-namespace",
            "--take-ownership",
            *node_values(old_image),
            "--set",
            "csi.enabled=true",
            "--set",
            f"csi.kubeletDir={kubelet_dir}",
            "--set-json",
            f"csi.tolerations={json.dumps([TOLERATION])}",
            timeout=120,
        )
        for plural in (POOL_PLURAL, NODE_PLURAL):
            up.watches.append(Watch(cp.bin_dir / "kubectl", cp.env, plural))
        yield up
    finally:
        for w in up.watches:
            w.stop()
        remove_release(cp, RELEASE, up.ns, up.pools.values(), real_node.name, [up.consumers_ns])
        cp.kubectl("delete", "csidriver", DRIVER_NAME, "--ignore-not-found", check=False)
        # the working tree's CRDs again, for the session's later tests
        cp.kubectl("replace", "-f", str(CRD_DIR), check=False)


def _engine_pod(up: Upgrade, delivery: str, shift: int) -> dict:
    pool = up.pools[delivery]
    container: dict[str, Any] = {
        "name": "engine",
        "image": up.old["image"],
        "imagePullPolicy": "Never",
        "command": ["python", "-c", ENGINE, "$(OFFLOADPOOL_POOL_DIR)", str(shift)],
        "resources": {"limits": {"memory": "96Mi", "cpu": "100m"}},
    }
    if delivery == "CSI":
        container["securityContext"] = AS_1000
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"engine-{pool}", "labels": {POOL_NAME_LABEL: pool}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [TOLERATION],
            "containers": [container],
        },
    }


def test_upgrade_the_release_runs_two_pools_with_engines_holding_them(upgrade: Upgrade) -> None:
    """The release's operator, agents and CSI plugin run its version; a HostPath and a CSI pool
    are Ready; an engine per pool writes every byte and keeps the region mapped."""
    up, cp = upgrade, upgrade.cp
    t0 = time.monotonic()
    served = up.served_fields()
    assert not served & up.seen["new fields"] and served == crd_file_fields(
        Path(up.old["source"]) / "crds"
    ), f"the API server does not serve the release's CRD: {sorted(served ^ crd_file_fields(CRD_DIR))}"
    operator = up.wait("the release's operator Ready", lambda: up.ready_pod(OPERATOR, up.old["image"]), 180)
    assert up.operator_first_line(operator).startswith(f"offloadpool-operator {up.old['version']}:")
    up.wait("the release's CSI plugin Ready", lambda: up.ready_pod(PLUGIN, up.old["image"]), 180)
    up.ready_memory_pool(up.pools["HostPath"], {"namespaces": [up.consumers_ns]})
    csi = {"namespaces": [up.consumers_ns], "uid": 1000, "gid": 1000, "delivery": "CSI"}
    up.ready_memory_pool(up.pools["CSI"], csi)
    for shift, delivery in enumerate(up.pools, start=7):
        manifest = json.dumps(_engine_pod(up, delivery, shift))

        def admitted(manifest: str = manifest) -> bool:
            out = cp.kubectl("apply", "-n", up.consumers_ns, "-f", "-", input=manifest, check=False)
            assert out.returncode == 0 or "failed calling webhook" in out.stderr, out.stderr
            return out.returncode == 0

        up.wait("the engine pod admitted through the webhook", admitted, 180)
        up.seen[up.pools[delivery]] = {"shift": shift}
    for pool in up.pools.values():

        def wrote(pool: str = pool) -> bool:
            out = cp.kubectl("logs", f"engine-{pool}", "-n", up.consumers_ns, "-c", "engine", check=False)
            return f"WROTE {POOL_BYTES}" in out.stdout

        up.wait(f"the engine of {pool} wrote its pattern", wrote, 180)
        assert up.region_bytes(pool) == pattern(up.seen[pool]["shift"], POOL_BYTES)
        status = up.wait(
            f"{pool}: the engine counted as attached",
            lambda pool=pool: (s := up.pool_node(pool).get("status") or {}).get("enginesAttached") and s,
            60,
        )
        assert status["phase"] == "Ready" and status["agentVersion"] == up.old["version"], status
        up.seen[pool]["node"] = up.node_side(pool)
    (holder,) = published.load_all(up.root / up.pools["CSI"])
    assert holder.target_path in host_mounts()
    up.seen["csi target"] = holder.target_path
    up.seen["consumers"] = up.consumers()
    assert all(c[1] == 0 and c[0] for pod in up.seen["consumers"].values() for c in pod.values())
    up.seen["ds uids"] = {
        d["metadata"]["name"]: d["metadata"]["uid"]
        for d in (up.get("daemonsets", "-n", up.ns) or {})["items"]
    }
    print(f"upgrade: release up, pools Ready, engines attached in {time.monotonic() - t0:.1f}s")


def _move(up: Upgrade, to: dict[str, str], frm: dict[str, str], command: list[str]) -> None:
    """``helm upgrade``/``rollback`` to ``to``, the skew held and checked, the guide's step 2
    (each agent pod deleted), and everything the engines rely on checked unchanged."""
    cp, pools = up.cp, set(up.pools.values())
    assert "consumers" in up.seen, "the release did not come up (the test before)"
    t0 = time.monotonic()
    since = time.monotonic()
    began = now()
    old_operator = up.pods(OPERATOR)[0]["metadata"]["uid"]
    old_plugin = up.pods(PLUGIN)[0]["metadata"]["uid"]
    old_agents = {p["metadata"]["uid"] for p in up.pods(AGENTS)}
    cp.helm(*command, timeout=180)

    # The operator and the CSI plugin are replaced by the chart's own rollout, one node at a
    # time (the plugin's DaemonSet says so), and run the target version.
    operator = up.wait(
        f"the operator of {to['version']} Ready",
        lambda: up.ready_pod(OPERATOR, to["image"], {old_operator}),
        180,
    )
    assert up.operator_first_line(operator).startswith(f"offloadpool-operator {to['version']}:"), (
        up.operator_first_line(operator)
    )
    plugin = up.wait(
        f"the CSI plugin of {to['version']} Ready",
        lambda: up.ready_pod(PLUGIN, to["image"], {old_plugin}),
        180,
    )
    ds = up.get("daemonset", "-n", up.ns, f"{RELEASE}-csi") or {}
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }, ds["spec"]["updateStrategy"]
    up.wait(
        "the new plugin registered",
        lambda: (
            "registered with the kubelet"
            in cp.kubectl("logs", "-n", up.ns, plugin["metadata"]["name"], check=False).stdout
        ),
        60,
    )

    # Skew: the operator of one version over agents of the other. The agents' DaemonSets are
    # OnDelete: re-rendered with the target image, they restart nothing, so the skew holds here
    # for as long as a user leaves it (the guide's step 2 ends it).
    for pool in pools:
        name = f"offloadpool-agent-{pool}"

        def rendered(name: str = name) -> dict | None:
            d = up.get("daemonset", "-n", up.ns, name) or {}
            template = ((d.get("spec") or {}).get("template") or {}).get("spec") or {}
            return d if template.get("containers", [{}])[0].get("image") == to["image"] else None

        d = up.wait(f"{name} re-rendered with {to['image']}", rendered, 120)
        assert d["spec"]["updateStrategy"] == {"type": "OnDelete"}, d["spec"]["updateStrategy"]
    assert {p["metadata"]["uid"] for p in up.pods(AGENTS)} == old_agents, "the upgrade restarted an agent"
    # The pass that re-rendered each DaemonSet aggregated the other version's reports too (a
    # pass writes the pool's status only when it changed: the watch below sees any change).
    for pool in pools:
        line = f"pool {pool}: updated DaemonSet offloadpool-agent-{pool}"
        up.wait(
            f"the operator of {to['version']} logged its pass over {pool}",
            lambda line=line: line in cp.kubectl("logs", "-n", up.ns, operator["metadata"]["name"]).stdout,
            60,
        )
    for pool in pools:
        status = up.pool_node(pool)["status"]
        assert status["agentVersion"] == frm["version"] and status["phase"] == "Ready", status
        aggregate = up.get("offloadpool", pool)["status"]  # type: ignore[index]
        assert (aggregate["phase"], aggregate["readyNodes"], aggregate["desiredNodes"]) == ("Ready", 1, 1), (
            aggregate
        )
    skew = time.monotonic()

    # The guide's step 2, its commands for each pool: the agent pod deleted, with the engine
    # attached; the replacement reuses the region.
    for pool in pools:
        for kubectl, *args in guide_commands(
            "agents",
            {
                "offloadpool-system": up.ns,
                "offloadpool.io/pool=kv": f"{POOL_NAME_LABEL}={pool}",
                "kv.gpu-1": f"{pool}.{up.node.name}",
                "gpu-1": up.node.name,
            },
        ):
            assert kubectl == "kubectl"
            print(cp.kubectl(*args, timeout=120).stdout.rstrip())
    for pool in pools:
        agent = up.wait(
            f"the agent of {pool} at {to['version']} Ready",
            lambda pool=pool: up.ready_pod(f"{AGENTS},{POOL_NAME_LABEL}={pool}", to["image"], old_agents),
            120,
        )
        status = up.wait(
            f"{pool} reported by an agent of {to['version']}",
            lambda pool=pool: (
                (s := up.pool_node(pool).get("status") or {}).get("agentVersion") == to["version"] and s
            ),
            60,
        )
        assert status["phase"] == "Ready" and status["reason"] == "Reused", status
        assert "nothing re-populated" in status["message"], status
        metrics = up.agent_metrics(agent)
        assert f'offloadpool_agent_build_info{{version="{to["version"]}"}} 1.0' in metrics, metrics
        populated = [
            line for line in metrics.splitlines() if line.startswith("offloadpool_populated_bytes_total")
        ]
        assert populated and all(line.endswith(" 0.0") for line in populated), populated
        # No re-provision, no re-fault, no scrub: the node's record, manifest, mounts and files
        # are those the release made, and every byte the engine wrote reads back.
        assert up.node_side(pool) == up.seen[pool]["node"], (up.node_side(pool), up.seen[pool]["node"])
        assert up.region_bytes(pool) == pattern(up.seen[pool]["shift"], POOL_BYTES), f"{pool}: bytes changed"

    # The engines never restarted (same containers, no restart), the CSI volume stayed published.
    assert up.consumers() == up.seen["consumers"], (up.consumers(), up.seen["consumers"])
    assert up.seen["csi target"] in host_mounts(), "the CSI volume was unpublished"
    (holder,) = published.load_all(up.root / up.pools["CSI"])
    assert holder.target_path == up.seen["csi target"]
    # Nothing was deleted, and the pools stayed Ready throughout, seen by a watch.
    ds_uids = {
        d["metadata"]["name"]: d["metadata"]["uid"]
        for d in (up.get("daemonsets", "-n", up.ns) or {})["items"]
    }
    assert ds_uids == up.seen["ds uids"], (ds_uids, up.seen["ds uids"])
    gaps = [why for w in up.watches if (why := w.whole())]
    assert not gaps, f"the history is not whole: {gaps}"
    nodes_seen = up.watches[1].of({f"{p}.{up.node.name}" for p in pools}, since)
    pools_seen = up.watches[0].of(pools, since)
    # the watch saw the move: each new agent's first report (agentVersion changed) at least
    reporters = {
        o["metadata"]["name"]
        for _e, o in nodes_seen
        if (o.get("status") or {}).get("agentVersion") == to["version"]
    }
    assert reporters == {f"{p}.{up.node.name}" for p in pools}, (reporters, nodes_seen)
    for kind, seen in (("OffloadPoolNode", nodes_seen), ("OffloadPool", pools_seen)):
        for event, obj in seen:
            assert event != "DELETED", f"{kind} {obj['metadata']['name']} deleted"
            status = obj.get("status") or {}
            assert status.get("phase") == "Ready", (kind, event, status)
    for _event, obj in pools_seen:
        conditions = {c["type"]: c for c in obj["status"].get("conditions", [])}
        assert conditions["Ready"]["status"] == "True", conditions
        assert conditions.get("Degraded", {}).get("status", "False") == "False", conditions
    # and between the events (a watch listed again sees states, not the changes in between): a
    # condition keeps its lastTransitionTime only while its status never changed, so Ready and
    # Degraded not having moved since the move began is the whole history
    for pool in pools:
        conditions = {c["type"]: c for c in up.get("offloadpool", pool)["status"]["conditions"]}  # type: ignore[index]
        for kind, status in (("Ready", "True"), ("Degraded", "False")):
            if kind not in conditions and status == "False":
                continue  # never set: never True either
            assert conditions[kind]["status"] == status, conditions
            moved = parse_time(conditions[kind]["lastTransitionTime"])
            # whole seconds: a move within began's own second would read as before it
            assert moved is not None and moved < began.replace(microsecond=0), (pool, kind, conditions[kind])
    print(
        f"upgrade to {to['version']}: {time.monotonic() - t0:.1f}s (skew held {skew - since:.1f}s); "
        f"watched {len(nodes_seen)} OffloadPoolNode and {len(pools_seen)} OffloadPool events, all Ready "
        f"(watches resumed after the server ended them: {[w.resumed for w in up.watches]}, "
        f"listed again: {[w.relisted for w in up.watches]})"
    )


def test_upgrade_helm_upgrade_to_the_working_tree_leaves_the_engines_and_their_memory(
    upgrade: Upgrade,
) -> None:
    """The guide's step 1 (its command, with the test's release, namespace and image) and
    step 2, from the release to the working tree."""
    up = upgrade
    repository, tag = up.new["image"].rsplit(":", 1)
    ((helm, *command),) = guide_commands(
        "operator",
        {
            "helm upgrade offloadpool charts/offloadpool": f"helm upgrade {RELEASE} {up.new['chart']}",
            "-n offloadpool-system": f"-n {up.ns}",
            "--set image.tag=0.2.0": f"--set image.repository={repository} --set image.tag={tag}",
        },
    )
    assert helm == "helm"
    _move(up, up.new, up.old, command)


def test_upgrade_new_fields_are_served_and_a_new_shape_waits_for_the_engine(upgrade: Upgrade) -> None:
    """After the upgrade the API server serves every spec field the working tree's CRD adds over
    the release's (the pools made under the release converged on it untouched: the test before).
    A field the release did not know (``layout.rowSize``), set on the pool an engine holds,
    reshapes it: the new agent holds the change back — ``LeaseHeld``, the old region Ready and
    advertised, the pool Ready with ``RolloutPending``, not a byte or page touched — and the
    pool is as it was once the field is taken back (before the rollback, whose CRD lacks it)."""
    up, cp = upgrade, upgrade.cp
    pool = up.pools["HostPath"]
    status = up.pool_node(pool).get("status") or {}
    assert status.get("agentVersion") == up.new["version"], "the upgrade did not happen (the test before)"
    assert up.served_fields() == crd_file_fields(CRD_DIR), "the upgrade did not carry the working tree's CRD"
    added = sorted(up.seen["new fields"])
    print(f"upgrade: fields the working tree's CRD adds over {up.old['version']}: {added}")
    before = up.node_side(pool)
    consumers = up.consumers()
    node = up.node.name

    def advertised() -> bool:
        n = up.get("node", node) or {}
        return pool_label_key(pool) in n["metadata"].get("labels", {}) and extended_resource_name(pool) in (
            n.get("status") or {}
        ).get("allocatable", {})

    assert advertised()
    cp.kubectl(
        "patch",
        "offloadpool",
        pool,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"layout": {"rowSize": "1Mi"}}}),
    )
    generation = up.get("offloadpool", pool)["metadata"]["generation"]  # type: ignore[index]
    held = up.wait(
        f"{pool}: generation {generation} held back by the engine",
        lambda: (s := up.pool_node(pool).get("status") or {}).get("pendingGeneration") == generation and s,
        90,
    )
    assert (held["phase"], held["reason"]) == ("Ready", "LeaseHeld"), held
    aggregate = up.wait(
        f"{pool}: RolloutPending",
        lambda: (
            (st := (up.get("offloadpool", pool) or {}).get("status") or {})
            and {c["type"]: c.get("reason") for c in st.get("conditions", [])}.get("Progressing")
            == "RolloutPending"
            and st
        ),
        60,
    )
    conditions = {c["type"]: c["status"] for c in aggregate["conditions"]}
    assert aggregate["phase"] == "Ready" and conditions["Ready"] == "True", aggregate
    assert advertised(), "the held node lost its label or extended resource"
    assert up.node_side(pool) == before, "the held region was touched"
    assert up.region_bytes(pool) == pattern(up.seen[pool]["shift"], POOL_BYTES)

    # taken back: the spec is the region's shape again; nothing was rebuilt meanwhile
    cp.kubectl(
        "patch", "offloadpool", pool, "--type=json", "-p", '[{"op":"remove","path":"/spec/layout/rowSize"}]'
    )
    generation += 1
    status = up.wait(
        f"{pool}: generation {generation} applied in place",
        lambda: (
            (s := up.pool_node(pool).get("status") or {}).get("observedGeneration") == generation
            and not s.get("pendingGeneration")
            and s
        ),
        90,
    )
    assert status["phase"] == "Ready" and status["reason"] != "LeaseHeld", status
    after = up.node_side(pool)
    kept = ("fingerprint", "populate", "hugepages_added", "scrub", "consumer")
    assert {k: after["record"][k] for k in kept} == {k: before["record"][k] for k in kept}, (after, before)
    assert (after["mounts"], after["inodes"]) == (before["mounts"], before["inodes"])
    assert up.region_bytes(pool) == pattern(up.seen[pool]["shift"], POOL_BYTES)
    assert up.consumers() == consumers and advertised()
    up.wait(
        f"{pool}: rollout Complete",
        lambda: (
            {
                c["type"]: c.get("reason")
                for c in (up.get("offloadpool", pool) or {})["status"]["conditions"]
            }.get("Progressing")
            == "Complete"
        ),
        60,
    )
    up.seen[pool]["node"] = after  # what the rollback must leave as it is


def test_upgrade_helm_rollback_to_the_release_leaves_them_too(upgrade: Upgrade) -> None:
    up = upgrade
    _move(up, up.old, up.new, ["rollback", RELEASE, "1", "-n", up.ns])
    # the release's CRD again: what the working tree added is not served any more
    assert up.served_fields() == crd_file_fields(Path(up.old["source"]) / "crds"), sorted(
        up.served_fields() ^ crd_file_fields(Path(up.old["source"]) / "crds")
    )
