"""The CSI node plugin: pools handed to pods as inline ephemeral ``csi`` volumes (docs/csi.md).

Publishing a volume is the node's access check (the pod's namespace against the pool's
``consumers.namespaces``, as the node recorded it) and a hold on the pool: the bind mount's
record under ``<root>/.state/<pool>/csi/`` counts as a holder until the volume is unpublished.
"""
