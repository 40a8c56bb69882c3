"""What the agent knows of its two objects: the pool and its node's OffloadPoolNode.

Two watches (each by name, never anything cluster-wide) deliver both objects and wake the loop;
a step takes them from here and reads one from the API server only when neither a read nor an
event brought it for ``reread_seconds`` (or it was never seen), so a lost watch event costs at
most that and a steady node reads nothing between. Two kinds of event wake nothing: the agent's
own last status write coming back (a step for it would find nothing new: at a thousand nodes,
two reads per write for nothing), and a change of the pool's status alone (the operator writes
it at every pass; the agent acts on the pool's uid, generation and deletion only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes import watch

from offloadpool.agent import kube
from offloadpool.agent.credential import Credential
from offloadpool.agent.status_writer import StatusWriter
from offloadpool.api.base import resource_revision
from offloadpool.api.constants import GROUP, VERSION

log = logging.getLogger(__name__)

#: With watches, how many heartbeat periods a step may go on the watched objects without a read.
REREAD_PERIODS = 6

Obj = dict[str, Any]


def _acted_on(pool: Obj) -> tuple[Any, ...]:
    """What of a pool an agent acts on: its identity, spec (generation) and deletion."""
    meta = pool.get("metadata") or {}
    return meta.get("uid"), meta.get("generation"), meta.get("deletionTimestamp")


@dataclass(kw_only=True)
class Observation:
    """The pool and our OffloadPoolNode as last read or delivered by a watch (None: absent).

    Fed by the watch threads (``notice``) and by the loop's reads (``observe``), so every
    access to what was seen holds one lock; a read that raced an event never replaces it.
    """

    access: kube.KubeAccess
    #: our own status writes: their events are not news, and a write is newer than a read
    status: StatusWriter
    #: told of every read that went through
    credential: Credential
    #: set to wake the loop
    wake: threading.Event
    #: how long a step may go on an object without a read (0: read at every step)
    reread_seconds: float
    #: how long one watch request may last before it is made again (``AgentConfig``)
    watch_timeout_seconds: int
    #: the objects by name (None: absent)
    seen: dict[str, Obj | None] = field(default_factory=dict, init=False)
    #: when a read or a watch event last brought each object (monotonic)
    fresh: dict[str, float] = field(default_factory=dict, init=False)
    #: events noticed per object name: a read that raced an event must not replace it
    _noticed: dict[str, int] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def watch(self, plural: str, name: str, stop: threading.Event, retry_seconds: float) -> None:
        """Notice every change of one named object until ``stop``. Errors: back off and re-watch."""
        while not stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    self.access.custom.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    plural,
                    field_selector=f"metadata.name={name}",
                    timeout_seconds=self.watch_timeout_seconds,
                ):
                    self.notice(event["object"], deleted=event["type"] == "DELETED")
                    if stop.is_set():
                        break
            except Exception as exc:  # API restarts, expired resourceVersion, RBAC: re-list later
                log.debug("watch %s/%s ended: %s", plural, name, exc)
                stop.wait(retry_seconds)
            finally:
                w.stop()

    def notice(self, obj: Obj, *, deleted: bool = False) -> None:
        """A watch event about our pool or OffloadPoolNode: keep the object for the next step
        and wake the loop — unless the event is our own last status write coming back, or only
        the pool's status changed."""
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
        with self._lock:
            before = self.seen.get(name)
            self.seen[name] = None if deleted else obj
            self._noticed[name] = self._noticed.get(name, 0) + 1
            self.fresh[name] = time.monotonic()
        if (
            name == self.access.pool
            and before is not None
            and not deleted
            and _acted_on(before) == _acted_on(obj)
        ):
            return  # the pool's status (the operator's passes write it often): nothing to do here
        self.wake.set()

    def observe(self, will_create: Callable[[Obj | None], bool]) -> tuple[Obj | None, Obj | None]:
        """The pool and our OffloadPoolNode: as their watches last delivered them, or read.

        Each is read when never seen, or when neither a read nor a watch event brought it for
        ``reread_seconds``. A read is what ``notice`` keeps too, so a late event of an older
        version is the only way to go back in time, and the next event or read corrects it. Our
        OffloadPoolNode is not read when it was never seen, or last seen absent, and
        ``will_create(pool)`` says the step creates it: a new pool's agent makes one request
        instead of a read that finds nothing and then the create; the create's 409 reads it.
        """
        pool_name, node_name = self.access.pool, self.access.node_object
        if self._due(pool_name):
            self._read(pool_name, self.access.get_pool)
        pool = self.seen.get(pool_name)
        if self._due(node_name) and not (self.seen.get(node_name) is None and will_create(pool)):
            self._read(node_name, self.access.get_pool_node)
        pool_node, written = self.seen.get(node_name), self.status.written_object
        if (
            pool_node is not None
            and written is not None
            and resource_revision(written.get("metadata") or {})
            > resource_revision(pool_node.get("metadata") or {})
        ):
            pool_node = written  # our own later write: its event is not kept (or not here yet)
        return pool, pool_node

    def created(self, pool_node: Obj | None) -> None:
        """Our OffloadPoolNode as its create answered: seen now."""
        with self._lock:
            self.seen[self.access.node_object] = pool_node
            self.fresh[self.access.node_object] = time.monotonic()

    def _due(self, name: str) -> bool:
        with self._lock:
            fresh = self.fresh.get(name, float("-inf"))
            return name not in self.seen or time.monotonic() - fresh >= self.reread_seconds

    def _read(self, name: str, get: Callable[[], Obj | None]) -> None:
        with self._lock:
            noticed = self._noticed.get(name)
        read_at = time.monotonic()
        obj = get()
        self.credential.accepted()
        with self._lock:
            if self._noticed.get(name) == noticed:  # no event during the read
                self.seen[name] = obj
            self.fresh[name] = max(self.fresh.get(name, float("-inf")), read_at)
