"""Agent configuration: flags override environment, environment overrides defaults.

The DaemonSet the operator renders passes everything through the environment (downward API
for the node and namespace), so the environment is the primary interface; flags exist for
running an agent by hand. Everything is validated here, before anything else happens, so a
misconfigured pod fails at once with a message that says which setting is wrong.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from offloadpool.api.constants import (
    AGENT_HTTP_PORT,
    DEFAULT_HEARTBEAT_SECONDS,
    HEARTBEAT_ENV,
    HOST_ROOT,
    node_object_name,
)

DEFAULT_ROOT = HOST_ROOT
DEFAULT_HTTP_PORT = AGENT_HTTP_PORT


class ConfigError(ValueError):
    """A setting is missing or malformed."""


@dataclass(frozen=True)
class AgentConfig:
    pool: str
    node_name: str
    namespace: str
    root: Path
    http_port: int
    heartbeat_seconds: float
    #: seconds between retries after a failure (capacity, API errors, a held lease)
    retry_seconds: float
    #: pre-fault workers override (0 = the pool's spec / the engine's default)
    workers: int
    #: kubeconfig file; None = in-cluster config first, then the default kubeconfig
    kubeconfig: str | None
    log_level: str

    @property
    def node_object_name(self) -> str:
        """Name of this node's OffloadPoolNode: ``<pool>.<node>`` (docs/api.md)."""
        return node_object_name(self.pool, self.node_name)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offloadpool-agent",
        description="Provision one OffloadPool's memory on this node and report its state.",
    )
    p.add_argument("--pool", help="OffloadPool name (env POOL_NAME)")
    p.add_argument("--node", help="this node's name (env NODE_NAME, downward API spec.nodeName)")
    p.add_argument("--namespace", help="the pod's namespace, for logs (env POD_NAMESPACE)")
    p.add_argument(
        "--root", help=f"host root holding pool directories (env OFFLOADPOOL_ROOT, default {DEFAULT_ROOT})"
    )
    p.add_argument(
        "--http-port",
        type=int,
        help=f"port of /healthz, /readyz, /metrics (env OFFLOADPOOL_HTTP_PORT, default {DEFAULT_HTTP_PORT})",
    )
    p.add_argument(
        "--heartbeat-seconds",
        type=float,
        help=f"Lease renewal and step period (env {HEARTBEAT_ENV}, set by the operator's DaemonSet "
        f"from its --agent-heartbeat; default {DEFAULT_HEARTBEAT_SECONDS:g})",
    )
    p.add_argument(
        "--retry-seconds",
        type=float,
        help="retry period after a failure (env OFFLOADPOOL_RETRY_SECONDS, default 5)",
    )
    p.add_argument("--workers", type=int, help="pre-fault workers override (env OFFLOADPOOL_WORKERS)")
    p.add_argument("--kubeconfig", help="kubeconfig file (env KUBECONFIG; default: in-cluster)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING (env OFFLOADPOOL_LOG_LEVEL, default INFO)")
    return p


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> AgentConfig:
    """Parse flags and environment into a validated AgentConfig; raise ConfigError if unusable."""
    env = os.environ if environ is None else environ
    args = _parser().parse_args(argv)

    def pick(flag: object, name: str, default: object = None) -> object:
        if flag is not None:
            return flag
        value = env.get(name)
        return default if value in (None, "") else value

    pool = pick(args.pool, "POOL_NAME")
    node = pick(args.node, "NODE_NAME")
    if not pool:
        raise ConfigError("no pool: pass --pool or set POOL_NAME")
    if not node:
        raise ConfigError("no node name: pass --node or set NODE_NAME (downward API spec.nodeName)")
    namespace = str(pick(args.namespace, "POD_NAMESPACE", "default"))
    root = Path(str(pick(args.root, "OFFLOADPOOL_ROOT", DEFAULT_ROOT)))
    if not root.is_absolute():
        raise ConfigError(f"OFFLOADPOOL_ROOT must be an absolute path, got {str(root)!r}")
    try:
        # a flag arrives typed, the environment as text: both read through their text
        port = int(str(pick(args.http_port, "OFFLOADPOOL_HTTP_PORT", DEFAULT_HTTP_PORT)))
        heartbeat = float(str(pick(args.heartbeat_seconds, HEARTBEAT_ENV, DEFAULT_HEARTBEAT_SECONDS)))
        retry = float(str(pick(args.retry_seconds, "OFFLOADPOOL_RETRY_SECONDS", 5.0)))
        workers = int(str(pick(args.workers, "OFFLOADPOOL_WORKERS", 0)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"malformed numeric setting: {exc}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"OFFLOADPOOL_HTTP_PORT {port} is not a TCP port")
    if heartbeat <= 0 or retry <= 0:
        raise ConfigError("heartbeat and retry periods must be positive")
    if workers < 0:
        raise ConfigError(f"workers must be >= 0, got {workers}")
    level = str(pick(args.log_level, "OFFLOADPOOL_LOG_LEVEL", "INFO")).upper()
    kubeconfig = pick(args.kubeconfig, "KUBECONFIG")
    return AgentConfig(
        pool=str(pool),
        node_name=str(node),
        namespace=namespace,
        root=root,
        http_port=port,
        heartbeat_seconds=heartbeat,
        retry_seconds=retry,
        workers=workers,
        kubeconfig=None if kubeconfig is None else str(kubeconfig),
        log_level=level,
    )
