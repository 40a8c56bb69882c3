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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from offloadpool.agent import kube
from offloadpool.agent.credential import Credential
from offloadpool.agent.heartbeat import Heartbeat
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.observation import REREAD_PERIODS, Observation
from offloadpool.agent.pool_node_creation import PoolNodeCreation
from offloadpool.agent.reconcile import Action, Decision, decide
from offloadpool.agent.retry_soon import RetrySoon
from offloadpool.agent.status_writer import StatusWriter
from offloadpool.api.constants import DEFAULT_HEARTBEAT_SECONDS, NODE_PLURAL, POOL_PLURAL
from offloadpool.api.conversion import SpecError
from offloadpool.api.media import is_hugetlbfs
from offloadpool.region import engine_id_mismatch, holders, places
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.lease import LeaseHeld
from offloadpool.region.provision import provision
from offloadpool.region.release import release
from offloadpool.region.request import PoolRequest
from offloadpool.region.scrub import ScrubPending
from offloadpool.region.status import local_region

log = logging.getLogger(__name__)


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
        reread_seconds = (
            reread_seconds
            if reread_seconds is not None
            else (REREAD_PERIODS * heartbeat_seconds if watches else 0.0)
        )
        self.status = StatusWriter(access.patch_status, kube.now)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.applied: Applied | None = None
        self.released = False
        self.last_tick = time.monotonic()
        self._pool_node: dict[str, Any] | None = None
        #: a step's wish to come again sooner than it would (a refused create or Lease write)
        self.soon = RetrySoon(retry_seconds)
        self._last_event: tuple[str, str] | None = None
        self._failures = 0
        self.credential = Credential(heartbeat_seconds, retry_seconds, self.stop)
        self.observation = Observation(
            access, self.status, self.credential, self.wake, reread_seconds=reread_seconds
        )
        self.creation = PoolNodeCreation(access, metrics, self.observation, self.soon)
        self.heartbeat = Heartbeat(
            access, self.status, metrics, self.credential, self.soon, heartbeat_seconds=heartbeat_seconds
        )
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

    @property
    def credential_rejected(self) -> bool:
        """The loop stopped because the API server no longer accepts the token (``Credential``)."""
        return self.credential.rejected

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
                    target=self.observation.watch,
                    args=(plural, name, self.stop, self.retry_seconds),
                    name=f"watch-{plural}",
                    daemon=True,
                ).start()
        return self

    def notice(self, obj: dict[str, Any], *, deleted: bool = False) -> None:
        """A watch event about our pool or OffloadPoolNode (``Observation.notice``): the real
        agent's own watches deliver them, the scale test's shared watches too."""
        self.observation.notice(obj, deleted=deleted)

    def _observe(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The pool and our OffloadPoolNode, read only when due (``Observation.observe``), not
        our OffloadPoolNode when this step is about to create it."""
        return self.observation.observe(self.creation.may_create)

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
        self.soon.reset()
        return self.soon.bound(self._step())

    def _step(self) -> float:
        try:
            pool, pool_node = self._observe()
        except ApiException as exc:
            self.metrics.error("ApiRead")
            if exc.status == 401:
                return self.credential.refused()
            log.warning("cannot read pool/OffloadPoolNode: %s %s", exc.status, exc.reason)
            return self.retry_seconds
        try:
            return self._act(pool, pool_node)
        finally:  # after the step's own status write, which may make a renewal needless
            if pool is not None:
                self.heartbeat.beat(pool)

    def _act(self, pool: dict[str, Any] | None, pool_node: dict[str, Any] | None) -> float:
        if pool is not None and pool_node is None:
            pool_node = self.creation.create(pool)
        self.creation.saw(pool_node)
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
