"""SGLang 0.5.23's own Prometheus exposition of HiCache's host hits (run with SGLang's Python).

    sglang_metrics.py JSON   {"backup": N, "load_back": N, "host": N, "device": N}

SGLang's ``RadixCacheMetricsCollector`` (the radix cache's, with the rank labels
``radix_cache_metric_labels`` gives a TP-1 rank) counts the tokens backed up to the host and
loaded back; its ``TokenizerMetricsCollector`` counts a finished request's cached prompt tokens by
source (``cached_tokens_details``, as the scheduler reports them). Both register with
``prometheus_client``, whose text is printed. The pinned SGLang subset has no prometheus_client;
the test puts the vLLM environment's (0.26.0, pure Python) on PYTHONPATH.
"""

from __future__ import annotations

import json
import sys

from prometheus_client import generate_latest
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs


def main() -> None:
    cfg = json.loads(sys.argv[1])
    args = ServerArgs(model_path=cfg["model"], device="cpu", enable_metrics=True, served_model_name="tiny")
    get_context().set_server_args(args)  # the collectors read the observability settings from it
    from sglang.srt.observability.metrics_collector import (
        RadixCacheMetricsCollector,
        TokenizerMetricsCollector,
    )

    labels = {"cache_type": "UnifiedRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    radix = RadixCacheMetricsCollector(labels=labels)
    radix.increment_backup_num_tokens(cfg["backup"], "kv")
    radix.increment_load_back_num_tokens(cfg["load_back"], "kv")
    tokenizer = TokenizerMetricsCollector(server_args=args, labels={"model_name": "tiny"})
    tokenizer.observe_one_finished_request(
        {"model_name": "tiny"},
        prompt_tokens=320,
        generation_tokens=24,
        cached_tokens=cfg["host"] + cfg["device"],
        e2e_latency=0.1,
        has_grammar=False,
        cached_tokens_details={"device": cfg["device"], "host": cfg["host"]},
    )
    sys.stdout.write(generate_latest().decode())


if __name__ == "__main__":
    main()
