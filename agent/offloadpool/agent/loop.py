"""The agent's control loop: observe, decide (reconcile.py), act on the node, report.

One thread runs the loop; two watch threads (the pool by name, our OffloadPoolNode by name —
never anything cluster-wide) only wake it up early. The loop also wakes every heartbeat period,
so a missed watch event costs at most one heartbeat, and after a failure every retry period.
Provisioning runs inside the loop; its progress callback (from populate workers) goes straight
to the throttled status writer, which writes the transient phases (Provisioning, Populating)
only when they outlast its progress interval.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import watch
from kubernetes.client.rest import ApiException

from offloadpool.agent import kube
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.reconcile import Action, Decision, decide
from offloadpool.agent.status_writer import RETRY_FIRST_SECONDS, StatusWriter, retry_after
from offloadpool.api.constants import DEFAULT_HEARTBEAT_SECONDS, GROUP, NODE_PLURAL, POOL_PLURAL, VERSION
from offloadpool.api.conversion import SpecError
from offloadpool.api.media import is_hugetlbfs
from offloadpool.region import engine_id_mismatch, holders, places
from offloadpool.region import record as records
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.lease import LeaseHeld
from offloadpool.region.provision import provision
from offloadpool.region.release import release
from offloadpool.region.request import PoolRequest
from offloadpool.region.scrub import ScrubPending
from offloadpool.region.status import local_region

log = logging.getLogger(__name__)

#: The Lease's leaseDurationSeconds, in heartbeat periods (as the kubelet: 40 s for 10 s renewals).
LEASE_PERIODS = 4
#: With watches, how many heartbeat periods a step may go on the watched objects without a read.
REREAD_PERIODS = 6
#: After the API server has refused our credential (401) for this many heartbeat periods in a
#: row, the agent exits non-zero: its token authenticates no more (its ServiceAccount was
#: deleted, perhaps made again), and no retry of this process can mend that. The exit shows on
#: the pod (restarts, CrashLoopBackOff, the last log line says why); the operator replaces a
#: pod made before its ServiceAccount, and only a new pod gets a token that works (the kubelet
#: serves a restarted container the same cached one). Memory is never touched by the exit.
UNAUTHORIZED_PERIODS = 6
#: How often the 401 is logged while it lasts (the first time at once).
UNAUTHORIZED_LOG_SECONDS = 60.0


def _revision(obj: dict[str, Any]) -> int:
    """An object's resourceVersion as a number (etcd's revision, as the operator compares)."""
    rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(rv) if rv.isdigit() else 0


def _acted_on(pool: dict[str, Any]) -> tuple[Any, ...]:
    """What of a pool an agent acts on: its identity, spec (generation) and deletion."""
    meta = pool.get("metadata") or {}
    return meta.get("uid"), meta.get("generation"), meta.get("deletionTimestamp")


@dataclass
class Applied:
    """What this process last made true on the node (so a heartbeat does not re-provision)."""

    request: PoolRequest
    total_bytes: int


class Agent:
    def __init__(
        self,
        access: kube.KubeAccess,
        root: Path,
        *,
        metrics: AgentMetrics,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        retry_seconds: float = 5.0,
        workers: int = 0,
        watches: bool = True,
        reread_seconds: float | None = None,
    ) -> None:
        self.access = access
        self.root = Path(root)
        self.pool_name = access.pool
        self.metrics = metrics
        self.heartbeat_seconds = heartbeat_seconds
        self.retry_seconds = retry_seconds
        self.workers = workers
        self.watches = watches
        # With watches, a step takes the pool and the OffloadPoolNode from their last events
        # and reads them from the API server only this often (a missed event costs at most
        # this); without, every step reads (polling). Liveness is the Lease, renewed regardless.
        self.reread_seconds = (
            reread_seconds
            if reread_seconds is not None
            else (REREAD_PERIODS * heartbeat_seconds if watches else 0.0)
        )
        #: the pool and our OffloadPoolNode as last read or delivered by a watch (None: absent)
        self._seen: dict[str, dict[str, Any] | None] = {}
        #: events noticed per object name: a read that raced an event must not replace it
        self._noticed: dict[str, int] = {}
        self._seen_lock = threading.Lock()
        #: when a read or a watch event last brought each object (monotonic)
        self._fresh: dict[str, float] = {}
        self.status = StatusWriter(access.patch_status, kube.now)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.applied: Applied | None = None
        self.released = False
        self.last_tick = time.monotonic()
        self._pool_node: dict[str, Any] | None = None
        #: this process has seen its OffloadPoolNode (so a missing one was removed: not ours
        #: to make again) or may not create it (RBAC of an older release): see ``_create_pool_node``
        self._pool_node_seen = False
        self._create_refused = False
        self._create_failures = 0
        self._lease_failures = 0
        #: a step's wish to come again sooner than it would (a refused create or Lease write)
        self._soon = 0.0
        self._last_event: tuple[str, str] | None = None
        self._failures = 0
        self._renewed = float("-inf")
        #: since when (monotonic) every read was refused with 401, and when that was last logged
        self._unauthorized_since: float | None = None
        self._unauthorized_logged = float("-inf")
        #: set when the loop stopped because the credential no longer authenticates
        self.credential_rejected = False
        self.thread: threading.Thread | None = None
        #: engines attached at the last heartbeat (scrub Always: provision again when they left)
        self._attached = 0
        #: the provision in progress zeroed the memory (said Scrubbing)
        self._scrubbed = False

    # -- pool directory ----------------------------------------------------------------------
    @property
    def pool_dir(self) -> Path:
        return places.pool_dir(self.root, self.pool_name)

    def _local(self) -> tuple[int, int] | None:
        """(generation, total bytes) of the complete region on this node, from the node's own
        record: the manifest is in the pod-writable pool directory and is not trusted."""
        return local_region(self.root, self.pool_name)

    def local_generation(self) -> int | None:
        """Generation of the complete region on this node (None if there is none)."""
        local = self._local()
        return None if local is None else local[0]

    def engines_attached(self) -> int:
        """Processes holding the lease or mapping/opening the pool's files, each once.

        Stock vLLM takes no lease: counting mappings too is what makes it visible. The scan
        sees other pods' processes only when this agent reads the host's /proc. The scan runs
        only when a file of the pool is open or mapped somewhere (``holders.count``).
        """
        return holders.count(self.pool_dir)

    def engine_id_mismatch(self) -> str | None:
        """For a stock-vLLM compat pool: a process that was given the pool but maps a vLLM
        region of its own (another engine id), in one line; None when there is none.

        vLLM itself reports nothing in that case (it builds its own region and the pool stays
        unused), so this is the only place the mistake becomes visible.
        """
        engine_id = self.applied.request.compat_engine_id if self.applied else None
        if engine_id is None:
            return None
        found = engine_id_mismatch.find(self.pool_dir)
        return engine_id_mismatch.describe(found, engine_id)[:4096] if found else None

    # -- health ------------------------------------------------------------------------------
    def live(self) -> tuple[bool, str]:
        alive = self.thread is None or self.thread.is_alive()
        return alive, "ok" if alive else "agent loop has stopped"

    def ready(self) -> tuple[bool, str]:
        phase = self.status.phase
        return phase == "Ready", f"phase {phase}"

    # -- running -----------------------------------------------------------------------------
    def start(self) -> Agent:
        self.thread = threading.Thread(target=self.run, name=f"agent-{self.access.node_object}", daemon=True)
        self.thread.start()
        if self.watches:
            for plural, name in ((POOL_PLURAL, self.access.pool), (NODE_PLURAL, self.access.node_object)):
                threading.Thread(
                    target=self._watch, args=(plural, name), name=f"watch-{plural}", daemon=True
                ).start()
        return self

    def _watch(self, plural: str, name: str) -> None:
        """Wake the loop on any change of one named object. Errors: back off and re-watch."""
        while not self.stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.access.custom.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    plural,
                    field_selector=f"metadata.name={name}",
                    timeout_seconds=120,
                ):
                    self.notice(event["object"], deleted=event["type"] == "DELETED")
                    if self.stop.is_set():
                        break
            except Exception as exc:  # API restarts, expired resourceVersion, RBAC: re-list later
                log.debug("watch %s/%s ended: %s", plural, name, exc)
                self.stop.wait(self.retry_seconds)
            finally:
                w.stop()

    def notice(self, obj: dict[str, Any], *, deleted: bool = False) -> None:
        """A watch event about our pool or OffloadPoolNode: keep the object for the next step
        and wake the loop — unless the event is our own last status write coming back (a step
        for it would find nothing new; at a thousand nodes, two reads per write for nothing)."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if name not in (self.access.pool, self.access.node_object):
            return
        if (
            name == self.access.node_object
            and meta.get("resourceVersion") is not None
            and meta.get("resourceVersion") == self.status.written_version
        ):
            return
        with self._seen_lock:
            before = self._seen.get(name)
            self._seen[name] = None if deleted else obj
            self._noticed[name] = self._noticed.get(name, 0) + 1
            self._fresh[name] = time.monotonic()
        if (
            name == self.access.pool
            and before is not None
            and not deleted
            and _acted_on(before) == _acted_on(obj)
        ):
            return  # the pool's status (the operator's passes write it often): nothing to do here
        self.wake.set()

    def _observe(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The pool and our OffloadPoolNode: as their watches last delivered them, or read.

        Each is read when never seen, or when neither a read nor a watch event brought it for
        ``reread_seconds`` (a missed event costs at most that). A read is what ``notice`` keeps
        too, so a late event of an older version is the only way to go back in time, and the
        next event or read corrects it. Our OffloadPoolNode is not read while the step is about
        to create it (``_may_create``: never seen, or last seen absent): a new pool's agent makes
        one request instead of a read that finds nothing and then the create; the create's 409
        reads it.
        """
        pool_name, node_name = self.access.pool, self.access.node_object
        if self._due(pool_name):
            self._read(pool_name, self.access.get_pool)
        pool = self._seen.get(pool_name)
        if self._due(node_name) and not (self._seen.get(node_name) is None and self._may_create(pool)):
            self._read(node_name, self.access.get_pool_node)
        pool_node, written = self._seen.get(node_name), self.status.written_object
        if pool_node is not None and written is not None and _revision(written) > _revision(pool_node):
            pool_node = written  # our own later write: its event is not kept (or not here yet)
        return pool, pool_node

    def _due(self, name: str) -> bool:
        with self._seen_lock:
            fresh = self._fresh.get(name, float("-inf"))
            return name not in self._seen or time.monotonic() - fresh >= self.reread_seconds

    def _read(self, name: str, get: Callable[[], dict[str, Any] | None]) -> None:
        with self._seen_lock:
            noticed = self._noticed.get(name)
        read_at = time.monotonic()
        obj = get()
        self._unauthorized_since = None
        with self._seen_lock:
            if self._noticed.get(name) == noticed:  # no event during the read
                self._seen[name] = obj
            self._fresh[name] = max(self._fresh.get(name, float("-inf")), read_at)

    def run(self) -> None:
        while not self.stop.is_set():
            self.last_tick = time.monotonic()
            try:
                delay = self.step()
            except Exception as exc:  # never let one bad step kill the agent; report and retry
                log.exception("agent step failed")
                self.metrics.error("Internal")
                self.status.set(reason="AgentError", message=f"{type(exc).__name__}: {exc}"[:1024])
                delay = self.retry_seconds
            self.wake.wait(delay)
            self.wake.clear()
        self.status.close()

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> float:
        """Observe, decide, act; return seconds until the next step unless woken earlier."""
        self._soon = 0.0
        delay = self._step()
        return min(delay, self._soon) if self._soon else delay

    def _step(self) -> float:
        try:
            pool, pool_node = self._observe()
        except ApiException as exc:
            self.metrics.error("ApiRead")
            if exc.status == 401:
                return self._unauthorized()
            log.warning("cannot read pool/OffloadPoolNode: %s %s", exc.status, exc.reason)
            return self.retry_seconds
        try:
            return self._act(pool, pool_node)
        finally:  # after the step's own status write, which may make a renewal needless
            if pool is not None:
                self._renew_lease(pool)

    def _unauthorized(self) -> float:
        """A read or a renewal refused with 401: say so plainly (once a minute, not every retry), and once it
        has lasted ``UNAUTHORIZED_PERIODS`` heartbeats stop the loop, so the process exits
        non-zero (``main``) instead of retrying for ever."""
        clock = time.monotonic()
        if self._unauthorized_since is None:
            self._unauthorized_since = clock
        lasted = clock - self._unauthorized_since
        if lasted >= UNAUTHORIZED_PERIODS * self.heartbeat_seconds:
            log.error(
                "the API server has refused this agent's token (401 Unauthorized) for %.0fs: exiting. "
                "The token's ServiceAccount was deleted (and perhaps made again); this pod can get no "
                "other token, the next pod will (the operator replaces a pod made before its "
                "ServiceAccount; or delete this pod). The memory on the node is untouched.",
                lasted,
            )
            self.credential_rejected = True
            self.stop.set()
            return 0.0
        if clock - self._unauthorized_logged >= UNAUTHORIZED_LOG_SECONDS:
            self._unauthorized_logged = clock
            log.error(
                "the API server refuses this agent's token (401 Unauthorized): its ServiceAccount "
                "was probably deleted (helm uninstall, kubectl delete); exiting if it lasts %.0fs",
                UNAUTHORIZED_PERIODS * self.heartbeat_seconds,
            )
        return self.retry_seconds

    def _act(self, pool: dict[str, Any] | None, pool_node: dict[str, Any] | None) -> float:
        if pool is not None and pool_node is None:
            pool_node = self._create_pool_node(pool)
        self._pool_node_seen = self._pool_node_seen or pool_node is not None
        self._pool_node = pool_node
        try:
            decision = decide(pool, pool_node, self.local_generation(), self.workers)
        except SpecError as exc:
            return self._fail("InvalidSpec", str(exc))
        act = {
            Action.IDLE: self._idle,
            Action.WAIT: self._idle,
            Action.PROVISION: self._provision,
            Action.KEEP: self._keep,
            Action.RELEASE: self._release,
            Action.RETAIN: self._retain,
        }[decision.action]
        return act(decision)

    def _may_create(self, pool: dict[str, Any] | None) -> bool:
        """Whether this step creates our OffloadPoolNode if it is missing (``_create_pool_node``)."""
        if pool is None or self._pool_node_seen or self._create_refused:
            return False
        meta = pool.get("metadata") or {}
        return not meta.get("deletionTimestamp") and bool(meta.get("uid"))

    def _create_pool_node(self, pool: dict[str, Any]) -> dict[str, Any] | None:
        """Create this node's OffloadPoolNode, as node-feature-discovery's workers create their
        NodeFeature objects: the operator would otherwise make one per selected node in its
        passes, which was a third of its CPU while a new pool converged (docs/scale.md).

        Only while the pool is live, and only when this process has never seen the object: one
        that disappeared after it was seen was removed by the operator (the node was
        deselected or is going) and is the operator's to make again, which it does for every
        selected node whose agent has not within ``--node-object-grace``. Refused by RBAC (a
        release before agents could create it): logged once, the operator makes it. Refused
        otherwise (a new pool's agents all start at once, and the API server's priority and
        fairness answers 429 to many): tried again after its Retry-After, or 1 s doubling up
        to the retry period, each with up to half again at random so the retries spread.
        """
        if not self._may_create(pool):
            return None
        try:
            made = self.access.create_pool_node(pool)
        except ApiException as exc:
            log.warning("cannot create the OffloadPoolNode: %s %s", exc.status, exc.reason)
            self.metrics.error("CreatePoolNode")
            self._create_refused = exc.status == 403
            self._create_failures += 1
            self._again(exc, self._create_failures)
            return None
        self._create_failures = 0
        with self._seen_lock:
            self._seen[self.access.node_object] = made
            self._fresh[self.access.node_object] = time.monotonic()
        return made

    def _again(self, exc: ApiException, failures: int) -> None:
        """Come back for a refused write after the server's Retry-After, or 1 s doubling per
        failure in a row, each with up to half again at random so the agents' retries spread
        (the client already sent a throttled request again several times: ``kube.throttled_retries``);
        never later than the retry period."""
        delay = max(retry_after(exc), RETRY_FIRST_SECONDS * 2 ** (failures - 1))
        soon = min(self.retry_seconds, delay * random.uniform(1.0, 1.5))
        self._soon = min(self._soon, soon) if self._soon else soon

    def _idle(self, d: Decision) -> float:
        log.debug("%s: %s", d.reason, d.message)
        return self.retry_seconds

    def _beat(self, **fields: Any) -> None:
        n = self.engines_attached()
        self._attached = n
        self.metrics.engines(n)
        # the object as read this step lost what we wrote (re-created by the operator, edited
        # by hand): write all of it again, not just what changed
        seen = (self._pool_node or {}).get("status") or {}
        mismatch = self.engine_id_mismatch()
        if mismatch is not None or self._mismatch_shown(seen):
            fields["engine_id_mismatch"] = mismatch  # set it, or clear what is shown
        self.status.set(full=seen.get("phase") != self.status.phase, engines_attached=n, **fields)
        if mismatch is not None:
            self._event("Warning", "EngineIdMismatch", mismatch)

    def _mismatch_shown(self, seen: dict[str, Any]) -> bool:
        """Whether the object (as read this step, or as this process wrote it) shows a mismatch.

        Only then is a None worth sending: a null for a field that was never there would be a
        status write on every pool's first heartbeat, for nothing (liveness writes no status).
        An agent restarted while a mismatch was shown still clears it: the read shows it.
        """
        return seen.get("engineIdMismatch") is not None or self.status.current.engine_id_mismatch is not None

    def _renew_lease(self, pool: dict[str, Any]) -> None:
        """Renew the heartbeat Lease (creating it first), unless this agent showed itself alive
        less than half a heartbeat period ago — by a renewal, or by a status write, whose
        ``heartbeat`` the operator takes as a sign of life too (the later of the two counts).
        So a step that wrote the status renews nothing, and a new agent, which writes its status
        as soon as its region is built, makes its Lease a heartbeat later: on a pool that
        converges within a heartbeat, no Lease write at all (one per node before). A failure is
        logged and the step goes on; the next step comes soon (``_again``), not a heartbeat
        period later, and tries again: the Lease is how the operator tells a live agent from a
        silent one."""
        now = time.monotonic()
        if now - max(self._renewed, self.status.written_at) < self.heartbeat_seconds / 2:
            return
        try:
            self.access.renew_lease(max(1, round(self.heartbeat_seconds * LEASE_PERIODS)), pool)
            self._renewed = now
            self._lease_failures = 0
            self._unauthorized_since = None
        except ApiException as exc:
            if exc.status == 401:  # every heartbeat, where reads come only every REREAD_PERIODS
                self._unauthorized()
                return
            log.warning("cannot renew the heartbeat Lease: %s %s", exc.status, exc.reason)
            self.metrics.error("LeaseRenew")
            self._lease_failures += 1
            self._again(exc, self._lease_failures)

    def _provision(self, d: Decision) -> float:
        req = d.request
        assert req is not None
        if (
            self.applied
            and self.applied.request == req
            and self.status.phase == "Ready"
            and self.status.exists
        ):
            attached = self._attached
            self._beat()
            if req.scrub != "Always" or not attached or self._attached:
                return self.heartbeat_seconds
            # scrub Always: the last holder left; provision again now, which zeroes the memory
            # before anything attaches next (region.scrub)
        self.released = False
        self._scrubbed = False
        try:
            # no status before the engine says it builds: a region that is reused, or that an
            # engine holds, must never show "Provisioning" (the memory is not being touched)
            result = provision(
                req,
                self.root,
                progress=self._progress,
                workers=req.workers or None,
                on_phase=lambda phase: self._on_phase(phase, req),
            )
        except LeaseHeld as exc:
            # a newer spec cannot replace a region an engine holds: keep the old one, say why;
            # a scrub owed to new consumers withheld the region (no manifest): Pending, whatever
            # the record says it holds, so the node is not advertised for it
            self.metrics.error("LeaseHeld")
            withheld = isinstance(exc, ScrubPending)
            old = None if withheld else self._local()
            fields: dict[str, Any] = {}
            if old is not None:
                fields = dict(bytes_total=old[1], bytes_populated=old[1], progress=100)
            self._phase(
                "Ready" if old is not None else "Pending",
                reason="ScrubPending" if withheld else "LeaseHeld",
                message=f"generation {req.generation} pending: {exc}",
                pending_generation=req.generation,
                observed_generation=old[0] if old else None,
                engines_attached=self.engines_attached(),
                **fields,
            )
            self._event("Normal", "LeaseHeld", f"generation {req.generation} waits: {exc}")
            return self.retry_seconds
        except CapacityError as exc:
            return self._fail(
                "InsufficientHugePages" if is_hugetlbfs(req.medium) else "InsufficientMemory", str(exc)
            )
        except RegionError as exc:
            return self._fail("ProvisionFailed", str(exc))
        m = result.manifest
        total = int(m.total_bytes)
        self.metrics.provisioned(
            total, int(result.populated_bytes), float(result.seconds), float(result.gib_per_s)
        )
        self.applied = Applied(req, total)
        self._failures = 0
        if result.reused:
            message = f"validated the existing region ({total} bytes); nothing re-populated"
            if self._scrubbed:
                message += "; zeroed first for its new consumers (scrub)"
        else:
            message = (
                f"populated {result.populated_bytes} bytes in {result.seconds:.2f} s "
                f"({result.gib_per_s:.2f} GiB/s)"
            )
            if result.skipped_bytes:
                message += f"; {result.skipped_bytes} bytes were already populated by an interrupted run"
            if result.rebuilt:
                message += "; the previous region was torn down first"
        numa_nodes = sorted({n for region in (m.extra or {}).get("numa_nodes") or [] for n in region})
        self._phase(
            "Ready",
            reason="Reused" if result.reused else ("Resumed" if result.skipped_bytes else "Populated"),
            message=message,
            observed_generation=req.generation,
            pending_generation=None,
            bytes_total=total,
            bytes_populated=total,
            progress=100,
            populate_gib_per_second=round(float(result.gib_per_s), 3)
            if not result.reused
            else self.status.current.populate_gib_per_second,
            huge_page_coverage=float(result.hugepage_coverage_percent),
            numa_nodes=numa_nodes or None,
            engines_attached=self.engines_attached(),
        )
        self._event("Normal", "Ready", self.status.current.message or "region Ready")
        return self.heartbeat_seconds

    def _keep(self, d: Decision) -> float:
        self._beat(
            reason=d.reason,
            message=d.message,
            pending_generation=d.pending_generation,
            observed_generation=self.local_generation(),
        )
        return self.heartbeat_seconds

    def _release(self, d: Decision) -> float:
        if self.released and self.status.phase == "Released":
            self._beat()
            return self.heartbeat_seconds
        try:
            result = release(self.root, self.pool_name)  # idempotent: a pool never built is "released"
        except LeaseHeld as exc:
            self.metrics.error("LeaseHeld")
            n = self.engines_attached()
            self._phase(
                "Draining",
                reason="LeaseHeld",
                message=f"pool deleted but {n} engine(s) still attached; release waits: {exc}",
                engines_attached=n,
            )
            self._event("Warning", "LeaseHeld", f"release waits for {n} attached engine(s)")
            return self.retry_seconds
        except RegionError as exc:
            return self._fail("ReleaseFailed", str(exc))
        for warning in result.warnings:  # names left in place: never removed recursively
            log.warning("release of %s: %s", self.pool_name, warning)
            self._event("Warning", "LeftInPlace", warning[:1024])
        self.released = True
        self.applied = None
        self.metrics.released()
        self._phase(
            "Released",
            reason="Released",
            message="region released, memory returned to the node",
            bytes_populated=0,
            progress=0,
            engines_attached=0,
            pending_generation=None,
        )
        self._event("Normal", "Released", "region released")
        return self.heartbeat_seconds

    def _retain(self, d: Decision) -> float:
        if self.status.phase != "Released":
            # the node's own note, for `offloadpool status` (no API there): nothing owns it now
            try:
                records.mark_orphaned(self.pool_dir, "its OffloadPool was deleted with reclaimPolicy Retain")
            except (OSError, RegionError) as exc:
                log.warning("pool %s: cannot note the retained memory as orphaned: %s", self.pool_name, exc)
            self._phase("Released", reason=d.reason, message=d.message)
            self._event("Normal", "Retained", d.message)
        else:
            self._beat()
        return self.heartbeat_seconds

    # -- reporting helpers -------------------------------------------------------------------
    def _phase(self, phase: str, *, defer: bool = False, **fields: Any) -> None:
        self.metrics.phase(phase)
        self.status.set(phase=phase, defer=defer, **fields)

    def _on_phase(self, phase: str, req: PoolRequest) -> None:
        """The engine's own phase changes (Provisioning, Populating, Scrubbing, Ready) as they happen.

        Provisioning and Populating are transient: recorded now (metrics, readiness), written
        only if they last ``progress_interval`` (StatusWriter ``defer``), so a small pool that
        is Ready sooner costs one status write — one watch event for the operator — not three.
        """
        if phase == "Provisioning":
            self._phase(
                "Provisioning",
                defer=True,
                reason=None,
                message=None,
                pending_generation=None,
                observed_generation=self.local_generation(),
                bytes_total=req.capacity,
                bytes_populated=0,
                progress=0,
            )
        elif phase == "Populating" and self.status.phase != "Populating":
            self._phase("Populating", defer=True)
        elif phase == "Scrubbing":
            # written at once, unlike the two above: rare (consumers changed), and it says the
            # region is withheld from engines until its memory is zero
            self._scrubbed = True
            self._phase(
                "Scrubbing",
                reason="Scrubbing",
                message="zeroing the memory before it is handed out again",
                bytes_total=req.capacity,
                bytes_populated=req.capacity,
                progress=0,
            )

    def _progress(self, done: int, total: int) -> None:
        self.last_tick = time.monotonic()
        self.metrics.progress(done, total)
        if self.status.phase not in ("Populating", "Scrubbing"):
            self.metrics.phase("Populating")
        self.status.progress(done, total)

    def _fail(self, reason: str, message: str) -> float:
        """Report Failed; return the delay before the next try.

        Failures are retried (memory may free up, an admin may fix the node) with a backoff that
        doubles up to a minute, so a node that cannot host the pool costs the API server little.
        """
        log.error("%s: %s", reason, message)
        self.metrics.error(reason)
        self.applied = None
        self._failures += 1
        self._phase("Failed", reason=reason, message=message[:1024])
        self._event("Warning", reason, message)
        return min(self.retry_seconds * 2 ** (self._failures - 1), max(60.0, self.retry_seconds))

    def _event(self, type_: str, reason: str, note: str) -> None:
        """One event per distinct (reason, note): a retry loop must not flood the namespace."""
        if self._pool_node is None or self._last_event == (reason, note):
            return
        self._last_event = (reason, note)
        self.access.event(self._pool_node, "OffloadPoolNode", reason, note, type_)
