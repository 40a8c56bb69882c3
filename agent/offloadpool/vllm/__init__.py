"""Native vLLM integration: an ``OffloadingSpec`` whose CPU KV tier is an offloadpool pool.

vLLM's ``OffloadingConnector`` loads any spec named in ``kv_connector_extra_config``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "OffloadPoolOffloadingSpec",
                                    "spec_module_path": "offloadpool.vllm.spec"}}'

Each worker then attaches the pool with ``offloadpool.pinning.attach`` (holding the pool's
lease for its lifetime), gets vLLM's own strided views over it, pins once through offloadpool's
planner and backends, and never populates, truncates or unlinks anything: the node did and
does all of that. The pool directory is ``pool_dir`` in the extra config or
``$OFFLOADPOOL_POOL_DIR`` (the admission webhook sets it). The CPU tier's size comes from the
pool; a pool that cannot serve the engine fails the start with one message (docs/vllm.md).

Only ``offloadpool.vllm.spec`` and ``offloadpool.vllm.region`` import vLLM (and torch); they are
imported by vLLM itself, inside vLLM. ``offloadpool.vllm.geometry`` is plain Python, and nothing
in the base install imports this package.
"""

SPEC_NAME = "OffloadPoolOffloadingSpec"
SPEC_MODULE = "offloadpool.vllm.spec"
