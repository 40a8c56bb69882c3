"""A pass's log line names its first few writes and counts the rest by kind (a pass over a
thousand nodes logged a thousand names on one line)."""

from __future__ import annotations

from offloadpool.operator.reconcile import WRITES_NAMED, summary


def test_a_few_writes_are_all_named() -> None:
    writes = ["created DaemonSet offloadpool-p", "patched pool status"]
    assert summary(writes) == "created DaemonSet offloadpool-p; patched pool status"


def test_many_writes_name_the_first_few_and_count_the_rest_by_kind() -> None:
    writes = [f"unmarked node n{i:04d}" for i in range(1000)] + ["patched pool status"]
    line = summary(writes)
    assert line.startswith("; ".join(writes[:WRITES_NAMED]) + "; and 996 more: ")
    assert line.endswith("unmarked node ×995, patched pool ×1")
    assert "n0005" not in line and len(line) < 300
