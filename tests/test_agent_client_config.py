"""The agent's API client takes its proxy from the environment once, when it is configured.

The kubernetes client's token-refresh hook (installed by both its in-cluster and kubeconfig
loaders) runs before every request and sets the configuration's ``host``; the host setter then
took the proxy from the environment again (``urllib.request.getproxies()``, a walk over every
variable: 0.1 ms a request with 35 of them, and a pod's environment holds seven per Service of
its namespace). Here the hook runs as a request would run it, with the environment changed
in between; no request is sent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from offloadpool.agent import kube

PROXY = "http://proxy.example.invalid:3128"


def kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": "t0k3n"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_proxy_is_taken_once_not_at_every_request(
    tmp_path: Path, no_proxy_env: pytest.MonkeyPatch
) -> None:
    cfg = kube.configuration(kubeconfig(tmp_path))
    assert cfg.proxy is None
    no_proxy_env.setenv("HTTPS_PROXY", PROXY)
    assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer t0k3n"  # the hook ran
    assert cfg.proxy is None, "the client took the proxy from the environment again for a request"


def test_a_proxy_in_the_environment_is_still_used(tmp_path: Path, no_proxy_env: pytest.MonkeyPatch) -> None:
    no_proxy_env.setenv("HTTPS_PROXY", PROXY)
    cfg = kube.configuration(kubeconfig(tmp_path))
    cfg.auth_settings()
    assert cfg.proxy == PROXY
