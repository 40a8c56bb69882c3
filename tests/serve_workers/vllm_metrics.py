"""vLLM 0.33.0's own Prometheus exposition of an offloading engine's hits (run with vLLM's Python).

    vllm_metrics.py JSON    {"queries": N, "hits": N, "load_bytes": N, "store_bytes": N}

vLLM's ``PrometheusStatLogger`` -- the logger ``vllm serve`` publishes on /metrics -- is built for
an ``OffloadingConnector`` whose spec is offloadpool's (``OffloadingSpecFactory`` loads it by
``spec_module_path``, so ``OffloadPromMetrics`` registers the spec's metrics), given one
scheduler step's stats -- the connector's prefix-cache hits and an ``OffloadingConnectorStats``
payload with the load and store byte counters the offloading worker reports -- and the text
``prometheus_client`` renders is printed. ``ModelConfig`` is not built: it inspects the model's
architecture by importing vLLM's model code, which this CPU subset cannot (no einops, no vllm._C);
the logger reads three of its fields, given here.
"""

from __future__ import annotations

import json
import sys
import types

from prometheus_client import generate_latest
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats


def main() -> None:
    cfg = json.loads(sys.argv[1])
    extra = {
        "spec_name": "OffloadPoolOffloadingSpec",
        "spec_module_path": "offloadpool.vllm.spec",
        "pool_dir": "/offloadpool/serve-check",
    }
    kv = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"), kv_transfer_config=kv)
    model = types.SimpleNamespace(served_model_name="tiny", max_model_len=2048, is_diffusion=False)
    object.__setattr__(vc, "model_config", model)
    logger = PrometheusStatLogger(vc, engine_indexes=[0])
    stats = OffloadingConnectorStats()
    stats.increase_counter("vllm:kv_offload_load_bytes", cfg["load_bytes"])
    stats.increase_counter("vllm:kv_offload_store_bytes", cfg["store_bytes"])
    step = SchedulerStats(
        connector_prefix_cache_stats=PrefixCacheStats(requests=4, queries=cfg["queries"], hits=cfg["hits"]),
        kv_connector_stats=stats.data,
    )
    logger.record(scheduler_stats=step, iteration_stats=None, engine_idx=0)
    sys.stdout.write(generate_latest().decode())


if __name__ == "__main__":
    main()
