"""Agent configuration: environment as the DaemonSet sets it, flags over env, bad input rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from offloadpool.agent.config import ConfigError, load

ENV = {
    "POOL_NAME": "kv",
    "NODE_NAME": "node-a",
    "POD_NAMESPACE": "offloadpool-system",
    "OFFLOADPOOL_ROOT": "/var/lib/offloadpool",
    "OFFLOADPOOL_HTTP_PORT": "9475",
}


def test_environment_of_the_daemonset() -> None:
    cfg = load([], ENV)
    assert (cfg.pool, cfg.node_name, cfg.namespace) == ("kv", "node-a", "offloadpool-system")
    assert (cfg.root, cfg.http_port, cfg.heartbeat_seconds) == (Path("/var/lib/offloadpool"), 9475, 10.0)
    assert cfg.node_object_name == "kv.node-a"


def test_flags_override_environment() -> None:
    cfg = load(["--pool", "other", "--http-port", "0", "--heartbeat-seconds", "2"], ENV)
    assert (cfg.pool, cfg.http_port, cfg.heartbeat_seconds) == ("other", 0, 2.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"POOL_NAME": ""}, "no pool"),
        ({"NODE_NAME": ""}, "no node name"),
        ({"OFFLOADPOOL_ROOT": "relative/dir"}, "absolute"),
        ({"OFFLOADPOOL_HTTP_PORT": "http"}, "malformed"),
        ({"OFFLOADPOOL_HTTP_PORT": "70000"}, "not a TCP port"),
        ({"OFFLOADPOOL_HEARTBEAT_SECONDS": "0"}, "positive"),
    ],
)
def test_bad_settings_fail_with_the_name_of_the_setting(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load([], {**ENV, **change})
