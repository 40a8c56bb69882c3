"""The node agent: one process per pool and node (a pod of the pool's DaemonSet).

It turns the pool's spec into memory on its node through :mod:`offloadpool.region`, and tells
the cluster how that went by writing its own OffloadPoolNode status. It never writes Nodes,
never watches anything cluster-wide, and never changes memory an engine holds.
"""
