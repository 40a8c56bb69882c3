"""What the agent does on the node for a decision, and what it reports of it.

``offloadpool.agent.reconcile.decide`` says what to do (pure); this does it through the node
engine (provision, keep, release, retain) and reports it: the status fields as
``offloadpool.api.node.OffloadPoolNodeStatus`` names them, written through the throttled status
writer, the phase metric, and Events. Provisioning runs in the loop's thread; its progress
callback (from populate workers) goes straight to the status writer, which writes the transient
phases (Provisioning, Populating) only when they outlast its progress interval. Each action
returns the seconds until the next step: a heartbeat period when the node holds what it should,
the retry period while waiting, a doubling backoff after a failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from offloadpool.agent.events import NodeEvents
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.node_region import NodeRegion
from offloadpool.agent.reconcile import Decision
from offloadpool.agent.status_writer import StatusWriter
from offloadpool.api.constants import clip_message
from offloadpool.api.media import is_hugetlbfs
from offloadpool.api.node import NodeShare
from offloadpool.region.errors import CapacityError, RegionError
from offloadpool.region.files import record as records
from offloadpool.region.holding import shares
from offloadpool.region.holding.lease import LeaseHeld
from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.lifecycle.scrub import ScrubPending
from offloadpool.region.request import PoolRequest
from offloadpool.region.vocabulary import (
    DRAINING,
    FAILED,
    PENDING,
    POPULATING,
    PROVISIONING,
    READY,
    RELEASED,
    SCRUB_ALWAYS,
    SCRUBBING,
)

log = logging.getLogger(__name__)


@dataclass
class Applied:
    """What this process last made true on the node (so a heartbeat does not re-provision)."""

    request: PoolRequest
    total_bytes: int


@dataclass(kw_only=True)
class NodeActions:
    """The node's side of each decision, and its report; keeps what this process applied."""

    region: NodeRegion
    status: StatusWriter
    metrics: AgentMetrics
    events: NodeEvents
    heartbeat_seconds: float
    retry_seconds: float
    applied: Applied | None = field(default=None, init=False)
    #: this process released the region (so a heartbeat does not release it again)
    released: bool = field(default=False, init=False)
    #: our OffloadPoolNode as this step found it (None: none yet): what it shows, and what
    #: Events are about
    pool_node: dict[str, Any] | None = field(default=None, init=False)
    #: failures in a row (the backoff of ``fail``)
    _failures: int = field(default=0, init=False)
    #: engines attached at the last heartbeat (scrub Always: provision again when they left)
    _attached: int = field(default=0, init=False)
    #: the provision in progress zeroed the memory (said Scrubbing)
    _scrubbed: bool = field(default=False, init=False)

    def idle(self, d: Decision) -> float:
        """Nothing to act on (no OffloadPoolNode yet, or the pool is gone): look again after the
        retry period."""
        log.debug("%s: %s", d.reason, d.message)
        return self.retry_seconds

    def _refresh(self, **fields: Any) -> None:
        """The report of a step that changed nothing on the node: engines attached, an engine-id
        mismatch, and ``fields``; written only where they changed (``StatusWriter.set``)."""
        n = self.region.engines_attached()
        self._attached = n
        self.metrics.engines(n)
        # the object as read this step lost what we wrote (re-created by the operator, edited
        # by hand): write all of it again, not just what changed
        seen = (self.pool_node or {}).get("status") or {}
        mismatch = self.region.engine_id_mismatch(
            self.applied.request.compat_engine_id if self.applied else None
        )
        if mismatch is not None or self._mismatch_shown(seen):
            fields["engine_id_mismatch"] = mismatch  # set it, or clear what is shown
        fields.update(self._share_fields(seen))
        self.status.set(full=seen.get("phase") != self.status.phase, engines_attached=n, **fields)
        if mismatch is not None:
            self._event("Warning", "EngineIdMismatch", mismatch)

    def _share_fields(self, seen: dict[str, Any]) -> dict[str, Any]:
        """A partitioned pool's shares (each claimed or free, by whom) and "claimed/total"; for
        a pool without shares, nulls only where the object (or this process) shows some."""
        partitions = self.applied.request.partitions if self.applied else 1
        found = self.region.shares(partitions)
        if found is not None:
            crossed = [why for state in found if (why := state.crossed()) is not None]
            if crossed:  # one note for all, posted once while it stays so (NodeEvents)
                self._event("Warning", "ShareSharedAcrossPods", clip_message("; ".join(crossed)))
            return {"shares": [NodeShare.of(s) for s in found], "shares_claimed": shares.claimed_of(found)}
        if seen.get("sharesClaimed") is not None or self.status.current.shares_claimed is not None:
            return {"shares": None, "shares_claimed": None}
        return {}

    def _mismatch_shown(self, seen: dict[str, Any]) -> bool:
        """Whether the object (as read this step, or as this process wrote it) shows a mismatch.

        Only then is a None worth sending: a null for a field that was never there would be a
        status write on every pool's first heartbeat, for nothing (liveness writes no status).
        An agent restarted while a mismatch was shown still clears it: the read shows it.
        """
        return seen.get("engineIdMismatch") is not None or self.status.current.engine_id_mismatch is not None

    def provision_region(self, d: Decision) -> float:
        """Make the region the decision's request asks for (the engine reuses one that is
        there), unless this process made it already and it is Ready: then only report."""
        req = d.request
        assert req is not None
        changed = None
        if self.applied and self.applied.request == req and self.status.phase == READY and self.status.exists:
            # what a pod may have changed of what the pool hands out (a compat name replaced by
            # a link, a segment replaced): checked at every heartbeat, repaired by provisioning
            # again (vLLM's names relinked in place; touched segments rebuild or fail the pool)
            changed = self.region.handed_out_problem(req)
            if changed is None:
                attached = self._attached
                self._refresh()
                if req.scrub != SCRUB_ALWAYS or not attached or self._attached:
                    return self.heartbeat_seconds
                # scrub Always: the last holder left; provision again now, which zeroes the
                # memory before anything attaches next (region.lifecycle.scrub)
            else:
                log.warning("pool entries changed on the node: %s; provisioning again to repair", changed)
                self.events.post(
                    self.pool_node, "Warning", "EntryChanged", clip_message(f"{changed}: repairing")
                )
        self.released = False
        self._scrubbed = False
        try:
            # no status before the engine says it builds: a region that is reused, or that an
            # engine holds, must never show Provisioning (the memory is not being touched)
            result = provision(
                req,
                self.region.root,
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
            old = None if withheld else self.region.local()
            fields: dict[str, Any] = {}
            if old is not None:
                fields = dict(bytes_total=old[1], bytes_populated=old[1], progress=100)
            self._phase(
                READY if old is not None else PENDING,
                reason="ScrubPending" if withheld else "LeaseHeld",
                message=f"generation {req.generation} pending: {exc}",
                pending_generation=req.generation,
                observed_generation=old[0] if old else None,
                engines_attached=self.region.engines_attached(),
                **fields,
            )
            self.events.post(
                self.pool_node, "Normal", "LeaseHeld", f"generation {req.generation} waits: {exc}"
            )
            return self.retry_seconds
        except CapacityError as exc:
            return self.fail(
                "InsufficientHugePages" if is_hugetlbfs(req.medium) else "InsufficientMemory", str(exc)
            )
        except RegionError as exc:
            return self.fail("ProvisionFailed", str(exc))
        m = result.manifest
        total = int(m.total_bytes)
        self.metrics.provisioned(
            total, int(result.populated_bytes), float(result.seconds), float(result.gib_per_s)
        )
        self.applied = Applied(req, total)
        self._failures = 0
        if result.reused:
            message = f"validated the existing region ({total} bytes); nothing re-populated"
            if changed is not None:
                message += f"; repaired what a pod changed ({changed})"
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
        # a reused region was not populated now: its rate is the one measured when it was made,
        # kept in the node's record (a restarted agent has no other memory of it)
        rate = round(float(result.gib_per_s), 3) if not result.reused else None
        if result.reused:
            recorded = self.region.populate_rate()
            rate = round(recorded, 3) if recorded else self.status.current.populate_gib_per_second
        placement = (m.extra or {}).get("numa_nodes") or []  # per region, as the node recorded it
        numa_nodes = sorted({n for region in placement for n in region})
        self._phase(
            READY,
            reason="Reused" if result.reused else ("Resumed" if result.skipped_bytes else "Populated"),
            message=message,
            observed_generation=req.generation,
            pending_generation=None,
            bytes_total=total,
            bytes_populated=total,
            progress=100,
            populate_gib_per_second=rate,
            huge_page_coverage=float(result.hugepage_coverage_percent),
            numa_nodes=numa_nodes or None,
            numa_placement=placement if numa_nodes else None,
            engines_attached=self.region.engines_attached(),
            **self._share_fields((self.pool_node or {}).get("status") or {}),
        )
        self._event("Normal", READY, self.status.current.message or "region Ready")
        return self.heartbeat_seconds

    def keep(self, d: Decision) -> float:
        """Leave the region as it is (a newer generation waits for the operator's rollout) and
        say why."""
        self._refresh(
            reason=d.reason,
            message=d.message,
            pending_generation=d.pending_generation,
            observed_generation=self.region.generation(),
        )
        return self.heartbeat_seconds

    def await_replacement(self, d: Decision) -> float:
        """The pool asks for another medium or capacity than this agent's pod was made for:
        apply nothing under limits that are not the request's. A holder makes it LeaseHeld (the
        rollout skips the node, the operator never restarts an agent under an engine); else the
        operator replaces this pod and its successor applies the change. The region there stays
        as it is, Ready and advertised; nothing there yet is Pending."""
        req = d.request
        assert req is not None
        held = self.region.held()
        old = self.region.local()
        fields: dict[str, Any] = {}
        if old is not None:
            fields = dict(bytes_total=old[1], bytes_populated=old[1], progress=100)
        if held is not None:
            reason, message = "LeaseHeld", f"generation {req.generation} pending: {held}"
        else:
            reason, message = d.reason, d.message
        self._phase(
            READY if old is not None else PENDING,
            reason=reason,
            message=message,
            pending_generation=req.generation,
            observed_generation=old[0] if old else None,
            engines_attached=self.region.engines_attached(),
            **fields,
        )
        if held is not None:
            self.metrics.error("LeaseHeld")
            self.events.post(
                self.pool_node, "Normal", "LeaseHeld", f"generation {req.generation} waits: {held}"
            )
        return self.retry_seconds

    def release_region(self, d: Decision) -> float:
        """Give the memory back (the pool deleted, reclaimPolicy Delete), unless an engine
        still holds it: then Draining, and try again after the retry period."""
        if self.released and self.status.phase == RELEASED:
            self._refresh()
            return self.heartbeat_seconds
        self._mark_deleting()
        try:
            result = release(
                self.region.root, self.region.pool_name
            )  # idempotent: a pool never built is "released"
        except LeaseHeld as exc:
            self.metrics.error("LeaseHeld")
            n = self.region.engines_attached()
            self._phase(
                DRAINING,
                reason="LeaseHeld",
                message=f"pool deleted but {n} engine(s) still attached; release waits: {exc}",
                engines_attached=n,
            )
            self.events.post(
                self.pool_node, "Warning", "LeaseHeld", f"release waits for {n} attached engine(s)"
            )
            return self.retry_seconds
        except RegionError as exc:
            return self.fail("ReleaseFailed", str(exc))
        for warning in result.warnings:  # names left in place: never removed recursively
            log.warning("release of %s: %s", self.region.pool_name, warning)
            self._event("Warning", "LeftInPlace", clip_message(warning))
        self.released = True
        self.applied = None
        self.metrics.released()
        self._phase(
            RELEASED,
            reason=RELEASED,
            message="region released, memory returned to the node",
            bytes_populated=0,
            progress=0,
            engines_attached=0,
            pending_generation=None,
            **self._share_fields((self.pool_node or {}).get("status") or {}),
        )
        self._event("Normal", RELEASED, "region released")
        return self.heartbeat_seconds

    def _mark_deleting(self) -> None:
        """The node's note that the pool is being deleted, before its release is tried: the CSI
        and DRA plugins (no API credentials) then give no new volume or claim of it, so no new
        holder keeps the deletion waiting (``records.mark_deleting``)."""
        try:
            records.mark_deleting(self.region.pool_dir, records.DELETING_NOTE)
        except (OSError, RegionError) as exc:
            log.warning("pool %s: cannot note its deletion for the plugins: %s", self.region.pool_name, exc)

    def retain(self, d: Decision) -> float:
        """The pool deleted, reclaimPolicy Retain: report Released, leave the memory."""
        if self.status.phase != RELEASED:
            # the node's own note, for `offloadpool status` (no API there): nothing owns it now
            try:
                records.mark_orphaned(
                    self.region.pool_dir, "its OffloadPool was deleted with reclaimPolicy Retain"
                )
            except (OSError, RegionError) as exc:
                log.warning(
                    "pool %s: cannot note the retained memory as orphaned: %s", self.region.pool_name, exc
                )
            self._phase(RELEASED, reason=d.reason, message=d.message)
            self._event("Normal", "Retained", d.message)
        else:
            self._refresh()
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
        if phase == PROVISIONING:
            self._phase(
                PROVISIONING,
                defer=True,
                reason=None,
                message=None,
                pending_generation=None,
                observed_generation=self.region.generation(),
                bytes_total=req.capacity,
                bytes_populated=0,
                progress=0,
            )
        elif phase == POPULATING and self.status.phase != POPULATING:
            self._phase(POPULATING, defer=True)
        elif phase == SCRUBBING:
            # written at once, unlike the two above: rare (consumers changed), and it says the
            # region is withheld from engines until its memory is zero
            self._scrubbed = True
            self._phase(
                SCRUBBING,
                reason=SCRUBBING,
                message="zeroing the memory before it is handed out again",
                bytes_total=req.capacity,
                bytes_populated=req.capacity,
                progress=0,
            )

    def _progress(self, done: int, total: int) -> None:
        self.metrics.progress(done, total)
        if self.status.phase not in (POPULATING, SCRUBBING):
            self.metrics.phase(POPULATING)
        self.status.progress(done, total)

    def fail(self, reason: str, message: str) -> float:
        """Report Failed; return the delay before the next try.

        Failures are retried (memory may free up, an admin may fix the node) with a backoff that
        doubles up to a minute, so a node that cannot host the pool costs the API server little.
        """
        log.error("%s: %s", reason, message)
        self.metrics.error(reason)
        self.applied = None
        self._failures += 1
        self._phase(FAILED, reason=reason, message=clip_message(message))
        self._event("Warning", reason, message)
        return min(self.retry_seconds * 2 ** (self._failures - 1), max(60.0, self.retry_seconds))

    def _event(self, type_: str, reason: str, note: str) -> None:
        """An Event about our OffloadPoolNode as this step found it (``NodeEvents``)."""
        self.events.post(self.pool_node, type_, reason, note)
