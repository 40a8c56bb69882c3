"""A pass decides again only for the Nodes that changed: which nodes the pool selects
(``selection.Selection``) and whether a Node's marks are right (``Reconciler._sync_node_marks``)
are remembered per ``SelectableNode``, which the index replaces whenever a Node changes.

What must hold: the answers are always those of deciding afresh (a property over random
histories of Nodes and pool specs), a Node that changed — its labels edited by hand, its pool
mark removed — is decided again at once, and a pass over an unchanged pool decides nothing.
The pass tests run the reconciler in this process against the real API server, with the
operator's own watched indexes; what is added is a count of the decisions (the real functions
still run).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fixtures.reconciler_world import create_pool_over, remove_pool_over, report_ready, start_indexes
from fixtures.wait import wait_for
from offloadpool.api.constants import pool_label_key
from offloadpool.operator import nodes as node_marks
from offloadpool.operator import selection
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.kube import Kube
from offloadpool.operator.reconcile import Reconciler
from offloadpool.operator.runtime import Runtime
from offloadpool.operator.selection import SelectableNode, Selection, selected_nodes

NAMES = [f"n{i}" for i in range(6)]
LABELS = st.dictionaries(st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"]), max_size=2)
TAINTS = st.lists(
    st.fixed_dictionaries({"key": st.sampled_from(["gpu", "spot"]), "effect": st.just("NoSchedule")}),
    max_size=1,
)
NODE = st.builds(
    lambda name, labels, taints: SelectableNode(name=name, labels=labels, taints=tuple(taints)),
    st.sampled_from(NAMES),
    LABELS,
    TAINTS,
)
SPEC = st.fixed_dictionaries(
    {},
    optional={
        "nodeSelector": st.dictionaries(
            st.sampled_from(["gpu", "zone"]), st.sampled_from(["a", "b"]), max_size=1
        ),
        "tolerations": st.lists(
            st.fixed_dictionaries({"key": st.just("gpu"), "operator": st.just("Exists")}), max_size=1
        ),
    },
)
#: one step of a cluster's history: a Node made or changed, a Node deleted, or the pool's spec
STEP = st.one_of(
    st.tuples(st.just("node"), NODE),
    st.tuples(st.just("delete"), st.sampled_from(NAMES)),
    st.tuples(st.just("spec"), SPEC),
)


@given(first=SPEC, steps=st.lists(STEP, max_size=25))
def test_a_remembered_selection_is_always_the_one_decided_afresh(
    first: dict[str, Any], steps: list[Any]
) -> None:
    memory, spec, current = Selection(), first, {}
    for kind, what in steps:
        if kind == "node":
            current[what.name] = what
        elif kind == "delete":
            current.pop(what, None)
        else:
            spec = what
        assert memory.selected(spec, list(current.values())) == selected_nodes(spec, list(current.values()))
        assert len(memory._answers) <= len(current), "a deleted Node is still remembered"


def counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[str]:
    """Note the node of every call of ``module.name`` (which still runs)."""
    real: Callable[..., Any] = getattr(module, name)
    calls: list[str] = []

    def counting(*args: Any) -> Any:
        calls.append(next(a.name for a in args if isinstance(a, SelectableNode)))
        return real(*args)

    monkeypatch.setattr(module, name, counting)
    return calls


def test_the_same_node_is_decided_once_and_a_changed_one_again() -> None:
    memory, spec = Selection(), {"nodeSelector": {"gpu": "a"}}
    gpu, cpu = SelectableNode("n1", {"gpu": "a"}), SelectableNode("n2", {"gpu": "b"})
    assert memory.selected(spec, [gpu, cpu]) == ["n1"]
    relabelled = replace(cpu, labels={"gpu": "a"})
    with pytest.MonkeyPatch.context() as mp:
        decided = counted(mp, selection, "selects")
        assert memory.selected(spec, [gpu, cpu]) == ["n1"] and decided == []
        assert memory.selected(spec, [gpu, relabelled]) == ["n1", "n2"] and decided == ["n2"]
        assert memory.selected({"nodeSelector": {"gpu": "b"}}, [gpu, relabelled]) == []
        assert sorted(decided) == ["n1", "n2", "n2"], "a new selection decides every node again"


@pytest.fixture
def world(crds_installed: Any) -> Iterator[tuple[Kube, Reconciler, str, list[str]]]:
    """A pool over six Nodes of this test, each with a Ready OffloadPoolNode, and a reconciler."""
    api = crds_installed.api_client()
    kube = Kube(api)
    tag = uuid.uuid4().hex[:6]
    pool, names = f"memory-{tag}", [f"memory-{tag}-{n}" for n in NAMES]
    index, objects = start_indexes(kube)
    config = OperatorConfig(namespace="default", heartbeat_timeout_seconds=0, node_object_grace_seconds=0)
    reconciler = Reconciler(kube, config, lambda _pool, _event: None, index, objects)
    try:
        body = create_pool_over(kube, pool, names, "memory", tag)
        report_ready(kube.custom, body, names)
        wait_for(
            "the Nodes and OffloadPoolNodes indexed Ready",
            lambda: (
                sum(v.phase == "Ready" for v in objects.group(pool).values()) == len(names)
                and sum(n.name in names for n in index.values()) == len(names)
            ),
        )
        yield kube, reconciler, pool, names
    finally:
        index.stop()
        objects.stop()
        remove_pool_over(kube, pool, names)
        api.close()


@pytest.mark.controlplane
def test_a_pass_decides_again_only_for_the_nodes_that_changed(
    world: tuple[Kube, Reconciler, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, reconciler, pool, names = world
    first = reconciler.run(pool)
    assert first is not None and sorted(w for w in first.writes if w.startswith("marked")) == sorted(
        f"marked node {n}" for n in names
    )
    # the answers to the marks are in the index: one more pass looks at each marked Node once
    settled = reconciler.run(pool)
    assert settled is not None and settled.writes == []
    # (other tests' Nodes may share the API server: only this test's are counted)
    selected = Mine(names, counted(monkeypatch, selection, "selects"))
    looked_at = Mine(names, counted(monkeypatch, node_marks, "marks_patch"))
    quiet = reconciler.run(pool)
    assert quiet is not None and quiet.writes == [] and quiet.status["readyNodes"] == len(names)
    assert (selected.calls, looked_at.calls) == ([], []), "a pass over an unchanged pool decided again"

    # someone removes one node's pool label: that Node, and only it, is decided again and marked
    unmarked = names[2]
    kube.core.patch_node(unmarked, {"metadata": {"labels": {pool_label_key(pool): None}}})
    index = reconciler.nodes
    wait_for("the label's removal indexed", lambda: pool_label_key(pool) not in _labels(index, unmarked))
    again = reconciler.run(pool)
    assert again is not None and again.writes == [f"marked node {unmarked}"], again.writes
    assert (selected.calls, looked_at.calls) == ([unmarked], [unmarked])
    assert (kube.core.read_node(unmarked).metadata.labels or {}).get(pool_label_key(pool)) == "ready"

    # a node relabelled out of the pool's selection loses its OffloadPoolNode and its marks
    # (first one pass over the mark's answer, a new SelectableNode of that node)
    assert reconciler.run(pool).writes == []  # type: ignore[union-attr]
    selected.clear()
    gone = names[4]
    kube.core.patch_node(gone, {"metadata": {"labels": {"memory": "elsewhere"}}})
    wait_for("the relabelling indexed", lambda: _labels(index, gone).get("memory") == "elsewhere")
    moved = reconciler.run(pool)
    assert moved is not None
    assert (
        f"deleted OffloadPoolNode {pool}.{gone}" in moved.writes and f"unmarked node {gone}" in moved.writes
    )
    assert moved.status["desiredNodes"] == len(names) - 1
    assert selected.calls == [gone]


class Mine:
    """The calls (by node) about this test's Nodes."""

    def __init__(self, names: list[str], calls: list[str]) -> None:
        self.names, self.all = set(names), calls

    @property
    def calls(self) -> list[str]:
        return [n for n in self.all if n in self.names]

    def clear(self) -> None:
        del self.all[:]


def _labels(index: Any, node: str) -> dict[str, str]:
    found = [n for n in index.values() if n.name == node]
    return dict(found[0].labels) if found else {}


@pytest.mark.controlplane
def test_a_deleted_pools_pass_memory_is_dropped(world: tuple[Kube, Reconciler, str, list[str]]) -> None:
    """What the passes keep of a pool — O(nodes) — goes when its deletion is done
    (``Runtime.forget``, from the deletion handler): it stayed behind every deleted pool, 4 MiB
    of the operator's RSS per round of the scale benchmark's pools."""
    _, reconciler, pool, names = world
    assert reconciler.run(pool) is not None and reconciler.run(pool) is not None  # marks, then none
    kept = reconciler._memory[pool]
    assert len(kept.marked) >= len(names) and kept.renewed, "the pass kept nothing to drop"
    runtime = Runtime(OperatorConfig(namespace="default"))
    runtime.reconciler = reconciler
    runtime.forget(pool)
    assert pool not in reconciler._memory
