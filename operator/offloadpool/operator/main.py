"""``offloadpool-operator``: run the operator (kopf) against the current cluster.

One replica: ``--standalone`` (the default in the chart, with a Recreate Deployment so two
never overlap) or ``--peering NAME`` to use kopf's peering (needs kopf's peering CRDs). Watches
cluster-wide: pools, OffloadPoolNodes and Nodes are cluster-scoped; the agent DaemonSets go to
``--namespace`` (default: POD_NAMESPACE, else offloadpool-system).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence

from . import webhook
from .config import OperatorConfig, default_namespace


def positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1, or a usage error that says so."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = OperatorConfig()
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="offloadpool-operator",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    peering = p.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone", action="store_true", help="no peering: exactly one operator must run"
    )
    peering.add_argument(
        "--peering", metavar="NAME", help="kopf peering name (ClusterKopfPeering must exist)"
    )
    p.add_argument("--namespace", default=default_namespace(), help="namespace of the agent DaemonSets")
    p.add_argument(
        "--agent-image",
        default=env("OFFLOADPOOL_AGENT_IMAGE", defaults.agent_image),
        help="the agents' image",
    )
    p.add_argument(
        "--agent-image-pull-policy",
        default=env("OFFLOADPOOL_AGENT_IMAGE_PULL_POLICY", defaults.agent_image_pull_policy),
        help="the agents' imagePullPolicy",
    )
    p.add_argument(
        "--agent-service-account",
        default=env("OFFLOADPOOL_AGENT_SERVICE_ACCOUNT", defaults.agent_service_account),
        help="ServiceAccount of the agent pods",
    )
    p.add_argument(
        "--agent-cpu-request", default=defaults.agent_cpu_request, help="CPU request of every agent pod"
    )
    p.add_argument(
        "--agent-memory-overhead",
        default=defaults.agent_memory_overhead,
        help="memory the agent needs besides the pool (added to tmpfs pools' request)",
    )
    p.add_argument(
        "--agent-priority-class",
        default=env("OFFLOADPOOL_AGENT_PRIORITY_CLASS") or defaults.agent_priority_class,
        help="priorityClassName of the agent pods",
    )
    p.add_argument(
        "--agent-http-address",
        default=defaults.agent_http_address,
        help="address the agents' /healthz, /readyz, /metrics port binds in their pods",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=float(env("OFFLOADPOOL_HEARTBEAT_TIMEOUT_SECONDS", defaults.heartbeat_timeout_seconds)),
        help="seconds without an agent heartbeat before its node stops counting as Ready (0: never)",
    )
    p.add_argument(
        "--agent-heartbeat",
        type=float,
        default=float(env("OFFLOADPOOL_AGENT_HEARTBEAT_SECONDS", defaults.agent_heartbeat_seconds)),
        help="seconds between an agent's Lease renewals (given to the agents; at most a third of "
        "--heartbeat-timeout)",
    )
    p.add_argument(
        "--resync", type=float, default=defaults.resync_seconds, help="seconds between passes without events"
    )
    p.add_argument(
        "--deletion-retry",
        type=float,
        default=defaults.deletion_retry_seconds,
        help="seconds between checks while a deleted pool waits for its nodes",
    )
    p.add_argument(
        "--node-object-grace",
        type=float,
        default=defaults.node_object_grace_seconds,
        help="seconds a selected node's agent has to create its OffloadPoolNode before the operator "
        "does (0: the operator at once)",
    )
    p.add_argument(
        "--write-concurrency",
        type=positive_int,
        default=defaults.write_concurrency,
        help="writes of one step of a pass (Node marks, OffloadPoolNodes, rollout advances) sent at "
        "once (1: in turn)",
    )
    p.add_argument(
        "--kubelet-dir",
        default=defaults.kubelet_dir,
        help="the kubelet's --root-dir on the nodes: hostPaths reaching it are refused (guard webhook)",
    )
    p.add_argument(
        "--liveness",
        default=env("OFFLOADPOOL_LIVENESS", defaults.liveness),
        help="liveness endpoint URL ('' to disable)",
    )
    webhook.add_arguments(p)
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The settings the flags name; a flag not given leaves its field's default."""
    return OperatorConfig(
        namespace=args.namespace,
        agent_image=args.agent_image,
        agent_image_pull_policy=args.agent_image_pull_policy,
        agent_service_account=args.agent_service_account,
        agent_cpu_request=args.agent_cpu_request,
        agent_memory_overhead=args.agent_memory_overhead,
        agent_priority_class=args.agent_priority_class,
        agent_http_address=args.agent_http_address,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        agent_heartbeat_seconds=args.agent_heartbeat,
        resync_seconds=args.resync,
        deletion_retry_seconds=args.deletion_retry,
        node_object_grace_seconds=args.node_object_grace,
        write_concurrency=args.write_concurrency,
        liveness=args.liveness,
        kubelet_dir=args.kubelet_dir,
    )


#: What kopf says of a request it is about to send again (it says it at ERROR).
RETRY_MARK = "failed; will retry"


class QuietRetries(logging.Filter):
    """Logs kopf's "request attempt N failed; will retry" at INFO instead of ERROR.

    A healthy start meets refusals that are retried and pass: the first requests for a CRD
    the API server (or helm) has just made are answered 429 "storage is (re)initializing" for a
    moment. kopf logs each retry at ERROR, which a user reads as a fault. The last attempt's
    line ("failed; escalating") stays an ERROR: that one is a fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and RETRY_MARK in record.getMessage():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_retries() -> None:
    """Put ``QuietRetries`` on every handler of the root logger (kopf.configure's included):
    a filter on a handler sees what every logger propagates to it, kopf's per-object loggers
    too."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, QuietRetries) for f in handler.filters):
            handler.addFilter(QuietRetries())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.standalone and not args.peering:
        print(
            "offloadpool-operator: give --standalone or --peering NAME (one replica must run)",
            file=sys.stderr,
        )
        return 2
    config = config_from_args(args)
    if (problem := config.problem()) is not None:
        print(f"offloadpool-operator: {problem}", file=sys.stderr)
        return 2
    import kopf

    from . import handlers  # noqa: F401  (registers the handlers)
    from .runtime import Runtime

    memo = kopf.Memo(runtime=Runtime(config))
    if args.webhook:
        from . import admission_handlers  # noqa: F401  (registers the admission handlers)

        memo["webhook"] = webhook.WebhookRuntime(webhook.options_from_args(args))

    kopf.configure(verbose=args.verbose, debug=args.debug)
    quiet_retries()
    from offloadpool import __version__

    logging.getLogger("offloadpool.operator").info(
        "offloadpool-operator %s: namespace %s, agent image %s, webhook %s",
        __version__,
        config.namespace,
        config.agent_image,
        "on" if args.webhook else "off",
    )
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not (args.verbose or args.debug):
        # kopf logs every handler run at INFO ("Handler 'node_event' succeeded"): with 200
        # agents heartbeating that is most of the log and a good part of the CPU. The
        # operator's own INFO lines (the writes each pass makes) stay.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Everything imported so far (kopf, the kubernetes client's thousands of model classes and
    # the call validators of the API classes ``kube.API_CLASSES`` names, pydantic) lives as long
    # as the process: out of the collector's sight, a full collection does not walk those
    # objects while a big pool converges (docs/scale.md).
    gc.freeze()
    kopf.run(
        clusterwide=True,
        standalone=args.standalone,
        peering_name=args.peering,
        liveness_endpoint=None,  # served bounded by the startup handler (endpoints.liveness)
        memo=memo,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
