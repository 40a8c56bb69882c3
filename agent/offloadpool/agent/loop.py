"""The agent's control loop: observe, decide, act on the node, report; one step at a time.

One thread runs the loop. Each step takes the pool and this node's OffloadPoolNode from the
watch cache (``observation``: two watch threads by name only wake the loop early), creates the
OffloadPoolNode of a new pool (``pool_node_creation``), decides (``reconcile.decide``, pure),
acts on the node and reports it (``actions``), makes the pool's ResourceSlice say what the
node holds now (``slices``), then sends the heartbeat (``heartbeat``) unless a status write just
showed the agent alive. The loop wakes every heartbeat period, so a missed
watch event costs at most one heartbeat, and after a failure every retry period; a refused
create or heartbeat brings the next step sooner (``retry_soon``). A token the API server stops
accepting ends the loop (``credential``). Everything a step needs is composed here once.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException

from offloadpool.agent import kube
from offloadpool.agent.actions import NodeActions
from offloadpool.agent.config import AgentConfig
from offloadpool.agent.credential import Credential
from offloadpool.agent.events import NodeEvents
from offloadpool.agent.heartbeat import Heartbeat
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.node_region import NodeRegion
from offloadpool.agent.observation import REREAD_PERIODS, Observation
from offloadpool.agent.pool_node_creation import PoolNodeCreation
from offloadpool.agent.reconcile import Action, decide
from offloadpool.agent.retry_soon import RetrySoon
from offloadpool.agent.slices import Slices
from offloadpool.agent.status_writer import StatusWriter
from offloadpool.api.constants import NODE_PLURAL, POOL_PLURAL, clip_message, split_node_object_name
from offloadpool.api.conversion import SpecError
from offloadpool.region.vocabulary import READY

log = logging.getLogger(__name__)


class Agent:
    """One pool's agent on one node: the loop thread, and the parts each step composes."""

    def __init__(
        self,
        access: kube.KubeAccess,
        root: Path,
        *,
        metrics: AgentMetrics,
        heartbeat_seconds: float = AgentConfig.heartbeat_seconds,
        retry_seconds: float = AgentConfig.retry_seconds,
        watch_timeout_seconds: int = AgentConfig.watch_timeout_seconds,
        workers: int = 0,
        sized_for: str = "",
        watches: bool = True,
        reread_seconds: float | None = None,
    ) -> None:
        self.access = access
        self.metrics = metrics
        self.heartbeat_seconds = heartbeat_seconds
        self.retry_seconds = retry_seconds
        self.watch_timeout_seconds = watch_timeout_seconds
        self.workers = workers
        self.sized_for = sized_for
        self.watches = watches
        # With watches, a step takes the pool and the OffloadPoolNode from their last events
        # and reads them from the API server only this often (a missed event costs at most
        # this); without, every step reads (polling). The heartbeat is sent regardless.
        reread_seconds = (
            reread_seconds
            if reread_seconds is not None
            else (REREAD_PERIODS * heartbeat_seconds if watches else 0.0)
        )
        self.status = StatusWriter(access.patch_status, kube.now)
        self.wake = threading.Event()
        self.stop = threading.Event()
        #: a step's wish to come again sooner than it would (a refused create or heartbeat)
        self.soon = RetrySoon(retry_seconds)
        self.credential = Credential(heartbeat_seconds, retry_seconds, self.stop)
        self.observation = Observation(
            access=access,
            status=self.status,
            credential=self.credential,
            wake=self.wake,
            reread_seconds=reread_seconds,
            watch_timeout_seconds=watch_timeout_seconds,
        )
        self.creation = PoolNodeCreation(
            access=access, metrics=metrics, observation=self.observation, soon=self.soon
        )
        self.heartbeat = Heartbeat(
            access=access,
            status=self.status,
            metrics=metrics,
            credential=self.credential,
            soon=self.soon,
            heartbeat_seconds=heartbeat_seconds,
        )
        self.region = NodeRegion(root, access.pool)
        self.actions = NodeActions(
            region=self.region,
            status=self.status,
            metrics=metrics,
            events=NodeEvents(access),
            heartbeat_seconds=heartbeat_seconds,
            retry_seconds=retry_seconds,
        )
        self.slices = Slices(
            access,
            self.region,
            split_node_object_name(access.node_object)[1],
            reread_seconds=reread_seconds,
        )
        self.thread: threading.Thread | None = None

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
        return phase == READY, f"phase {phase}"

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
            try:
                delay = self.step()
            except Exception as exc:  # never let one bad step kill the agent; report and retry
                log.exception("agent step failed")
                self.metrics.error("Internal")
                self.status.set(reason="AgentError", message=clip_message(f"{type(exc).__name__}: {exc}"))
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
        actions = self.actions
        actions.pool_node = pool_node
        try:
            decision = decide(pool, pool_node, self.region.generation(), self.workers, self.sized_for)
        except SpecError as exc:
            return actions.fail("InvalidSpec", str(exc))
        act = {
            Action.IDLE: actions.idle,
            Action.WAIT: actions.idle,
            Action.PROVISION: actions.provision_region,
            Action.KEEP: actions.keep,
            Action.AWAIT_AGENT: actions.await_replacement,
            Action.RELEASE: actions.release_region,
            Action.RETAIN: actions.retain,
        }[decision.action]
        try:
            return act(decision)
        finally:
            self.slices.sync(self.status.phase, pool_node if pool is not None else None)
