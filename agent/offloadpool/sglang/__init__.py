"""SGLang (HiCache) integration: a plugin that serves every host pool of a rank from a pool.

SGLang loads entry points of group ``sglang.srt.plugins`` at the start of every scheduler
process (``sglang.srt.plugins.load_plugins``); offloadpool registers ``offloadpool.sglang.plugin:
register`` there (pyproject.toml). When ``$OFFLOADPOOL_POOL_DIR`` names a pool, the plugin
replaces, through SGLang's own ``HookRegistry``:

* ``mem_cache.pool_host.common.alloc_with_host_register``: each host buffer is carved from the
  rank's part of the pool (attached as the native vLLM spec does, lease held), then registered
  with CUDA by SGLang's own ``_cuda_host_register`` when SGLang asks for pinned memory;
  offloadpool pins nothing;
* ``mem_cache.pool_host.base.host_memory_budget_bytes``: the budget is what is left of the
  rank's part, so reserved huge pages count.

Without the variable the plugin does nothing (SGLang allocates as it always does). Anything
that goes wrong stops the rank (``SystemExit``, which SGLang's loader does not swallow), never a
silent fallback to SGLang's allocation (docs/sglang.md). Only ``plugin`` imports SGLang and torch.
"""

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "offloadpool"
PLUGIN_TARGET = "offloadpool.sglang.plugin:register"
