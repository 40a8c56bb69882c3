"""Each process's settings object is the one place its defaults are written.

For the agent (``AgentConfig``), the operator (``OperatorConfig``, ``WebhookOptions``), the CLI
(``CliConfig``), the CSI node plugin (``CsiConfig``) and the DRA plugin (``DraConfig``): every
field has a docstring, parsing no flags (and no environment) gives exactly the fields' defaults,
and the reference docs state the
defaults the objects hold. The chart's side (no value given: no flag passed) is in ``test_chart.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from offloadpool.agent.config import AgentConfig, load
from offloadpool.api import agent_env
from offloadpool.api.constants import MIN_HEARTBEATS_PER_TIMEOUT
from offloadpool.cli.config import CliConfig
from offloadpool.cli.main import build_parser
from offloadpool.csi.config import DRIVER_NAME, CsiConfig
from offloadpool.dra.config import DraConfig
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.main import config_from_args, parse_args
from offloadpool.operator.webhook import WebhookOptions, options_from_args

DOCS = Path(__file__).resolve().parents[1] / "docs"
SETTINGS = (AgentConfig, OperatorConfig, WebhookOptions, CliConfig, CsiConfig, DraConfig)
#: The operator's own environment, which would stand in for a flag's default.
OPERATOR_ENV = (
    agent_env.POD_NAMESPACE_ENV,
    "OFFLOADPOOL_AGENT_IMAGE",
    "OFFLOADPOOL_AGENT_IMAGE_PULL_POLICY",
    "OFFLOADPOOL_AGENT_SERVICE_ACCOUNT",
    "OFFLOADPOOL_AGENT_PRIORITY_CLASS",
    "OFFLOADPOOL_HEARTBEAT_TIMEOUT_SECONDS",
    "OFFLOADPOOL_AGENT_HEARTBEAT_SECONDS",
    "OFFLOADPOOL_LIVENESS",
)


def field_docstrings(cls: type) -> dict[str, str]:
    """{field: the string literal right after its annotated assignment} in ``cls``'s source."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[stmt.target.id] = str(after.value.value)
    return docs


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_setting_has_a_docstring(cls: type) -> None:
    docs = field_docstrings(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    assert [n for n in names if len(docs.get(n, "").split()) < 3] == []


def test_the_agents_defaults_are_what_no_flag_and_no_environment_give() -> None:
    assert load(["--pool", "kv", "--node", "n1"], environ={}) == AgentConfig(pool="kv", node_name="n1")


def test_the_agents_environment_is_read_under_the_names_the_api_gives(tmp_path: Path) -> None:
    """Every setting with an environment variable is read from it (a value unlike the default)."""
    env = {
        agent_env.POOL_NAME_ENV: "kv",
        agent_env.NODE_NAME_ENV: "n1",
        agent_env.POD_NAMESPACE_ENV: "ns",
        agent_env.ROOT_ENV: str(tmp_path),
        agent_env.HTTP_PORT_ENV: "1234",
        agent_env.HTTP_ADDRESS_ENV: "::1",
        agent_env.HEARTBEAT_ENV: "2.5",
        agent_env.RETRY_ENV: "1.5",
        agent_env.WORKERS_ENV: "3",
        agent_env.SIZED_FOR_ENV: "Memory/1024",
        agent_env.LOG_LEVEL_ENV: "debug",
        agent_env.KUBECONFIG_ENV: "/k",
    }
    got = load([], environ=env)
    want = AgentConfig(
        "kv",
        "n1",
        "ns",
        tmp_path,
        1234,
        http_address="::1",
        heartbeat_seconds=2.5,
        retry_seconds=1.5,
        workers=3,
        sized_for="Memory/1024",
        kubeconfig="/k",
        log_level="DEBUG",
    )
    assert got == want
    unread = [
        f.name
        for f in dataclasses.fields(AgentConfig)
        if getattr(got, f.name) == getattr(AgentConfig, f.name, None)
    ]
    # the settings without a flag or a variable
    assert unread == ["http_timeout_seconds", "http_max_connections", "http_workers", "watch_timeout_seconds"]


def test_the_operators_defaults_are_what_no_flag_and_no_environment_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in OPERATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    args = parse_args(["--standalone"])
    assert config_from_args(args) == OperatorConfig()
    options = options_from_args(args)
    assert dataclasses.replace(options, injection=WebhookOptions().injection) == WebhookOptions()


def test_the_operator_gives_the_agents_their_own_default_heartbeat() -> None:
    assert OperatorConfig().agent_heartbeat_seconds == AgentConfig.heartbeat_seconds
    assert OperatorConfig().problem() is None  # the defaults agree with each other
    assert (
        OperatorConfig.heartbeat_timeout_seconds >= MIN_HEARTBEATS_PER_TIMEOUT * AgentConfig.heartbeat_seconds
    )


def test_the_clis_defaults_are_what_no_flag_and_no_environment_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(agent_env.ROOT_ENV, raising=False)
    assert CliConfig.from_environment() == CliConfig()
    demo = build_parser().parse_args(["demo"])
    assert (demo.root, demo.name, demo.capacity) == (
        CliConfig.root,
        CliConfig.demo_name,
        CliConfig.demo_capacity,
    )
    monkeypatch.setenv(agent_env.ROOT_ENV, "/elsewhere")
    assert build_parser().parse_args(["status"]).root == "/elsewhere"


def test_the_csi_plugins_defaults_are_what_no_flag_gives() -> None:
    assert CsiConfig.from_args([], environ={agent_env.NODE_NAME_ENV: "n1"}) == CsiConfig(node_id="n1")
    given = ["--endpoint", "/s.sock", "--root", "/r", "--kubelet-dir", "/k", "--node-id", "n2"]
    assert CsiConfig.from_args(given, environ={}) == CsiConfig("n2", "/s.sock", "/r", "/k")
    given += ["--registration-endpoint", "/reg.sock"]
    assert CsiConfig.from_args(given, environ={}) == CsiConfig(
        "n2", "/s.sock", "/r", "/k", registration="/reg.sock"
    )


def test_the_csi_plugin_registers_in_the_kubelets_plugin_watcher_directory() -> None:
    """The kubelet's plugin watcher looks in ``<kubelet>/plugins_registry`` only, and dials the
    CSI socket by its host path: both sockets follow the kubelet's directory."""
    for c in (CsiConfig(node_id="n"), CsiConfig.from_args(["--kubelet-dir", "/k"], environ={})):
        assert os.path.dirname(c.registration) == f"{c.kubelet_dir}/plugins_registry"
        assert c.endpoint.startswith(f"{c.kubelet_dir}/plugins/{DRIVER_NAME}/")
        assert os.path.basename(c.registration) == f"{DRIVER_NAME}-reg.sock"
    assert CsiConfig(node_id="n").kubelet_dir == "/var/lib/kubelet"  # the kubelet's own default


def test_the_dra_plugins_defaults_are_what_no_flag_gives_and_its_sockets_are_its_own() -> None:
    """No flag: the fields' defaults. Its sockets follow the kubelet's directory, and its
    registration socket is not the CSI plugin's (the kubelet keeps one plugin per socket)."""
    assert DraConfig.from_args([], environ={agent_env.NODE_NAME_ENV: "n1"}) == DraConfig(node_id="n1")
    given = ["--node-id", "n2", "--kubelet-dir", "/k", "--cdi-dir", "/c", "--kubeconfig", "/kc"]
    assert DraConfig.from_args(given, environ={}) == DraConfig(
        "n2", kubelet_dir="/k", cdi_dir="/c", kubeconfig="/kc"
    )
    for c in (DraConfig(node_id="n"), DraConfig.from_args(["--kubelet-dir", "/k"], environ={})):
        assert os.path.dirname(c.registration) == f"{c.kubelet_dir}/plugins_registry"
        assert c.endpoint == f"{c.kubelet_dir}/plugins/{DRIVER_NAME}/dra.sock"
        assert c.registration != CsiConfig(node_id="n", kubelet_dir=c.kubelet_dir).registration
    assert DraConfig(node_id="n").cdi_dir == "/var/run/cdi"


def table_rows(doc: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table whose header row starts with ``header``."""
    lines = (DOCS / doc).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


#: docs/operator.md's flag -> OperatorConfig field; the table's default cell names its default.
OPERATOR_FLAGS = {
    "--agent-service-account": "agent_service_account",
    "--agent-cpu-request": "agent_cpu_request",
    "--agent-memory-overhead": "agent_memory_overhead",
    "--agent-http-address": "agent_http_address",
    "--heartbeat-timeout": "heartbeat_timeout_seconds",
    "--agent-heartbeat": "agent_heartbeat_seconds",
    "--resync": "resync_seconds",
    "--deletion-retry": "deletion_retry_seconds",
    "--node-object-grace": "node_object_grace_seconds",
    "--write-concurrency": "write_concurrency",
    "--liveness": "liveness",
}


def test_the_operator_docs_state_the_settings_defaults() -> None:
    rows = {tuple(re.findall(r"`(--[a-z-]+)", r[0])): r[1] for r in table_rows("operator.md", "| flag |")}
    defaults = OperatorConfig()
    for flag, name in OPERATOR_FLAGS.items():
        ((flags, cell),) = [(f, c) for f, c in rows.items() if flag in f]
        stated = re.findall(r"`([^`]+)`|(\d+(?:\.\d+)?)", cell)
        values = [a or b for a, b in stated]
        assert number(getattr(defaults, name)) == values[flags.index(flag)], (flag, cell)


def test_the_agent_docs_state_the_settings_defaults_and_environment_names() -> None:
    rows = {r[0].strip("`"): (r[1].strip("`"), r[2].strip("`")) for r in table_rows("agent.md", "| env |")}
    by_flag = {
        "--namespace": ("namespace", agent_env.POD_NAMESPACE_ENV),
        "--root": ("root", agent_env.ROOT_ENV),
        "--http-port": ("http_port", agent_env.HTTP_PORT_ENV),
        "--http-address": ("http_address", agent_env.HTTP_ADDRESS_ENV),
        "--heartbeat-seconds": ("heartbeat_seconds", agent_env.HEARTBEAT_ENV),
        "--retry-seconds": ("retry_seconds", agent_env.RETRY_ENV),
        "--workers": ("workers", agent_env.WORKERS_ENV),
        "--log-level": ("log_level", agent_env.LOG_LEVEL_ENV),
    }
    for flag, (name, env) in by_flag.items():
        assert rows[env][0] == flag
        assert rows[env][1] == number(getattr(AgentConfig, name)), env
    assert {agent_env.POOL_NAME_ENV, agent_env.NODE_NAME_ENV, agent_env.KUBECONFIG_ENV} <= set(rows)


def test_the_operators_help_shows_each_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in OPERATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for flag, name in OPERATOR_FLAGS.items():
        assert f"(default: {getattr(OperatorConfig, name)})" in shown, flag
