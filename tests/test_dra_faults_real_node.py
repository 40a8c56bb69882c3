"""Faults of the DRA kubelet plugin on the real node: the chart's plugin killed -9 mid-prepare
and mid-unprepare, and a kubelet restart while pods run on prepared claims (docs/dra.md).

Why real: what must converge is the kubelet's retry of ``NodePrepareResources`` and
``NodeUnprepareResources`` (its pod worker's back-off; a terminated pod's status waits for the
unprepare), the DaemonSet's container restart, the kubelet's plugin manager registering the
new plugin (and not wiping the driver's slices meanwhile), containerd applying the CDI spec a
restarted plugin wrote, and the binds reaching the host through the kubelet's shared directory.
tests/test_dra_plugin.py kills the plugin as a bare process at every step
(``csi.faults.DRA_PREPARE_STEPS``, ``DRA_UNPREPARE_STEPS``); only the real kubelet and
containerd can show these. The plugin is held at a step and killed from the host by
``fixtures.plugin_faults`` (the CSI plugin's faults do the same).

The prepare steps here are the three whose kill leaves a different node for the restarted
plugin and the kubelet's retry: ``recorded`` (a record and a reservation without a tree: the
rebuild must drop them, the retry make all of it; a kill there once kept the plugin from ever
starting again), ``bound`` (the tree whole, no CDI spec: the rebuild keeps the claim and writes
the spec the runtime then reads) and ``cdi-written`` (all done, the kubelet never heard: the
retry only answers). ``reserved`` and ``staged`` leave what ``recorded`` leaves once the plugin
is restarted, ``cdi-staged`` what ``bound`` does. Unprepare: ``cdi-removed``, the one step
whose kill the restart undoes (the tree is whole, so the rebuild writes the spec again) and
only the kubelet's retry can finish.

After each fault the node must hold, for exactly the live claims, one record and one
reservation each (of the share the scheduler allocated), one whole tree each and nothing else
mounted in the claims' directory, one CDI spec each and no other file of ours in the CDI
directory, and no other claim directory; nothing in or from the plugin's stage, nothing beneath
the pool's mount.

One release for the module (tests run in order), a pool of three shares: killed after the
record -> after the bind -> after the CDI spec (three pods live) -> killed mid-unprepare of one
(two live) -> the kubelet restarted; both pods deleted, nothing left.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fixtures.node import RealNode
from fixtures.plugin_faults import PluginUnderTest, StoppablePlugin, kubelet_ready, mountinfo, restart_kubelet
from offloadpool.api import dra
from offloadpool.csi import faults
from offloadpool.csi.publication import share_view
from offloadpool.dra.config import DraConfig
from offloadpool.region.holding import published, shares
from test_dra_real_node import PLUGIN_PODS, DraE2E, dra_release

pytestmark = pytest.mark.node

RELEASE = "drafaults"
SHARES = 3
REGISTERED = f"registered with the kubelet as {dra.DRA_DRIVER} (DRAPlugin)"
#: the sources of the plugin's staging tmpfs and of a share's tree (``csi.bind``)
STAGE_SOURCE, SHARE_SOURCE = "offloadpool-csi-stage", "offloadpool-csi-share"
PREPARE_STEPS = (faults.RECORDED, faults.BOUND, faults.CDI_WRITTEN)
#: run in a pod (argv: a length): that many bytes of its share's first segment, through the
#: CDI mount (the token its engine wrote at the start of its region)
READ_TOKEN = """
import os, sys
mnt = os.path.join(os.environ["OFFLOADPOOL_POOL_DIR"], "mnt")
with open(os.path.join(mnt, sorted(os.listdir(mnt))[0]), "rb") as fh:
    print(fh.read(int(sys.argv[1])).decode())
