"""The operator, the agent and the CLI read one contract (``offloadpool.api``): each value they
must agree on is the same object, the CRD's limits are the engine's, and the agent and the CLI
turn a pool into the same request."""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from offloadpool.agent.config import load as load_agent_config
from offloadpool.agent.reconcile import decide
from offloadpool.api import HOST_ROOT, OffloadPool, is_hugetlbfs, node_object_name, pool_request, status_patch
from offloadpool.api.agent_env import ROOT_ENV
from offloadpool.api.constants import AGENT_HTTP_PORT, MAX_MESSAGE_LENGTH, MAX_REASON_LENGTH, clip_message
from offloadpool.api.spec import DEFAULT_MEDIUM, MAX_FILES_LIMIT
from offloadpool.cli.commands import request_from_args
from offloadpool.cli.main import build_parser
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.daemonset import resources
from offloadpool.region.memory import media as engine_media
from offloadpool.region.request import PoolRequest

HEARTBEAT = datetime(2026, 11, 30, 16, 0, 0, tzinfo=timezone.utc)
CRD = Path(__file__).resolve().parents[1] / "crds" / "offloadpool.io_offloadpools.yaml"

POOL: dict[str, Any] = {
    "apiVersion": "offloadpool.io/v1alpha1",
    "kind": "OffloadPool",
    "metadata": {"name": "kv", "generation": 4},
    "spec": {
        "capacity": "512Mi",
        "medium": "MemoryTHP",
        "layout": {"type": "Interleaved", "ranks": 2, "slotSize": "1Mi"},
        "segments": {"maxFiles": 4, "minSize": "64Mi"},
        "prefault": {"workers": 3},
        "consumers": {"uid": 7, "gid": 8, "mode": "0600"},
        "compat": {"vllm": {"engineId": "e1", "rowSize": "2Mi", "numSegments": 2}},
    },
}


def test_one_host_root_and_port_for_cli_agent_and_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_ENV, raising=False)
    cli = build_parser().parse_args(["status"])
    agent = load_agent_config(["--pool", "kv", "--node", "n1"], environ={})
    operator = OperatorConfig()
    assert cli.root == str(agent.root) == operator.host_root == HOST_ROOT == "/var/lib/offloadpool"
    assert agent.http_port == operator.http_port == AGENT_HTTP_PORT == 9475
    assert agent.node_object_name == node_object_name("kv", "n1") == "kv.n1"


def test_the_crds_file_limits_and_default_medium_are_the_engines() -> None:
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = schema["properties"]["spec"]["properties"]
    assert props["segments"]["properties"]["maxFiles"]["maximum"] == MAX_FILES_LIMIT == 32
    assert props["compat"]["properties"]["vllm"]["properties"]["numSegments"]["maximum"] == MAX_FILES_LIMIT
    assert props["medium"]["default"] == DEFAULT_MEDIUM == PoolRequest(name="x", capacity=1).medium
    with pytest.raises(ValueError, match="max_files 33 exceeds the limit of 32"):
        PoolRequest(name="x", capacity=1 << 30, max_files=MAX_FILES_LIMIT + 1).validate()
    # the operator's DaemonSet and the engine read an absent medium the same way
    assert "hugepages-2Mi" in resources({"capacity": "2Mi"}, OperatorConfig())["limits"]
    assert [m for m in engine_media.MEDIA if is_hugetlbfs(m)] == ["HugePages-2Mi", "HugePages-1Gi"]


def test_the_agent_and_the_cli_make_the_same_request(tmp_path: Path) -> None:
    from_agent = decide(POOL, {"spec": {"pool": "kv", "nodeName": "n1"}}, None).request
    doc = tmp_path / "pool.yaml"
    doc.write_text(yaml.safe_dump(POOL))
    from_cli = request_from_args(build_parser().parse_args(["provision", "-f", str(doc)]))
    expected = PoolRequest(
        name="kv",
        capacity=512 << 20,
        medium="MemoryTHP",
        layout_type="Interleaved",
        ranks=2,
        slot_bytes=1 << 20,
        max_files=4,
        min_segment=64 << 20,
        workers=3,
        numa="None",
        uid=7,
        gid=8,
        mode=0o600,
        compat_engine_id="e1",
        compat_row_bytes=2 << 20,
        compat_segments=2,
        generation=4,
    )
    assert from_agent == from_cli == pool_request(OffloadPool.model_validate(POOL)) == expected


def test_absent_fields_get_the_crds_defaults_in_the_request() -> None:
    pool = copy.deepcopy(POOL)
    pool["spec"] = {"capacity": "1Gi"}
    req = pool_request(pool)
    assert req == PoolRequest(name="kv", capacity=1 << 30, generation=4)
    assert (req.medium, req.max_files, req.min_segment, req.mode) == ("HugePages-2Mi", 32, 1 << 30, 0o660)


def test_node_status_is_written_through_the_model() -> None:
    patch = status_patch(
        phase="Ready",
        bytes_total=1 << 30,
        populate_gib_per_second=7.5,
        heartbeat=HEARTBEAT,
        pending_generation=None,
    )
    # camelCase as the CRD names the fields; None kept (a merge patch removes the field); time as written
    assert patch == {
        "phase": "Ready",
        "bytesTotal": 1 << 30,
        "populateGiBPerSecond": 7.5,
        "heartbeat": "2026-11-30T16:00:00Z",
        "pendingGeneration": None,
    }
    # a misspelt or camelCase name would be pruned by the API server without a word: refused here
    with pytest.raises(TypeError, match="bytesTotal"):
        status_patch(bytesTotal=1)
    with pytest.raises(TypeError, match="engines_atached"):
        status_patch(engines_atached=1)
    with pytest.raises(ValueError, match="progress"):
        status_patch(progress=101)


def test_the_message_and_reason_caps_are_the_crds() -> None:
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    failing = schema["properties"]["status"]["properties"]["failingNodes"]["items"]["properties"]
    assert failing["message"]["maxLength"] == MAX_MESSAGE_LENGTH == 1024
    assert failing["reason"]["maxLength"] == MAX_REASON_LENGTH == 128
    assert clip_message("x" * 5000) == "x" * MAX_MESSAGE_LENGTH
    assert clip_message("short") == "short"
