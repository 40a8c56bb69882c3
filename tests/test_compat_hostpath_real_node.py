"""HostPath pools on the real node against root consumers: a compat (stock vLLM) pool's region
file, which a consumer replaces with a link to a host file (issue 36, finding 1); a partitioned
pool, whose share the node gives each pod whatever the pods name, in a pool directory no pod
can write (issue 36, items 4 and 6).

Why real: the hole was the kubelet's ``stat`` of a hostPath ``File`` volume and runc's bind of
its source, both following a link a pod left in the pool's tmpfs; the repair is the kubelet's
own subPath resolution (beneath the volume, refusing a path that leads out of it) and the
agent's heartbeat relinking the name. Only the real kubelet, containerd and runc can say what a
restarted container is then given. One release of the chart (webhook on) with the locally built
image; the consumer is a busybox pod running as root with nothing but the pool's label, so the
webhook writes its volume and mounts. docs/user-guide.md, "Security model".
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fixtures.chart_node import CHART, ReleaseOnNode, import_offloadpool_image, node_values, remove_release
from fixtures.node import TOLERATION, RealNode
from offloadpool.api.constants import POOL_NAME_LABEL
from offloadpool.api.pods import compat_files, pod_pool_dir, pool_volume_name
from offloadpool.region.files import manifest as manifests

pytestmark = pytest.mark.node

RELEASE = "compat"
ENGINE_ID = "attacked"
#: The agents' heartbeat here (the chart's agent.heartbeatSeconds): long enough that the pod's
#: replace -> exit -> restart (1-3 s on this node) almost always falls between two of the
#: agent's checks, so what the restarted container is given is the kubelet's doing, not a race
#: the agent happened to win; short enough that the repair is seen within the test.
HEARTBEAT_SECONDS = 30


@dataclass
class Compat(ReleaseOnNode):
    node: RealNode
    root: Path
    ns: str
    consumers_ns: str
    pool: str
    seen: dict[str, Any] = field(default_factory=dict)
    #: the project's image, as the node's containerd has it (the share engines run it)
    image: str = ""

    def diagnostics(self) -> str:
        cp = self.cp
        return "\n".join(
            [
                cp.kubectl("get", "pods,daemonsets,events", "-n", self.ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "pods,events", "-n", self.consumers_ns, "-o", "wide", check=False).stdout,
                cp.kubectl("get", "offloadpools,offloadpoolnodes", "-o", "yaml", check=False).stdout,
                cp.kubectl(
                    "logs", "-n", self.ns, f"ds/offloadpool-agent-{self.pool}", "--tail=40", check=False
                ).stdout,
                self.node.logs(3000),
            ]
        )


@pytest.fixture(scope="module")
def compat(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[Compat]:
    """helm install with the webhook on (the chart's default) and the agents' heartbeat at
    HEARTBEAT_SECONDS; afterwards the pool, the release and the namespaces are gone, whatever
    happened."""
    image = import_offloadpool_image(real_node)
    suffix = uuid.uuid4().hex[:6]
    c = Compat(
        node=real_node,
        root=shared_agent_root,
        ns=f"offloadpool-compat-{suffix}",
        consumers_ns=f"compat-consumers-{suffix}",
        pool=f"compat-{suffix}",
        image=image,
    )
    cp = real_node.control_plane
    try:
        cp.kubectl("create", "namespace", c.consumers_ns)
        cp.helm(
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            c.ns,
            "--create-namespace",
            "--take-ownership",
            *node_values(image),
            "--set",
            f"agent.heartbeatSeconds={HEARTBEAT_SECONDS}",
            "--set",
            f"operator.heartbeatTimeoutSeconds={4 * HEARTBEAT_SECONDS}",
            timeout=120,
        )
        yield c
    finally:
        remove_release(cp, RELEASE, c.ns, [c.pool, f"{c.pool}-shares"], real_node.name, [c.consumers_ns])


#: The consumer's engine (busybox sh, as root). First start: write a token into the pool's memory
#: through vLLM's file, replace vLLM's name in the pool directory with a link to the host file,
#: exit 3 (restartPolicy OnFailure starts it again). Second start: say what vLLM's file holds
#: now, try to write over it (in place: a truncation would change the segment), exit 0.
ENGINE = r"""
set -u
if [ ! -e /state/started ]; then
  touch /state/started
  printf '%s' "$POOL_TOKEN" | dd of="$VLLM_FILE" bs=1 conv=notrunc 2>/dev/null || exit 10
  ln -sfn "$SCRATCH" "$POOL_NAME" || exit 11
  echo "replaced: $(ls -l "$POOL_NAME")"
  exit 3
fi
echo "sees: $(head -c 64 "$VLLM_FILE" | tr -c 'A-Za-z0-9-' '.')"
printf 'WRITTEN-BY-THE-POD' | dd of="$VLLM_FILE" bs=1 conv=notrunc 2>/dev/null && echo "wrote"
echo "second start done"
"""


def _consumer(c: Compat, scratch: Path, token: str) -> dict:
    """The pod as a user writes it, with the pool's label and nothing of the pool: the webhook
    adds the pool directory (hostPath), vLLM's file (a subPath of it) and the lease sidecar."""
    ((pool_rel, in_pod),) = compat_files(ENGINE_ID)
    env = {
        "POOL_TOKEN": token,
        "SCRATCH": str(scratch),
        "VLLM_FILE": in_pod,
        "POOL_NAME": f"{pod_pool_dir(c.pool)}/{pool_rel}",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine", "labels": {POOL_NAME_LABEL: c.pool}},
        "spec": {
            "restartPolicy": "OnFailure",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [TOLERATION],
            "volumes": [{"name": "state", "emptyDir": {}}],
            "containers": [
                {
                    "name": "engine",
                    "image": c.node.images["busybox"],
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", ENGINE],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                    "volumeMounts": [{"name": "state", "mountPath": "/state"}],
                    "resources": {"limits": {"memory": "32Mi", "cpu": "100m"}},
                }
            ],
        },
    }


@pytest.fixture
def host_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for the host file, on a shared mount as host files are on a systemd node
    (``/`` is shared there). Here ``/`` is private, and containerd binds a hostPath into a
    ``HostToContainer`` mount (6d76805's compat volume had one) only from a shared or slave
    mount: on ``/`` it refused the link's target ("is mounted on / but it is not a shared or
    slave mount"), after following the link, which hid what the kubelet and runc give."""
    path = tmp_path / "host"
    path.mkdir()
    for argv in (["mount", "--bind", path, path], ["mount", "--make-shared", path]):
        subprocess.run(argv, check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=True, capture_output=True)


def test_a_root_consumer_that_links_vllms_name_to_a_host_file_never_gets_the_host_file(
    compat: Compat, host_dir: Path
) -> None:
    """A Ready 16Mi tmpfs compat pool; a root consumer replaces ``mnt/vllm_offload_<id>.mmap``
    (through its own pool mount) with a symlink to a scratch host file and exits non-zero. The
    kubelet's restarts of the container fail: it refuses the subPath that now leads out of the
    pool directory ("failed to prepare subPath"), and once the agent's heartbeat has relinked
    the name, runc cannot mount the kubelet's bind of the first start's file (gone): the pod
    that attacked stays in CrashLoopBackOff, never given the host file. The scratch file is
    unchanged, the OffloadPoolNode gets an ``EntryChanged`` Warning naming the entry, the name
    is a hard link of the segment again, the pool stays Ready."""
    c = compat
    scratch = host_dir / "scratch-host-file"
    content = f"SCRATCH-HOST-FILE-{uuid.uuid4().hex}\n".encode() * 8
    scratch.write_bytes(content)
    scratch.chmod(0o644)

    body = {
        "apiVersion": "offloadpool.io/v1alpha1",
        "kind": "OffloadPool",
        "metadata": {"name": c.pool},
        "spec": {
            "capacity": "16Mi",
            "medium": "Memory",
            "tolerations": [TOLERATION],
            "consumers": {"namespaces": [c.consumers_ns]},
            "compat": {"vllm": {"engineId": ENGINE_ID, "numSegments": 1}},
        },
    }
    c.cp.kubectl("apply", "-f", "-", input=json.dumps(body))
    pool_node = f"{c.pool}.{c.node.name}"

    def ready() -> dict | None:
        status = (c.get("offloadpoolnodes", pool_node) or {}).get("status") or {}
        return status if status.get("phase") == "Ready" else None

    c.wait(f"OffloadPoolNode {pool_node} Ready", ready, 180)
    pool_dir = c.root / c.pool
    ((pool_rel, in_pod),) = compat_files(ENGINE_ID)
    name = pool_dir / pool_rel
    segment = pool_dir / manifests.load(pool_dir).regions[0].segments[0].file
    assert os.lstat(name).st_ino == os.stat(segment).st_ino, "vLLM's name is not the segment's link"

    token = f"POOL-MEMORY-{uuid.uuid4().hex[:12]}"
    c.cp.kubectl("apply", "-n", c.consumers_ns, "-f", "-", input=json.dumps(_consumer(c, scratch, token)))
    stored = c.get("pod", "engine", "-n", c.consumers_ns)
    assert stored is not None
    # What the webhook wrote: one hostPath (the pool directory), vLLM's file a subPath of it.
    host_paths = [v["hostPath"]["path"] for v in stored["spec"]["volumes"] if "hostPath" in v]
    engine = stored["spec"]["containers"][0]
    print(f"webhook's hostPaths: {host_paths}; engine mounts: {engine['volumeMounts']}")

    waiting: list[str] = []

    def engine_logs() -> str:
        """Every log the engine container left: its latest and its previous start's."""
        args = ("logs", "engine", "-n", c.consumers_ns, "-c", "engine")
        return "".join(c.cp.kubectl(*args, *more, check=False).stdout for more in ((), ("--previous",)))

    def restart_decided() -> list[str] | None:
        """What became of the engine container's restart: the kubelet's refusals (its subPath
        now leads out of the pool directory; once the agent relinked the name, the kubelet's
        own bind of the first start's file is gone), seen as events and as the container's
        waiting state; or, where nothing refused it, the second start's log (the restart ran
        with whatever the kubelet and runc gave it at vLLM's path)."""
        obj = c.get("pod", "engine", "-n", c.consumers_ns) or {"status": {}}
        for status in obj["status"].get("containerStatuses", []):
            state = status.get("state", {}).get("waiting")
            if status["name"] == "engine" and state:
                seen = f"{state.get('reason')}: {state.get('message', '')}"
                if seen not in waiting:
                    waiting.append(seen)
        events = c.get("events", "-n", c.consumers_ns) or {"items": []}
        found = [e["message"] for e in events["items"] if "subPath" in e.get("message", "")]
        if found:
            return found
        logs = engine_logs()
        return [f"the restart ran: {logs.strip()}"] if "second start done" in logs else None

    decided = c.wait("the restart refused or run", restart_decided, 4 * HEARTBEAT_SECONDS + 60)
    first = engine_logs()
    print(f"engine logs: {first.strip()}")
    print(f"while restarting, the engine container waited: {waiting}")
    print(f"what became of the restart: {decided}")

    # The scratch host file: never reached, never written; no start of the container saw it.
    assert scratch.read_bytes() == content, (
        f"the consumer wrote the host file through vLLM's name: {scratch} holds "
        f"{scratch.read_bytes()[:64]!r}; engine logs: {first.strip()}"
    )
    assert "replaced:" in first and str(scratch) in first, (first, c.diagnostics())
    assert "SCRATCH-HOST-FILE" not in first, f"a container start got the host file: {first}"
    assert any("failed to prepare subPath" in m for m in decided), (decided, c.diagnostics())

    # The node saw and repaired it: a Warning naming the entry, the name the segment's link again.
    def entry_changed() -> list[dict] | None:
        out = c.get("events", "-n", "default", "--field-selector", f"involvedObject.name={pool_node}")
        found = [e for e in (out or {}).get("items", []) if e.get("reason") == "EntryChanged"]
        return found or None

    warnings = c.wait("an EntryChanged Event for the pool's node", entry_changed, 2 * HEARTBEAT_SECONDS + 30)
    print(f"agent: {warnings[0]['message']}")
    assert warnings[0]["type"] == "Warning", warnings[0]
    assert str(name) in warnings[0]["message"] and "symbolic link" in warnings[0]["message"], warnings[0]

    def relinked() -> os.stat_result | None:
        st = os.lstat(name)
        return st if stat.S_ISREG(st.st_mode) and st.st_ino == os.stat(segment).st_ino else None

    c.wait(f"{name} a link of {segment} again", relinked, 2 * HEARTBEAT_SECONDS + 30)
    status = ready()
    assert status is not None, c.get("offloadpoolnodes", pool_node)
    print(f"pool node after the repair: {status.get('reason')}: {status.get('message')}")
    # The host file is still untouched after the repair, and no start of the container ran
    # past its mounts since the link: the only log is the first start's.
    assert scratch.read_bytes() == content
    again = engine_logs()
    assert "SCRATCH-HOST-FILE" not in again, again
    assert pool_volume_name(c.pool) in {m["name"] for m in engine["volumeMounts"]}
    assert in_pod in {m["mountPath"] for m in engine["volumeMounts"]}


#: A root engine over hostPath (the project's image): try to write the pool directory (the
#: host's disk), attach (the node gives the share; both pods name one owner), write a token into
#: its share's memory, say all that, hold.
SHARE_ENGINE = """
import errno, json, os, sys, time
from offloadpool.pinning import attach
pool = os.environ["OFFLOADPOOL_POOL_DIR"]
tried = {}
for rel in ("planted", "shares/planted", "shares/0/lease", "lease"):
    try:
        os.close(os.open(os.path.join(pool, rel), os.O_WRONLY | os.O_CREAT, 0o644))
        tried[rel] = "written"
    except OSError as exc:
        tried[rel] = errno.errorcode[exc.errno]
region = attach(pool, 0)
view = region.memoryview()
view[:32] = sys.argv[1].encode().ljust(32, b".")
print(json.dumps({"share": region.share, "tried": tried, "uid": os.getuid()}), flush=True)
time.sleep(3600)
"""


def _share_engine(c: Compat, pool: str, name: str, token: str) -> dict:
    """A root pod with the pool's label and one owner it names itself (which decides nothing)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {POOL_NAME_LABEL: pool}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "engine",
                    "image": c.image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", SHARE_ENGINE, token],
                    "env": [{"name": "OFFLOADPOOL_SHARE_OWNER", "value": "one-owner-for-both"}],
                    "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                    "resources": {"limits": {"memory": "64Mi", "cpu": "100m"}},
                }
            ],
        },
    }


def test_hostpath_pods_get_the_share_the_node_gives_in_a_directory_they_cannot_write(compat: Compat) -> None:
    """A Ready 16Mi tmpfs pool of 2 partitions, HostPath; two root pods naming one share owner
    in their environment. Each gets its own share (the agent reads each pod from the cgroup the
    kubelet made; the env decides nothing), writes its token into its share's memory (on the
    host, in that share's segment), and can create or write nothing in the pool directory
    (``EROFS``: the webhook's mount of it is read-only, its memory mount below is not). The
    OffloadPoolNode shows each share ``via: HostPath`` for its pod."""
    c = compat
    pool = f"{c.pool}-shares"
    c.ready_memory_pool(pool, {"namespaces": [c.consumers_ns]}, partitions=2)
    pool_dir = c.root / pool
    tokens = {name: f"{name}-{uuid.uuid4().hex[:12]}" for name in ("share-a", "share-b")}
    for name, token in tokens.items():
        c.cp.kubectl(
            "apply", "-n", c.consumers_ns, "-f", "-", input=json.dumps(_share_engine(c, pool, name, token))
        )

    def said(name: str) -> Any:
        def read() -> dict | None:
            out = c.cp.kubectl("logs", name, "-n", c.consumers_ns, "-c", "engine", check=False).stdout
            line = next((ln for ln in out.splitlines() if ln.startswith("{")), None)
            return json.loads(line) if line else None

        return read

    seen = {name: c.wait(f"{name} attached", said(name), 180) for name in tokens}
    print(f"engines: {seen}")
    assert {seen["share-a"]["share"], seen["share-b"]["share"]} == {0, 1}, seen
    for what in seen.values():
        assert what["uid"] == 0 and set(what["tried"].values()) == {"EROFS"}, what
    assert not (pool_dir / "planted").exists() and not (pool_dir / "shares" / "planted").exists()

    uids = {name: (c.get("pod", name, "-n", c.consumers_ns) or {})["metadata"]["uid"] for name in tokens}
    for name, what in seen.items():
        view = manifests.load(pool_dir / "shares" / str(what["share"]))
        segment = view.regions[0].segments[0].file
        with open(pool_dir / "shares" / str(what["share"]) / segment, "rb") as fh:
            assert fh.read(32).rstrip(b".") == tokens[name].encode(), name

    pool_node = f"{pool}.{c.node.name}"

    def shown() -> list | None:
        shares = ((c.get("offloadpoolnodes", pool_node) or {}).get("status") or {}).get("shares") or []
        by_pod = {tuple(s.get("pods", [])): s for s in shares}
        want = [(uids[name],) for name in tokens]
        return shares if all(w in by_pod for w in want) else None

    shares = c.wait("each share shown for its pod", shown, 90)
    for share in shares:
        pod = share["pods"][0]
        assert share["via"] == "HostPath" and share["holder"] == f"pod/{pod}", share
        assert seen[next(n for n, u in uids.items() if u == pod)]["share"] == share["index"], (share, seen)