"""


@dataclass
class DraFaults(DraE2E, StoppablePlugin):
    @property
    def config(self) -> DraConfig:
        return DraConfig(
            node_id=self.node.name, kubelet_dir=str(self.node.kubelet_dir), cdi_dir=str(self.node.cdi_dir)
        )

    @property
    def plugin_under_test(self) -> PluginUnderTest:
        c = self.config
        return PluginUnderTest(
            PLUGIN_PODS,
            REGISTERED,
            "offloadpool.dra",
            f"daemonset/{RELEASE}-dra",
            c.kubelet_dir,
            Path(c.plugin_dir),
        )

    @property
    def pool_dir(self) -> Path:
        return self.root / self.pool

    @property
    def live(self) -> dict[str, str]:
        """pod name -> its claim's uid, for the pods this module has running."""
        return self.seen.setdefault("live", {})

    def run_engine(self, name: str, while_pending: Callable[[], Any]) -> Any:
        """A pod of examples/dra/pod.yaml (its claim from the template), ``while_pending``
        called once it is applied; the pod writes its share, the share its claim was allocated
        (read back on the host); it is live from now. What ``while_pending`` returned."""
        token = f"{name}-{uuid.uuid4().hex[:8]}"
        self.engine(name, token)
        done = while_pending()
        log = self.wrote(name, token)
        share = int(log.split(" to share ", 1)[1].split()[0])
        claim = self.claim_of(name)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == dra.share_device(share), (result, log)
        with open(self.pool_dir / "mnt" / f"p{share}-r0-s000", "rb") as fh:
            assert fh.read(len(token)) == token.encode(), "the pod's write is not in its share on the host"
        self.live[name] = claim["metadata"]["uid"]
        self.seen.setdefault("tokens", {})[name] = token
        return done

    def delete(self, name: str, *, wait: bool = True) -> None:
        self.cp.kubectl(
            "delete", "pod", name, "-n", self.consumer_ns, "--grace-period=1", f"--wait={str(wait).lower()}"
        )

    def gone(self, name: str) -> None:
        """The pod is gone from the API: the kubelet unprepared its claim (a terminated pod's
        final status waits for the unprepare)."""
        self.wait(f"pod {name} gone", lambda: self.pod(name) is None, 240)
        del self.live[name]

    def records(self) -> list[published.Published]:
        return published.load_all(self.pool_dir)

    def expected_mounts(self, by_share: dict[str, int]) -> Counter[str]:
        """Each live claim's tree (claim uid -> its share): the share's tmpfs, the pool's lease
        and the share's segments, each once."""
        want: Counter[str] = Counter()
        for uid, share in by_share.items():
            top = f"{self.config.claims_dir}/{uid}/mount"
            files, _ = share_view(self.pool_dir, share)
            want.update([top, f"{top}/lease", *(f"{top}/mnt/{f}" for f in files)])
        return want

    def assert_converged(self) -> None:
        """For exactly the live claims: one record each (of its namespace and share) and one
        reservation each, the share the record names; one whole tree each and no other mount
        in the claims' directory; one CDI spec each and no other file of ours in the CDI
        directory; no other claim directory; nothing of the plugin's stage on the host, nothing
        beneath the pool's mount."""
        uids = sorted(self.live.values())
        records = self.records()
        assert sorted(r.volume_id for r in records) == sorted(f"dra-{u}" for u in uids), records
        assert all(r.pod_namespace == self.consumer_ns and r.share is not None for r in records), records
        by_share = {r.volume_id.removeprefix(published.DRA_PREFIX): int(r.share or 0) for r in records}
        assert shares.reservations(self.pool_dir, SHARES) == {
            s: shares.claim_owner(u) for u, s in by_share.items()
        }
        mounts = mountinfo()
        claims_dir = self.config.claims_dir
        tree = Counter(m.point for m in mounts if m.point.startswith(f"{claims_dir}/"))
        assert tree == self.expected_mounts(by_share), tree
        assert Counter(m.point for m in mounts if m.source == SHARE_SOURCE) == Counter(
            f"{claims_dir}/{u}/mount" for u in uids
        )
        assert not [m for m in mounts if m.source == STAGE_SOURCE], "the plugin's stage reached the host"
        pool_mnt = f"{self.pool_dir}/mnt"
        assert [m.point for m in mounts if m.point.startswith(f"{pool_mnt}/")] == []
        assert sum(1 for m in mounts if m.point == pool_mnt) == self.seen["pool mounts"]
        ours = sorted(n for n in os.listdir(self.config.cdi_dir) if n.startswith(f"{dra.DRA_DRIVER}-"))
        assert ours == sorted(f"{dra.DRA_DRIVER}-{u}.json" for u in uids), ours
        try:
            dirs = sorted(os.listdir(claims_dir))
        except FileNotFoundError:
            dirs = []
        assert dirs == uids, dirs


