"""Agent configuration: environment as the DaemonSet sets it, flags over env, bad input rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadpool.agent.config import AgentConfig, ConfigError, load
from offloadpool.api import agent_env

ENV = {
    agent_env.POOL_NAME_ENV: "kv",
    agent_env.NODE_NAME_ENV: "node-a",
    agent_env.POD_NAMESPACE_ENV: "offloadpool-system",
    agent_env.ROOT_ENV: "/var/lib/offloadpool",
    agent_env.HTTP_PORT_ENV: "9475",
}


def test_environment_of_the_daemonset() -> None:
    cfg = load([], ENV)
    assert (cfg.pool, cfg.node_name, cfg.namespace) == ("kv", "node-a", "offloadpool-system")
    assert (cfg.root, cfg.http_port) == (Path("/var/lib/offloadpool"), 9475)
    # not in the DaemonSet's environment: the settings' defaults
    assert (cfg.heartbeat_seconds, cfg.retry_seconds) == (
        AgentConfig.heartbeat_seconds,
        AgentConfig.retry_seconds,
    )
    assert cfg.node_object_name == "kv.node-a"


def test_flags_override_environment() -> None:
    cfg = load(["--pool", "other", "--http-port", "0", "--heartbeat-seconds", "2"], ENV)
    assert (cfg.pool, cfg.http_port, cfg.heartbeat_seconds) == ("other", 0, 2.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({agent_env.POOL_NAME_ENV: ""}, "no pool"),
        ({agent_env.NODE_NAME_ENV: ""}, "no node name"),
        ({agent_env.ROOT_ENV: "relative/dir"}, "absolute"),
        ({agent_env.HTTP_PORT_ENV: "http"}, "malformed"),
        ({agent_env.HTTP_PORT_ENV: "70000"}, "not a TCP port"),
        ({agent_env.HEARTBEAT_ENV: "0"}, "positive"),
    ],
)
def test_bad_settings_fail_with_the_name_of_the_setting(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load([], {**ENV, **change})
