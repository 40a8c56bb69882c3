"""The agent's settings (``AgentConfig``): flags override environment, environment overrides
the defaults, which are written once, on the dataclass's fields.

The DaemonSet the operator renders passes everything through the environment (downward API
for the node and namespace), so the environment is the primary interface; flags exist for
running an agent by hand. Everything is validated here, before anything else happens, so a
misconfigured pod fails at once with a message that says which setting is wrong.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from offloadpool.api.agent_env import (
    HEARTBEAT_ENV,
    HTTP_ADDRESS_ENV,
    HTTP_PORT_ENV,
    KUBECONFIG_ENV,
    LOG_LEVEL_ENV,
    NODE_NAME_ENV,
    POD_NAMESPACE_ENV,
    POOL_NAME_ENV,
    RETRY_ENV,
    ROOT_ENV,
    SIZED_FOR_ENV,
    WORKERS_ENV,
)
from offloadpool.api.constants import AGENT_HTTP_PORT, HOST_ROOT, node_object_name


class ConfigError(ValueError):
    """A setting is missing or malformed."""


@dataclass(frozen=True)
class AgentConfig:
    """Settings of one agent process.

    Each field's default is written here and nowhere else: ``load`` fills a field from its flag,
    else its environment variable (``offloadpool.api.agent_env``), else this default; the
    operator's DaemonSet, the flags' help and the docs take it from here.
    """

    pool: str
    """The OffloadPool this agent provisions (``--pool``, ``POOL_NAME_ENV``); required."""
    node_name: str
    """This node's name (``--node``, ``NODE_NAME_ENV`` from the downward API); required."""
    namespace: str = "default"
    """The pod's namespace (``--namespace``, ``POD_NAMESPACE_ENV``): where its heartbeat Lease and
    Events go."""
    root: Path = Path(HOST_ROOT)
    """The host root holding every pool's directory (``--root``, ``ROOT_ENV``): an
    absolute path, the DaemonSet's hostPath."""
    http_port: int = AGENT_HTTP_PORT
    """Port of /healthz, /readyz and /metrics (``--http-port``, ``HTTP_PORT_ENV``; 0:
    any free port)."""
    http_address: str = "0.0.0.0"
    """Address that port binds (``--http-address``, ``HTTP_ADDRESS_ENV``; the operator passes its
    ``--agent-http-address``): the default is every IPv4 address of the pod's own network
    namespace (its pod IP, where the kubelet probes and Prometheus scrapes, and loopback); "::"
    for IPv6, a single address to narrow it."""
    http_timeout_seconds: float = 10.0
    """A connection to that port that sends no request for this long is closed, and each read or
    write of a request gives up after it (no flag: the probes' own timeout is 5 s)."""
    http_max_connections: int = 64
    """Open connections to that port at most: beyond it the one that waited longest without a
    request is closed, so a probe always gets in (no flag)."""
    http_workers: int = 4
    """Threads answering requests on that port; waiting connections hold none (no flag)."""
    heartbeat_seconds: float = 10.0
    """Seconds between Lease renewals, and the longest a step waits without an event
    (``--heartbeat-seconds``, ``HEARTBEAT_ENV``): as the kubelet renews its node
    Lease. N nodes renew N / this many times a second; the operator's DaemonSet sets it from
    its ``--agent-heartbeat``, whose default is this one."""
    retry_seconds: float = 5.0
    """Seconds between retries after a failure: too little capacity, an API error, a held lease
    (``--retry-seconds``, ``RETRY_ENV``)."""
    watch_timeout_seconds: int = 120
    """The API server ends the agent's watches of its pool and OffloadPoolNode after this long
    and the agent watches again, so a connection that died silently cannot leave it deaf for
    longer (no flag: not something to tune per cluster)."""
    workers: int = 0
    """Pre-fault workers, replacing the pool's ``spec.prefault.workers`` (``--workers``,
    ``WORKERS_ENV``); 0: the pool's spec, else the engine's default."""
    sized_for: str = ""
    """The medium and capacity the agent's pod was made for (``SIZED_FOR_ENV``, set by the
    operator's DaemonSet; no flag); empty: unknown, every generation is applied."""
    kubeconfig: str | None = None
    """A kubeconfig file (``--kubeconfig``, ``KUBECONFIG_ENV``); None: in-cluster credentials
    first, then the default kubeconfig."""
    log_level: str = "INFO"
    """DEBUG, INFO or WARNING (``--log-level``, ``LOG_LEVEL_ENV``)."""

    @property
    def node_object_name(self) -> str:
        """Name of this node's OffloadPoolNode: ``<pool>.<node>`` (docs/api.md)."""
        return node_object_name(self.pool, self.node_name)


