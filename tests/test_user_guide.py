"""docs/user-guide.md's own commands, run as written against the real node, so the guide
cannot drift from what the chart, the operator, the agents and the webhook do.

The guide marks each block a reader runs in order with an HTML comment (invisible when
rendered) before it: ``<!-- guide-test: NAME -->``. This test reads the markdown, takes the
``$`` lines of those blocks (a trailing ``\\`` continues a line) and runs them with bash, with the
real kubectl and helm, in the repository's root (the guide's paths are relative to it). Every
marked block must be there, in ``BLOCKS``' order: a block that disappears or is renamed fails
the test, as does a command that exits non-zero. The helm uninstall's printed output (the
block's other lines) must be what helm prints.

What is substituted, and why (nothing else is; each substitution must find its text, so a guide
that changes under it fails here rather than running unsubstituted):

- namespace `offloadpool-system` -> a fresh one: the session's other tests keep deploy/'s
  objects there;
- the release `offloadpool` (`helm install/upgrade/uninstall offloadpool`,
  `deploy/offloadpool-operator`, `ds/offloadpool-csi`, `app.kubernetes.io/instance=offloadpool`,
  `[Role] offloadpool-agent` and `release "offloadpool" uninstalled` in helm's output, ...) ->
  a fresh name: the chart names cluster-wide objects after the release, as deploy/ names its own;
- `--set image.repository=registry.example/offloadpool --set image.tag=0.1.0` -> the locally
  built image with `pullPolicy=Never`, the operator and the CSI plugin tolerating the node's
  taint, `csi.kubeletDir` at the node's kubelet root (as the try-it cluster's printed
  `helm install` line sets it, so the "csi" block's `helm upgrade --reuse-values --set
  csi.enabled=true` changes neither the operator nor the webhook configurations) and
  `--take-ownership`: the node reaches no registry and is tainted, its kubelet's root is not
  `/var/lib/kubelet`, and the session's CRDs exist already (the guide's "CRDs that already
  exist");
- `-f examples/<pool>.yaml` (`tmpfs-small`, `tmpfs-shares`, `hugepages-unschedulable`,
  `tmpfs-csi`) -> the same pool with the node's toleration and a nodeSelector for it: the node
  is tainted, and the session's other Nodes have no kubelet;
- `-f examples/csi/csi-check.yaml` -> the same pod with the node's local busybox,
  `imagePullPolicy: Never` and the node's toleration;
- `--image=busybox:<tag>` -> the node's local busybox, `--image-pull-policy=Never` and the node's
  toleration (`--overrides`), for the same reasons;
- `kubectl delete offloadpools --all` -> `kubectl delete offloadpools tmpfs-small`: other
  tests' pools share the control plane;
- `kubectl delete -f crds/` is not run: the session's CRDs serve every other test.

The "csi" block's namespace `inference` is the guide's own name (no other test of the session
makes it); the fixture deletes it, and the CSIDriver the release made, whatever happened.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fixtures.chart_node import REPO, import_offloadpool_image, node_values, remove_release
from fixtures.node import TOLERATION, RealNode
from fixtures.wait import wait_for
from offloadpool.csi.config import DRIVER_NAME

pytestmark = pytest.mark.node

GUIDE = REPO / "docs" / "user-guide.md"
#: the marked blocks, in the order a reader runs them
BLOCKS = (
    "install",
    "check",
    "first-pool",
    "consumer",
    "grow-held",
    "shares",
    "csi",
    "unschedulable",
    "delete-pools",
    "uninstall",
    "cleanup",
)
POOL = "tmpfs-small"
#: the partitioned pool, the pool no node can take and the CSI pool (the "shares",
#: "unschedulable" and "csi" blocks)
SHARES, UNSCHEDULABLE, CSI_POOL = "tmpfs-shares", "hugepages-unschedulable", "tmpfs-csi"
POOLS = (POOL, SHARES, UNSCHEDULABLE, CSI_POOL)
#: the "csi" block's consumer namespace (Pod Security `restricted`) and pod
CSI_NAMESPACE, CSI_POD = "inference", "csi-check"
MARKED = re.compile(r"<!-- guide-test: (?P<name>[\w-]+) -->\n\s*```console\n(?P<body>.*?)\n\s*```", re.DOTALL)


@dataclass
class Command:
    line: str
    output: list[str] = field(default_factory=list)  # what the guide shows it printing


def guide_blocks(text: str, marked: re.Pattern[str] = MARKED) -> dict[str, list[Command]]:
    """name -> the block's commands, each with the output lines the guide shows after it;
    ``marked``: the marker's pattern (tests/test_dra_real_node.py runs the blocks marked
    ``dra-guide-test`` on its own release)."""
    blocks: dict[str, list[Command]] = {}
    for match in marked.finditer(text):
        assert match["name"] not in blocks, f"two blocks marked {match['name']!r}"
        commands: list[Command] = []
        continued = False
        for raw in match["body"].splitlines():
            line = raw.strip()
            if continued:
                commands[-1].line = f"{commands[-1].line[:-1].rstrip()} {line}"
            elif line.startswith("$ "):
                commands.append(Command(line[2:]))
            elif line and commands:
                commands[-1].output.append(line)
            continued = line.endswith("\\")
        blocks[match["name"]] = commands
    return blocks


class Substitutions:
    """The table in the module docstring, as (pattern, replacement) pairs; each must be used."""

    def __init__(self, pairs: list[tuple[str, str | Callable[[re.Match[str]], str]]]) -> None:
        self.pairs = [(re.compile(p), r) for p, r in pairs]
        self.used = [0] * len(pairs)

    def __call__(self, text: str) -> str:
        for i, (pattern, replacement) in enumerate(self.pairs):
            text, n = pattern.subn(replacement, text)
            self.used[i] += n
        return text

    def unused(self) -> list[str]:
        return [p.pattern for (p, _), n in zip(self.pairs, self.used, strict=True) if n == 0]


@dataclass
class Guide:
    node: RealNode
    release: str
    namespace: str
    image: str
    tmp: Path

    @property
    def cp(self) -> Any:
        return self.node.control_plane

    def substitutions(self) -> Substitutions:
        for name in POOLS:
            pool = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
            pool["spec"]["tolerations"] = [TOLERATION]
            pool["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.node.name}
            (self.tmp / f"{name}.yaml").write_text(yaml.safe_dump(pool))
        pod = yaml.safe_load((REPO / "examples" / "csi" / f"{CSI_POD}.yaml").read_text())
        pod["spec"]["tolerations"] = [TOLERATION]
        for container in pod["spec"]["containers"]:
            container["image"], container["imagePullPolicy"] = self.node.images["busybox"], "Never"
        (self.tmp / f"{CSI_POD}.yaml").write_text(yaml.safe_dump(pod))
        toleration = shlex.quote(json.dumps({"apiVersion": "v1", "spec": {"tolerations": [TOLERATION]}}))
        busybox = self.node.images["busybox"]
        csi = ["--set", f"csi.kubeletDir={self.node.kubelet_dir}"]
        csi += ["--set-json", f"csi.tolerations={json.dumps([TOLERATION])}"]
        values = shlex.join([*node_values(self.image), *csi, "--take-ownership"])
        return Substitutions(
            [
                (r"\boffloadpool-system\b", self.namespace),
                (r"\b(helm (?:install|upgrade|uninstall)) offloadpool\b", rf"\1 {self.release}"),
                (r"\b(deploy|ds)/offloadpool-(operator|csi)\b", rf"\1/{self.release}-\2"),
                (r"app\.kubernetes\.io/instance=offloadpool\b", f"app.kubernetes.io/instance={self.release}"),
                (r"^\[(?!ServiceAccount\])(\w+)\] offloadpool-agent$", rf"[\1] {self.release}-agent"),
                (r'^release "offloadpool" uninstalled$', f'release "{self.release}" uninstalled'),
                (r"--set image\.repository=registry\.example/offloadpool --set image\.tag=0\.1\.0", values),
                (rf"-f examples/({'|'.join(POOLS)})\.yaml\b", rf"-f {self.tmp}/\1.yaml"),
                (rf"-f examples/csi/{CSI_POD}\.yaml\b", f"-f {self.tmp}/{CSI_POD}.yaml"),
                (
                    r"--image=busybox(?::[\w.-]+)?(?=\s)",
                    f"--image={busybox} --image-pull-policy=Never --overrides={toleration}",
                ),
                (r"\bdelete offloadpools --all\b", f"delete offloadpools {POOL}"),
            ]
        )

    def run(self, command: str, timeout: float = 360) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["bash", "-c", command],
            cwd=REPO,
            env=self.cp.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        print(f"$ {command}\n{out.stdout}{out.stderr}")
        return out

    def get(self, *args: str) -> dict | None:
        out = self.cp.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else None

    def diagnostics(self) -> str:
        ns, operator = self.namespace, f"deploy/{self.release}-operator"
        return "\n".join(
            self.cp.kubectl(*args, check=False).stdout
            for args in (
                ("get", "pods,daemonsets,events", "-n", ns, "-o", "wide"),
                ("get", "offloadpools,offloadpoolnodes", "-o", "yaml"),
                ("get", "pod", "pool-check", "-o", "yaml"),
                ("get", "pods,events", "-n", CSI_NAMESPACE, "-o", "wide"),
                ("get", "csinodes", "-o", "yaml"),
                ("logs", "-n", ns, "-l", "app.kubernetes.io/name=offloadpool-csi", "--tail=40"),
                ("logs", "-n", ns, operator, "--tail=60"),
            )
        )


@pytest.fixture
def guide(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[Guide]:
    """The names and image the guide's commands run with; afterwards the pool, the pod, the
    release, what it kept and its namespace are gone, whatever happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory(prefix="guide-") as tmp:
        g = Guide(real_node, f"guide{suffix}", f"guide-{suffix}", image, Path(tmp))
        try:
            yield g
        finally:
            cp = real_node.control_plane
            for pod in ("pool-check", "pool-hold", "share-check"):
                cp.kubectl("delete", "pod", pod, "--ignore-not-found", "--grace-period=1", check=False)
            remove_release(cp, g.release, g.namespace, POOLS, real_node.name, consumers=[CSI_NAMESPACE])
            cp.kubectl("delete", "csidriver", DRIVER_NAME, "--ignore-not-found", check=False)


