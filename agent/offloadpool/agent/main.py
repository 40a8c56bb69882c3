"""``offloadpool-agent``: run one pool's agent on this node until SIGTERM.

SIGTERM (pod deletion, node drain, DaemonSet update) ends the process at once without touching
memory: the region outlives the agent, and the next agent validates and keeps it. Even a
populate in progress is simply abandoned; the next provision finishes what is missing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from offloadpool import __version__
from offloadpool.agent import config as config_mod
from offloadpool.agent import kube
from offloadpool.agent.health import HealthServer
from offloadpool.agent.loop import Agent
from offloadpool.agent.metrics import AgentMetrics
from offloadpool.agent.share_service import ShareService

log = logging.getLogger("offloadpool.agent")
#: Exit status when the API server no longer accepts the pod's token (``Credential.refused``).
EXIT_UNAUTHORIZED = 3


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_mod.load(argv)
    except config_mod.ConfigError as exc:
        print(f"offloadpool-agent: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log.info(
        "offloadpool-agent %s: pool %s on node %s, root %s, pod namespace %s",
        __version__,
        cfg.pool,
        cfg.node_name,
        cfg.root,
        cfg.namespace,
    )

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    access = kube.KubeAccess(kube.api_client(cfg.kubeconfig), cfg.pool, cfg.node_object_name, cfg.namespace)
    metrics = AgentMetrics(cfg.pool, cfg.node_name, process=True)
    agent = Agent(
        access,
        cfg.root,
        metrics=metrics,
        heartbeat_seconds=cfg.heartbeat_seconds,
        retry_seconds=cfg.retry_seconds,
        watch_timeout_seconds=cfg.watch_timeout_seconds,
        workers=cfg.workers,
        sized_for=cfg.sized_for,
    )
    server = HealthServer(
        cfg.http_port,
        metrics.registry,
        agent.live,
        agent.ready,
        host=cfg.http_address,
        timeout_seconds=cfg.http_timeout_seconds,
        max_connections=cfg.http_max_connections,
        workers=cfg.http_workers,
    ).start()
    log.info("serving /healthz /readyz /metrics on %s port %d", cfg.http_address, server.port)
    agent.start()
    ShareService(cfg.root, cfg.pool).start()  # hostPath engines ask it for their share
    while not stop.wait(1.0):
        if agent.thread is not None and not agent.thread.is_alive():
            if agent.credential_rejected:
                return EXIT_UNAUTHORIZED  # the loop said why
            log.error("agent loop died; exiting so the pod restarts")
            return 1
    log.info("SIGTERM: exiting without touching the region")
    logging.shutdown()
    # populate workers may be inside madvise: leave at once, the kernel keeps the memory
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
