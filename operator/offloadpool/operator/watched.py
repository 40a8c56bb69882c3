"""A list + watch of one Kubernetes kind, kept in memory as plain values: the operator's
view of Nodes and OffloadPoolNodes.

Why not kopf handlers for these two kinds: a pool over N nodes makes about five watch events
per node while it converges (the OffloadPoolNode created, its agent's status changes, the
Node's marks). kopf turns every event into a cause, an index update and a handler call — about
2 CPU-ms each, which would be most of the operator's cost at scale. Here an event is one JSON parse
and one small value (``convert``) compared with the one it replaces, in a thread of its own;
only a change that matters calls ``on_change`` (which wakes a pool's pass), and the passes read
the index instead of listing every OffloadPoolNode of the pool again.

The index is what the API server said, plus what the operator itself just wrote
(``apply``, with the write's answer): a pass that created or advanced an OffloadPoolNode, or
marked a Node, must see that on its next pass even before the watch event arrives, or the
rollout could advance a second node while the first is still in flight. resourceVersions are
compared (numerically, as etcd revisions) so neither a late event nor a late answer ever puts
an older object back.

Like kopf's index, the first pass waits for the first full list (``synced``), so a restarted
operator never mistakes "not listed yet" for "gone". A watch that ends or fails (the API
server restarting, a 410 Gone) is resumed, or the kind listed again; values that disappeared
in between are reported as deletions.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from offloadpool.api.base import resource_revision

from .config import OperatorConfig

log = logging.getLogger(__name__)

V = TypeVar("V")
#: (group, key) of an object, e.g. (pool, node) for an OffloadPoolNode; None: not indexed.
KeyOf = Callable[[Mapping[str, Any]], "tuple[str, str] | None"]
#: (key, value before, value after) for a change; None before: added, None after: deleted.
OnChange = Callable[[str, str, "V | None", "V | None"], None]

GONE = 410
TOO_MANY_REQUESTS = 429


class WatchedKind(Generic[V]):
    """{group: {key: value}} of one kind, fed by a list + watch in a daemon thread."""

    def __init__(
        self,
        kind: str,
        list_call: Callable[..., Any],
        convert: Callable[[Mapping[str, Any]], V],
        key_of: KeyOf,
        on_change: OnChange[V] | None = None,
        retry_seconds: float = 1.0,
        timeout_seconds: int = OperatorConfig.watch_timeout_seconds,
    ) -> None:
        self.kind = kind
        self._list_call = list_call
        self._convert = convert
        self._key_of = key_of
        self._on_change = on_change
        self._retry_seconds = retry_seconds
        self._timeout_seconds = timeout_seconds
        self._lock = threading.Lock()
        self._groups: dict[str, dict[str, V]] = {}
        #: object name -> (group, key, revision) of what the index holds for it
        self._names: dict[str, tuple[str, str, int]] = {}
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading -------------------------------------------------------------------------
    def group(self, group: str) -> dict[str, V]:
        """A copy of one group's values (the watch thread changes the index under us)."""
        with self._lock:
            return dict(self._groups.get(group, {}))

    def values(self) -> list[V]:
        with self._lock:
            return [v for members in self._groups.values() for v in members.values()]

    # -- writing ---------------------------------------------------------------------------
    def apply(self, body: Mapping[str, Any] | None) -> None:
        """Take in an object the operator just wrote (the write's answer), unless the index
        already holds a newer version of it. Wakes nothing: the pass that wrote it knows."""
        if body:
            self._upsert(body, notify=False)

    def discard(self, name: str) -> None:
        """Forget an object the operator just deleted (its DELETED event may come later)."""
        with self._lock:
            entry = self._names.pop(name, None)
            if entry is not None:
                self._groups.get(entry[0], {}).pop(entry[1], None)

    def _upsert(self, body: Mapping[str, Any], notify: bool = True) -> None:
        meta = body.get("metadata") or {}
        name, revision = meta.get("name"), resource_revision(meta)
        where = self._key_of(body)
        if not name or where is None:
            return
        if self._holds(name, revision):
            return  # before converting: the event of the operator's own write, already applied
        value = self._convert(body)
        with self._lock:
            if self._holds(name, revision):
                return  # an older version (a late event or answer): keep the newer one
            held = self._names.get(name)
            if held is not None and held[:2] != where:
                self._groups.get(held[0], {}).pop(held[1], None)
            members = self._groups.setdefault(where[0], {})
            before = members.get(where[1])
            if before is not None and before == value:
                value = before  # the same value: keep the object the passes' memories know
            members[where[1]] = value
            self._names[name] = (*where, revision)
        if notify and self._on_change is not None and before != value:
            self._on_change(where[0], where[1], before, value)

    def _holds(self, name: str, revision: int) -> bool:
        """The index holds ``name`` at ``revision`` or newer (an unknown revision: never)."""
        held = self._names.get(name)
        return held is not None and bool(revision) and held[2] >= revision

    def _delete(self, body: Mapping[str, Any]) -> None:
        name = (body.get("metadata") or {}).get("name")
        with self._lock:
            entry = self._names.pop(name, None) if name else None
            before = self._groups.get(entry[0], {}).pop(entry[1], None) if entry else None
        if entry is not None and self._on_change is not None and before is not None:
            self._on_change(entry[0], entry[1], before, None)

    # -- the watch -------------------------------------------------------------------------
    def start(self) -> WatchedKind[V]:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        revision = ""
        while not self._stop.is_set():
            try:
                if not revision:
                    revision = self._relist()
                revision = self._watch(revision)
            except ApiException as exc:
                if exc.status == GONE:
                    revision = ""  # too old to resume: list again
                    continue
                # 429: a CRD's storage still initializing (just made), or the API server's
                # fairness: a moment's wait, not a fault
                level = logging.INFO if exc.status == TOO_MANY_REQUESTS else logging.WARNING
                log.log(level, "watch of %s failed (%s); retrying", self.kind, exc.reason or exc.status)
                self._stop.wait(self._retry_seconds)
            except Exception as exc:  # the API server restarting, a broken connection
                log.warning("watch of %s failed (%s); retrying", self.kind, exc)
                self._stop.wait(self._retry_seconds)

    def _relist(self) -> str:
        resp = self._list_call(_preload_content=False)
        try:
            found = json.loads(resp.data)
        finally:
            resp.release_conn()
        items = found.get("items") or []
        with self._lock:
            gone = set(self._names)
        for item in items:
            gone.discard((item.get("metadata") or {}).get("name"))
            self._upsert(item)
        for name in gone:  # deleted while no watch was running
            self._delete({"metadata": {"name": name}})
        self.synced.set()
        return str((found.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, revision: str) -> str:
        """Follow the watch from ``revision``; return the revision to resume from."""
        resp = self._list_call(
            watch=True,
            resource_version=revision,
            allow_watch_bookmarks=True,
            timeout_seconds=self._timeout_seconds,
            _preload_content=False,
        )
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                kind, body = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=body.get("code"), reason=body.get("message"))
                revision = str((body.get("metadata") or {}).get("resourceVersion") or revision)
                if kind in ("ADDED", "MODIFIED"):
                    self._upsert(body)
                elif kind == "DELETED":
                    self._delete(body)
        finally:
            resp.close()
            resp.release_conn()
        return revision
