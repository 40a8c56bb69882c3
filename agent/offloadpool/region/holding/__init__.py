"""Who holds a pool: the engines' lease, the lease sidecar, the node's view of every process that
maps or opens a pool's files, CSI publications, and the shares of a partitioned pool.
"""
