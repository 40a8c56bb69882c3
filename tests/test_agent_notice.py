"""An agent's watch event wakes its loop, except the one that is its own last status write.

Every status write comes back as a watch event on the agent's own OffloadPoolNode; a step for
it would read the pool and the object again and find nothing new (two reads per write, a
thousand nodes over). The agent is the real one; no call reaches an API server here (its
client points nowhere), as ``notice`` decides from the event's object alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from fixtures.wait import wait_for
from offloadpool.agent import kube
from offloadpool.agent.loop import Agent
from offloadpool.agent.metrics import AgentMetrics


def agent(tmp_path: Path) -> Agent:
    access = kube.KubeAccess(client.ApiClient(client.Configuration()), "p", "p.n1", "ns")
    return Agent(access, tmp_path, metrics=AgentMetrics("p", "n1", CollectorRegistry()), watches=False)


def event(name: str, rv: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv}}


def test_own_write_wakes_nothing_anything_else_wakes(tmp_path: Path) -> None:
    a = agent(tmp_path)
    a.notice(event("p.n1", "7"))
    assert a.wake.is_set(), "no write of ours yet: every event is news"
    a.wake.clear()
    a.status.written_object = event("p.n1", "41")  # what StatusWriter keeps of its write
    a.notice(event("p.n1", "41"))
    assert not a.wake.is_set(), "our own status write woke the loop"
    for other in (event("p.n1", "42"), event("p", "41")):  # a later change; the pool itself
        a.notice(other)
        assert a.wake.is_set(), other
        a.wake.clear()


def test_a_pool_status_change_wakes_nothing_a_spec_change_or_deletion_does(tmp_path: Path) -> None:
    a = agent(tmp_path)
    pool = {"metadata": {"name": "p", "uid": "u1", "generation": 1, "resourceVersion": "5"}}
    a.notice(pool)
    assert a.wake.is_set(), "the first sight of the pool is news"
    a.wake.clear()
    a.notice({**pool, "metadata": {**pool["metadata"], "resourceVersion": "6"}, "status": {"readyNodes": 3}})
    assert not a.wake.is_set(), "the operator's status write woke every agent"
    assert a.observation.seen["p"]["status"] == {"readyNodes": 3}, "the newer pool is kept all the same"
    changes = (
        ({**pool, "metadata": {**pool["metadata"], "generation": 2}}, False),
        ({**pool, "metadata": {**pool["metadata"], "deletionTimestamp": "2026-12-01T00:00:00Z"}}, False),
        (pool, True),
    )
    for obj, deleted in changes:
        a.notice(obj, deleted=deleted)
        assert a.wake.is_set(), obj
        a.wake.clear()
    assert a.observation.seen["p"] is None, "a deleted pool is remembered as absent"


def test_a_step_reads_only_what_no_event_brought_and_not_what_it_will_create(tmp_path: Path) -> None:
    """A pool delivered by its watch is not read again; nor is a never-seen OffloadPoolNode the
    step is about to create (its create is the read). Every read here would fail: the client
    points at no API server (it says "No host specified" when asked for anything)."""
    access = kube.KubeAccess(client.ApiClient(client.Configuration()), "p", "p.n1", "ns")
    a = Agent(access, tmp_path, metrics=AgentMetrics("p", "n1", CollectorRegistry()), reread_seconds=60)
    pool = {"metadata": {"name": "p", "uid": "u1", "generation": 1, "resourceVersion": "5"}}
    a.notice(pool)
    assert a._observe() == (pool, None)
    a.notice({**pool, "metadata": {**pool["metadata"], "deletionTimestamp": "2026-12-01T00:00:00Z"}})
    with pytest.raises(Exception, match="No host specified"):
        a._observe()  # a deleted pool's agent creates nothing: it must read the object


def test_an_object_read_absent_long_ago_is_not_read_again_before_its_create(tmp_path: Path) -> None:
    """An agent started before its pool read its OffloadPoolNode absent; when the pool comes
    (long after: the read is stale), the step creates the object without reading it again."""
    access = kube.KubeAccess(client.ApiClient(client.Configuration()), "p", "p.n1", "ns")
    a = Agent(access, tmp_path, metrics=AgentMetrics("p", "n1", CollectorRegistry()), reread_seconds=60)
    a.observation.seen["p.n1"] = None  # what the read at start found
    a.observation.fresh["p.n1"] = float("-inf")  # ... so long ago that a read is due
    pool = {"metadata": {"name": "p", "uid": "u1", "generation": 1, "resourceVersion": "5"}}
    a.notice(pool)
    assert a._observe() == (pool, None)
    a.creation.seen = True  # seen once and gone since (the operator removed it): not ours to make
    with pytest.raises(Exception, match="No host specified"):
        a._observe()


def test_a_stopped_agent_leaves_no_status_thread_behind(tmp_path: Path) -> None:
    """The status writer's flusher thread ends with the agent's loop: a flusher waiting for work
    for ever would leave one idle thread per stopped agent (the scale test stops thousands in
    one process). Here the refused write (the client points nowhere) is what starts the flusher:
    it is to retry it."""
    a = agent(tmp_path).start()
    wait_for("the status writer's flusher started", lambda: a.status._flusher is not None, timeout=60)
    flusher = a.status._flusher
    assert flusher is not None and flusher.is_alive()
    a.stop.set()
    a.wake.set()
    assert a.thread is not None
    a.thread.join(timeout=60)
    assert not a.thread.is_alive()
    flusher.join(timeout=10)
    assert not flusher.is_alive(), "the stopped agent's status flusher thread still runs"