@pytest.fixture(scope="module")
def dra_faults(real_node: RealNode, crds_installed: Any, shared_agent_root: Path) -> Iterator[DraFaults]:
    """test_dra_real_node's release (``dra_release``) of its own name with a 3-share pool, the
    plugin registered and the pool's slice published; afterwards all of it gone."""
    with dra_release(real_node, shared_agent_root, release=RELEASE, shares=SHARES, kind=DraFaults) as e2e:
        f = e2e
        assert isinstance(f, DraFaults)
        try:
            f.wait("the plugin registered", lambda: f.registrations() >= 1, 240)
            name = dra.slice_name(f.pool, f.node.name)

            def published_slice() -> dict | None:
                s = f.get("resourceslice", name)
                return s if s and len(s["spec"].get("devices") or []) == SHARES else None

            f.wait("the pool's slice with its shares", published_slice, 240)
            pool_mnt = f"{f.pool_dir}/mnt"
            f.seen["pool mounts"] = sum(1 for m in mountinfo() if m.point == pool_mnt)
            assert f.seen["pool mounts"] >= 1, f"{pool_mnt} is not mounted on the host"
            f.assert_converged()
            yield f
        finally:
            f.remove_once_files()


@pytest.mark.parametrize("step", PREPARE_STEPS)
def test_dra_plugin_killed_mid_prepare_converges(dra_faults: DraFaults, step: str) -> None:
    """kill -9 of the plugin held at a prepare step (a new plugin pod, whose rebuild kept the
    claims already live): the kubelet restarts it in its pod, registers it again and retries;
    the pod runs and writes the share its claim was allocated, and the node holds exactly one
    record, reservation, tree and CDI spec per live claim."""
    f = dra_faults
    assert len(f.live) == PREPARE_STEPS.index(step), f"the steps before left {f.live}"
    once = f.stop_at(step)
    f.assert_converged()
    restarts = f.run_engine(f"prep-{step}", lambda: f.kill_the_stopped_plugin(once))
    assert f.restarts() == restarts, "the plugin was restarted again after its retry"
    f.assert_converged()


def test_dra_plugin_killed_mid_unprepare_converges(dra_faults: DraFaults) -> None:
    """A new plugin (its rebuild kept the three live claims) held mid-unprepare of one pod's
    claim, its CDI spec removed and its tree, reservation and record kept, and killed: the
    restarted plugin writes the spec again (the tree is whole), the kubelet's retry unprepares
    the claim and the pod goes; the other two claims stay whole."""
    f = dra_faults
    assert len(f.live) == len(PREPARE_STEPS), f"the mid-prepare tests left {f.live}"
    once = f.stop_at(faults.CDI_REMOVED)
    f.assert_converged()
    victim = sorted(f.live)[0]
    f.delete(victim, wait=False)
    f.kill_the_stopped_plugin(once)
    f.gone(victim)
    f.assert_converged()


def test_dra_kubelet_restart_keeps_the_pods_shares_and_holders(dra_faults: DraFaults) -> None:
    """A kubelet restart with two pods running on prepared claims: the kubelet registers the
    plugin again (the plugin hears it) without restarting it, the pods keep running (no
    container restart) and read their share's token through the CDI mount, the records and
    reservations are unchanged; deleting the pods afterwards unprepares everything."""
    f = dra_faults
    assert len(f.live) == len(PREPARE_STEPS) - 1, f"the tests before left {f.live}"
    f.assert_converged()
    before = (f.records(), shares.reservations(f.pool_dir, SHARES))
    heard, restarts = f.registrations(), f.restarts()
    pods = {name: (f.pod(name) or {})["metadata"]["uid"] for name in f.live}

    restart_kubelet(f.node)
    f.wait("the restarted kubelet Ready", lambda: kubelet_ready(f.node), 180)
    f.wait("the plugin told of its new registration", lambda: f.registrations() > heard, 120)
    assert f.restarts() == restarts, "the kubelet restart restarted the plugin"
    for name, uid in pods.items():
        after = f.pod(name) or {}
        assert after["metadata"]["uid"] == uid and after["status"]["phase"] == "Running", after.get("status")
        assert after["status"]["containerStatuses"][0]["restartCount"] == 0
        token = f.seen["tokens"][name]
        argv = ["python", "-c", READ_TOKEN, str(len(token))]
        read = f.cp.kubectl("exec", "-n", f.consumer_ns, name, "--", *argv).stdout
        assert read.strip() == token, (name, read)
    assert (f.records(), shares.reservations(f.pool_dir, SHARES)) == before
    f.assert_converged()

    for name in sorted(f.live):
        f.delete(name, wait=False)
    for name in sorted(f.live):
        f.gone(name)
    f.assert_converged()
    assert f.records() == [] and shares.reservations(f.pool_dir, SHARES) == {}
