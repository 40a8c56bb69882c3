"""The CSI node plugin's settings, every default written once (as ``AgentConfig`` does)."""

from __future__ import annotations

from dataclasses import dataclass

from offloadpool.api.constants import HOST_ROOT

#: where the kubelet keeps its pods' volumes (``<dir>/pods/<uid>/volumes/...``)
KUBELET_DIR = "/var/lib/kubelet"


@dataclass(frozen=True)
class CsiConfig:
    #: this node's name: the CSI node id (``NodeGetInfo``)
    node_id: str
    #: the unix socket the plugin serves on
    endpoint: str = f"{KUBELET_DIR}/plugins/offloadpool.io/csi.sock"
    #: the host root the agents keep their pools under
    root: str = HOST_ROOT
    #: the kubelet's directory: every target path must be a CSI volume's ``mount`` below it
    kubelet_dir: str = KUBELET_DIR
