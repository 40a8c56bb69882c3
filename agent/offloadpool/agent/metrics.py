"""Prometheus metrics of one agent: what populating cost, what state the pool is in, who uses it.

Each agent gets its own registry (not the process-global one) so several agents can live in one
process, as they do in the 200-node load test; ``main`` adds the process and platform collectors
for the real single-agent process.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from offloadpool import __version__
from offloadpool.region.vocabulary import NODE_PHASES, PENDING


class AgentMetrics:
    def __init__(
        self, pool: str, node: str, registry: CollectorRegistry | None = None, process: bool = False
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        if process:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        labels = {"pool": pool, "node": node}
        r = self.registry
        # offloadpool_agent_build_info{version=...} 1: which release runs (mid-upgrade, some
        # nodes run the old one).
        Info("offloadpool_agent_build", "The offloadpool version of this agent", registry=r).info(
            {"version": __version__}
        )
        self._populate_seconds = Gauge(
            "offloadpool_populate_seconds",
            "Seconds the last provision of the region took",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._populate_rate = Gauge(
            "offloadpool_populate_gib_per_second",
            "Populate rate of the last provision (GiB/s)",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._populated_bytes = Counter(
            "offloadpool_populated_bytes",
            "Bytes this agent has pre-faulted (not counting reused regions)",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._region_bytes = Gauge(
            "offloadpool_region_bytes",
            "Bytes of the region provisioned on this node",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._progress = Gauge(
            "offloadpool_populate_progress_ratio",
            "Fraction of the region populated so far (0..1)",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._engines = Gauge(
            "offloadpool_engines_attached",
            "Processes holding the pool's lease or mapping/opening its files (attached engines)",
            list(labels),
            registry=r,
        ).labels(**labels)
        self._phase = Enum(
            "offloadpool_phase",
            "Phase of this node's pool",
            list(labels),
            states=list(NODE_PHASES),
            registry=r,
        ).labels(**labels)
        self._errors = Counter(
            "offloadpool_agent_errors",
            "Errors by reason (capacity, lease held, API, provision)",
            [*labels, "reason"],
            registry=r,
        )
        self._labels = labels
        self._phase.state(PENDING)

    def phase(self, phase: str) -> None:
        if phase in NODE_PHASES:
            self._phase.state(phase)

    def progress(self, done: int, total: int) -> None:
        self._progress.set(done / total if total else 0.0)

    def provisioned(self, total_bytes: int, populated_bytes: int, seconds: float, gib_per_s: float) -> None:
        self._region_bytes.set(total_bytes)
        self._populate_seconds.set(seconds)
        self._populate_rate.set(gib_per_s)
        if populated_bytes > 0:
            self._populated_bytes.inc(populated_bytes)
        self._progress.set(1.0)

    def released(self) -> None:
        self._region_bytes.set(0)
        self._progress.set(0.0)

    def engines(self, n: int) -> None:
        self._engines.set(n)

    def error(self, reason: str) -> None:
        self._errors.labels(**self._labels, reason=reason).inc()
