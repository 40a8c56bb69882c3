"""Parse a serving check's command line with the engine's own argument parser (its Python).

    engine_args.py vllm|sglang ARGV_JSON    prints the parsed values the check relies on

vLLM: ``make_arg_parser`` (``vllm serve``'s, ``entrypoints/common/cli_args.py``); its defaults
build a ``DeviceConfig``, so ``VLLM_TARGET_DEVICE=cpu`` is set by the caller on a machine without
a GPU. SGLang: ``ServerArgs.add_cli_args`` (``launch_server``'s). Parsing only: nothing starts.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    engine, argv = sys.argv[1], json.loads(sys.argv[2])
    if engine == "vllm":
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        kv = ns.kv_transfer_config
        out = {
            "model": ns.model_tag,
            "served_model_name": ns.served_model_name,
            "enforce_eager": ns.enforce_eager,
            "enable_prompt_tokens_details": ns.enable_prompt_tokens_details,
            "block_size": ns.block_size,
            "kv_connector": kv.kv_connector,
            "kv_role": kv.kv_role,
            "kv_connector_extra_config": kv.kv_connector_extra_config,
        }
    else:
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        keys = (
            "model_path",
            "enable_hierarchical_cache",
            "hicache_write_policy",
            "hicache_size",
            "attention_backend",
            "enable_deterministic_inference",
            "max_total_tokens",
            "enable_metrics",
            "cuda_graph_backend_decode",
            "cuda_graph_backend_prefill",
        )
        out = {k: getattr(ns, k) for k in keys}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