def test_the_guide_marks_its_runnable_blocks() -> None:
    """Each block the guide test runs is there, marked, in the order a reader runs them."""
    blocks = guide_blocks(GUIDE.read_text())
    assert tuple(blocks) == BLOCKS, f"marked blocks {tuple(blocks)}, expected {BLOCKS}"
    assert all(blocks[name] for name in BLOCKS), {name: len(blocks[name]) for name in BLOCKS}


def test_the_guides_commands_install_run_a_pool_and_a_pod_and_uninstall(guide: Guide) -> None:
    blocks = guide_blocks(GUIDE.read_text())
    assert tuple(blocks) == BLOCKS, f"marked blocks {tuple(blocks)}, expected {BLOCKS}"
    substitute = guide.substitutions()
    printed: dict[str, str] = {}
    try:
        for name in BLOCKS:
            for command in blocks[name]:
                line = substitute(command.line)
                if re.search(r"\bdelete -f crds/", line):
                    continue  # the session's CRDs (module docstring)
                out = guide.run(line)
                assert out.returncode == 0, f"block {name!r}: `{line}` exited {out.returncode}:\n{out.stderr}"
                printed[command.line] = out.stdout
                if name == "uninstall" and command.output:
                    shown = {substitute(o) for o in command.output}
                    assert shown == {o.strip() for o in out.stdout.splitlines() if o.strip()}, (
                        f"the guide shows\n{chr(10).join(sorted(shown))}\nhelm printed\n{out.stdout}"
                    )
            after(guide, name, printed)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{guide.diagnostics()}") from None
    assert not substitute.unused(), f"substitutions that found nothing in the guide: {substitute.unused()}"


