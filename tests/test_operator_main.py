"""The ``offloadpool-operator`` command: refuses to start without a peering mode, and serves
kopf's liveness endpoint once running against the real API server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import offloadpool
from fixtures.operator_process import OperatorProcess
from fixtures.wait import wait_for
from offloadpool.api.constants import MIN_HEARTBEATS_PER_TIMEOUT
from offloadpool.operator.config import OperatorConfig
from offloadpool.operator.main import config_from_args, parse_args

EXE = str(Path(sys.executable).parent / "offloadpool-operator")


def test_needs_standalone_or_peering() -> None:
    out = subprocess.run([EXE, "--namespace", "x"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--standalone or --peering" in out.stderr
    out = subprocess.run([EXE, "--standalone", "--peering", "p"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not allowed with" in out.stderr


def test_the_import_time_heap_is_out_of_the_collectors_sight_before_kopf_runs() -> None:
    """``main`` freezes what it imported (gc.freeze) before it hands over to kopf: a full
    collection then walks only what the operator made since (kopf.run stands in here). That
    includes the call validators of the client's API classes, built when the client imports an
    API's module (``kube.API_CLASSES``): the startup handler's ``Kube`` then adds a handful of
    objects, not ~89,000."""
    code = (
        "import gc, kopf, kubernetes\n"
        "from offloadpool.operator.kube import Kube\n"
        "def run(**kw):\n"
        "    frozen, before = gc.get_freeze_count(), len(gc.get_objects())\n"
        "    kube = Kube(kubernetes.client.ApiClient(kubernetes.client.Configuration()))\n"
        "    print(frozen, len(gc.get_objects()) - before, flush=True)\n"
        "kopf.run = run\n"
        "from offloadpool.operator.main import main; main(['--standalone'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    frozen, made_by_kube = (int(n) for n in out.stdout.split())
    assert frozen > 90_000, out.stdout
    assert made_by_kube < 1_000, out.stdout


def test_flags_reach_the_config() -> None:
    cfg = config_from_args(
        parse_args(
            [
                "--standalone",
                "--namespace",
                "ops",
                "--agent-image",
                "img:1",
                "--heartbeat-timeout",
                "0",
                "--agent-memory-overhead",
                "1Gi",
                "--write-concurrency",
                "3",
                "--agent-heartbeat",
                "2.5",
            ]
        )
    )
    assert (
        cfg.namespace,
        cfg.agent_image,
        cfg.heartbeat_timeout_seconds,
        cfg.agent_memory_overhead,
        cfg.write_concurrency,
        cfg.agent_heartbeat_seconds,
    ) == ("ops", "img:1", 0.0, "1Gi", 3, 2.5)
    assert cfg.problem() is None


#: The settings' defaults the refusals below are measured against.
TIMEOUT, HEARTBEAT = OperatorConfig.heartbeat_timeout_seconds, OperatorConfig.agent_heartbeat_seconds
#: A timeout a second short of three default heartbeats, and a heartbeat a third of the
#: default timeout and one more.
SHORT, SLOW = MIN_HEARTBEATS_PER_TIMEOUT * HEARTBEAT - 1, TIMEOUT / MIN_HEARTBEATS_PER_TIMEOUT + 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--heartbeat-timeout", f"{SHORT:g}"],
            f"--heartbeat-timeout {SHORT:g} is shorter than {MIN_HEARTBEATS_PER_TIMEOUT} agent heartbeats "
            f"(--agent-heartbeat {HEARTBEAT:g}, so at least {MIN_HEARTBEATS_PER_TIMEOUT * HEARTBEAT:g}): "
            "a renewal a little late would make a healthy node unready",
        ),
        (
            ["--agent-heartbeat", f"{SLOW:g}"],
            f"--heartbeat-timeout {TIMEOUT:g} is shorter than {MIN_HEARTBEATS_PER_TIMEOUT} agent heartbeats "
            f"(--agent-heartbeat {SLOW:g}, so at least {MIN_HEARTBEATS_PER_TIMEOUT * SLOW:g})",
        ),
        (["--agent-heartbeat", "0"], "--agent-heartbeat must be positive, got 0"),
        (["--heartbeat-timeout", "-1"], "--heartbeat-timeout must be 0 (never) or positive, got -1"),
    ],
)
def test_a_timeout_shorter_than_three_agent_heartbeats_is_refused_before_starting(
    flags: list[str], message: str
) -> None:
    """Nodes would flap between Ready and unresponsive: said at once, nothing started (the
    exit comes before kopf is even imported, so no API server is needed to show it)."""
    out = subprocess.run([EXE, "--standalone", *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert f"offloadpool-operator: {message}" in out.stderr, out.stderr


def test_a_timeout_of_three_heartbeats_or_none_is_accepted() -> None:
    least = f"{MIN_HEARTBEATS_PER_TIMEOUT * HEARTBEAT:g}"
    for flags in (["--heartbeat-timeout", least], ["--heartbeat-timeout", "0", "--agent-heartbeat", "120"]):
        assert config_from_args(parse_args(["--standalone", *flags])).problem() is None


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_write_concurrency_must_be_a_whole_number_of_at_least_one(value: str) -> None:
    out = subprocess.run(
        [EXE, "--standalone", "--write-concurrency", value], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out
    assert f"argument --write-concurrency: {value!r} is not a whole number of at least 1" in out.stderr


@pytest.mark.controlplane
def test_liveness_endpoint(crds_installed: Any, operator_rbac: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = Path(tempfile.mkdtemp(prefix="offloadpool-operator-"))
    op = OperatorProcess(
        crds_installed, operator_rbac, workdir, extra_args=("--liveness", f"http://127.0.0.1:{port}/healthz")
    ).start()
    try:

        def healthy() -> bool:
            assert op.alive(), op.log()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_for("the operator's /healthz", healthy, timeout=60)
        # Its first line of its own says which version runs.
        assert f"offloadpool-operator {offloadpool.__version__}: namespace " in op.log(100_000)
    finally:
        op.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_retried_requests_are_info_and_only_the_last_failure_an_error() -> None:
    """A fresh install's operator meets 429 "storage is (re)initializing" for the CRDs helm has
    just made; kopf retries and the request passes, but kopf logs each retry at ERROR. With
    kopf's own logging set up as main sets it up, the retry reads INFO and the attempt kopf
    gives up on stays ERROR (the lines are kopf's, word for word, from kopf._cogs.clients.api)."""
    code = (
        "import logging, kopf\n"
        "from offloadpool.operator.main import quiet_retries\n"
        "kopf.configure(verbose=False, debug=False)\n"
        "quiet_retries()\n"
        "log = logging.getLogger('kopf._cogs.clients.api')\n"
        "what = 'GET https://10.0.0.1/apis/offloadpool.io/v1alpha1/offloadpools'\n"
        "err = \"APITooManyRequestsError('storage is (re)initializing', {'code': 429})\"\n"
        "log.error(f'Request attempt 1 failed; will retry: {what} -> {err}')\n"
        "log.error(f'Request attempt 9 failed; escalating: {what} -> {err}')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "Request attempt" in line]
    assert len(lines) == 2, lines
    retried, escalated = lines
    assert "[INFO" in retried and "ERROR" not in retried, retried
    assert "[ERROR" in escalated, escalated
