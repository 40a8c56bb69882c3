"""offloadpool's DRA driver ``offloadpool.io``: the ResourceSlices that describe each node's
pools to the scheduler and the kubelet plugin that prepares an allocated claim (docs/dra.md)."""