def after(guide: Guide, block: str, printed: dict[str, str]) -> None:
    """What must hold once a block has run, beyond its commands' exit codes."""
    if block == "first-pool":
        # A healthy start: nothing in the operator's log a user would take for a fault.
        log = guide.cp.kubectl("logs", "-n", guide.namespace, f"deploy/{guide.release}-operator").stdout
        assert not [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line], log
    elif block == "consumer":
        log = next(out for line, out in printed.items() if line.startswith("kubectl logs pool-check"))
        # What the pod printed came from the webhook: the environment and the pool's directory.
        assert f"OFFLOADPOOL_POOL={POOL}" in log and f"OFFLOADPOOL_POOL_DIR=/offloadpool/{POOL}" in log, log
        assert {"manifest.json", "lease", "mnt"} <= set(log.split()), log
    elif block == "grow-held":
        # while the pod held it: the old region Ready with LeaseHeld (never Failed); then applied
        shown = next(out for line, out in printed.items() if line.startswith("kubectl get opn"))
        assert shown.split() == ["Ready", "LeaseHeld"], shown
        view = guide.get("offloadpool", POOL) or {}
        assert view["status"]["phase"] == "Ready" and view["status"]["totalBytes"] == 1536 << 20, view
    elif block == "shares":
        # The pod of a partitioned pool was admitted (the validating webhook found it as the
        # mutation wrote it), told its own uid and one share's capacity, and saw both shares and
        # the agent's share service.
        log = next(out for line, out in printed.items() if line.startswith("kubectl logs share-check"))
        uid = next(out for line, out in printed.items() if line.startswith("kubectl get pod share-check"))
        assert f"uid={uid.strip()} capacity={256 << 20}" in log and uid.strip(), (log, uid)
        assert log.split()[-3:] == ["0", "1", "node.sock"], log
        assert guide.get("offloadpool", SHARES) is None, "kubectl delete returned with the pool there"
    elif block == "csi":
        # The pod in the `restricted` namespace was admitted with the inline csi volume and no
        # sidecar, ran as the pool's uid/gid (non-root), read the pool's manifest and saw the
        # pool's files; its deletion unpublished the volume, so the pool's deletion finished.
        ran = {
            line.split()[3]: out
            for line, out in printed.items()
            if line.startswith(f"kubectl -n {CSI_NAMESPACE} ")
        }
        log = ran["logs"]
        assert "uid=1000 gid=1000" in log.splitlines(), log
        assert f'"pool": "{CSI_POOL}"' in log, log
        assert {"manifest.json", "lease", "mnt"} <= set(log.split()), log
        stored = ran["get"]
        assert stored.split() == [DRIVER_NAME], f"volumes' drivers and init containers: {stored!r}"
        assert guide.get("offloadpool", CSI_POOL) is None, "kubectl delete returned with the pool there"
    elif block == "unschedulable":
        said = next(out for line, out in printed.items() if "failingNodes[0].message" in line)
        assert "the agent pod cannot be scheduled" in said and "hugepages-2Mi" in said, said
        # kubectl delete waited for the finalizer: the deletion finished by itself
        assert guide.get("offloadpool", UNSCHEDULABLE) is None, "the pool outlived its deletion"
    elif block == "delete-pools":
        wait_for(f"OffloadPool {POOL} gone", lambda: guide.get("offloadpool", POOL) is None, 60)
        assert not (Path("/var/lib/offloadpool") / POOL).exists(), "the pool's memory was not released"
    elif block == "cleanup":
        selector = f"app.kubernetes.io/instance={guide.release}"
        left = guide.cp.kubectl(
            "get", "clusterrole,clusterrolebinding,validatingadmissionpolicy", "-l", selector, "-o", "name"
        ).stdout
        assert not left.strip(), f"the guide's cleanup left {left}"