def _parser() -> argparse.ArgumentParser:
    d = AgentConfig
    p = argparse.ArgumentParser(
        prog="offloadpool-agent",
        description="Provision one OffloadPool's memory on this node and report its state.",
    )
    p.add_argument("--pool", help=f"OffloadPool name (env {POOL_NAME_ENV})")
    p.add_argument("--node", help=f"this node's name (env {NODE_NAME_ENV}, downward API spec.nodeName)")
    p.add_argument(
        "--namespace", help=f"the pod's namespace (env {POD_NAMESPACE_ENV}, default {d.namespace})"
    )
    p.add_argument("--root", help=f"host root holding pool directories (env {ROOT_ENV}, default {d.root})")
    p.add_argument(
        "--http-port",
        type=int,
        help=f"port of /healthz, /readyz, /metrics (env {HTTP_PORT_ENV}, default {d.http_port})",
    )
    p.add_argument(
        "--http-address",
        help=f"address the HTTP port binds (env {HTTP_ADDRESS_ENV}, default {d.http_address})",
    )
    p.add_argument(
        "--heartbeat-seconds",
        type=float,
        help=f"Lease renewal and step period (env {HEARTBEAT_ENV}, set by the operator's DaemonSet "
        f"from its --agent-heartbeat; default {d.heartbeat_seconds:g})",
    )
    p.add_argument(
        "--retry-seconds",
        type=float,
        help=f"retry period after a failure (env {RETRY_ENV}, default {d.retry_seconds:g})",
    )
    p.add_argument(
        "--workers",
        type=int,
        help=f"pre-fault workers override (env {WORKERS_ENV}, default {d.workers}: the pool's spec)",
    )
    p.add_argument("--kubeconfig", help=f"kubeconfig file (env {KUBECONFIG_ENV}; default: in-cluster)")
    p.add_argument("--log-level", help=f"DEBUG, INFO, WARNING (env {LOG_LEVEL_ENV}, default {d.log_level})")
    return p


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Parse flags and environment into a validated AgentConfig; raise ConfigError if unusable."""
    env = os.environ if environ is None else environ
    args = _parser().parse_args(argv)
    d = AgentConfig

    def pick(flag: object, name: str, default: object = None) -> object:
        if flag is not None:
            return flag
        value = env.get(name)
        return default if value in (None, "") else value

    pool = pick(args.pool, POOL_NAME_ENV)
    node = pick(args.node, NODE_NAME_ENV)
    if not pool:
        raise ConfigError(f"no pool: pass --pool or set {POOL_NAME_ENV}")
    if not node:
        raise ConfigError(f"no node name: pass --node or set {NODE_NAME_ENV} (downward API spec.nodeName)")
    namespace = str(pick(args.namespace, POD_NAMESPACE_ENV, d.namespace))
    root = Path(str(pick(args.root, ROOT_ENV, d.root)))
    if not root.is_absolute():
        raise ConfigError(f"{ROOT_ENV} must be an absolute path, got {str(root)!r}")
    try:
        # a flag arrives typed, the environment as text: both read through their text
        port = int(str(pick(args.http_port, HTTP_PORT_ENV, d.http_port)))
        heartbeat = float(str(pick(args.heartbeat_seconds, HEARTBEAT_ENV, d.heartbeat_seconds)))
        retry = float(str(pick(args.retry_seconds, RETRY_ENV, d.retry_seconds)))
        workers = int(str(pick(args.workers, WORKERS_ENV, d.workers)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"malformed numeric setting: {exc}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{HTTP_PORT_ENV} {port} is not a TCP port")
    if heartbeat <= 0 or retry <= 0:
        raise ConfigError("heartbeat and retry periods must be positive")
    if workers < 0:
        raise ConfigError(f"workers must be >= 0, got {workers}")
    address = str(pick(args.http_address, HTTP_ADDRESS_ENV, d.http_address))
    try:
        socket.getaddrinfo(address, None, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        raise ConfigError(f"{HTTP_ADDRESS_ENV} {address!r} is not an IP address") from None
    level = str(pick(args.log_level, LOG_LEVEL_ENV, d.log_level)).upper()
    kubeconfig = pick(args.kubeconfig, KUBECONFIG_ENV, d.kubeconfig)
    return AgentConfig(
        pool=str(pool),
        node_name=str(node),
        namespace=namespace,
        root=root,
        http_port=port,
        http_address=address,
        heartbeat_seconds=heartbeat,
        retry_seconds=retry,
        workers=workers,
        sized_for=str(env.get(SIZED_FOR_ENV, d.sized_for)),
        kubeconfig=None if kubeconfig is None else str(kubeconfig),
        log_level=level,
    )
