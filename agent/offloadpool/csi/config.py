"""The CSI node plugin's settings: every default written once, on a documented field (as
``AgentConfig`` does); the command line takes its defaults from here."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from offloadpool.api.agent_env import NODE_NAME_ENV
from offloadpool.api.constants import HOST_ROOT, KUBELET_DIR
from offloadpool.api.pods import CSI_DRIVER

#: the driver's name, as the CSIDriver object and every pod's ``csi.driver`` say it
DRIVER_NAME = CSI_DRIVER


@dataclass(frozen=True)
class CsiConfig:
    node_id: str
    """This node's name: the CSI node id ``NodeGetInfo`` answers (flag ``--node-id``, else the
    environment's node name, else the host name)."""
    endpoint: str = ""
    """The unix socket the plugin serves CSI on, where its registration points the kubelet
    (a host path); empty: ``<kubelet_dir>/plugins/offloadpool.io/csi.sock``."""
    root: str = HOST_ROOT
    """The host root the agents keep their pools under (the pools the plugin publishes)."""
    kubelet_dir: str = KUBELET_DIR
    """The kubelet's directory (its ``--root-dir``): every target path must be a CSI volume's
    ``mount`` below it, and its ``plugins_registry`` is where the kubelet looks for plugins."""
    stage: str = "/run/offloadpool-csi/stage"
    """A directory of the plugin's own (not shared with the host: in its container's file
    system) where it mounts a private tmpfs at start and builds each volume's tree before
    binding it at the target (``csi.bind``)."""
    registration: str = ""
    """The unix socket the plugin serves the kubelet's plugin registration on, where the
    kubelet's plugin watcher finds it and is told ``endpoint`` (served only once ``endpoint``
    is, removed when the plugin stops); empty:
    ``<kubelet_dir>/plugins_registry/offloadpool.io-reg.sock``."""

    def __post_init__(self) -> None:
        """The sockets follow the kubelet's directory unless given: a kubelet with another
        ``--root-dir`` needs only ``--kubelet-dir``."""
        if not self.endpoint:
            object.__setattr__(self, "endpoint", f"{self.kubelet_dir}/plugins/{DRIVER_NAME}/csi.sock")
        if not self.registration:
            registration = f"{self.kubelet_dir}/plugins_registry/{DRIVER_NAME}-reg.sock"
            object.__setattr__(self, "registration", registration)

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> CsiConfig:
        """The settings from the command line; what is not given is the field's default."""
        env = os.environ if environ is None else environ
        p = argparse.ArgumentParser(
            prog="python3 -m offloadpool.csi", description="offloadpool's CSI node plugin"
        )
        p.add_argument(
            "--node-id", default=env.get(NODE_NAME_ENV) or socket.gethostname(), help="this node's name"
        )
        p.add_argument(
            "--endpoint",
            default=cls.endpoint,
            help="the CSI socket served (default <kubelet-dir>/plugins/offloadpool.io/csi.sock)",
        )
        p.add_argument("--root", default=cls.root, help=f"the agents' host root (default {cls.root})")
        p.add_argument(
            "--kubelet-dir",
            default=cls.kubelet_dir,
            help=f"the kubelet's directory (default {cls.kubelet_dir})",
        )
        p.add_argument(
            "--stage", default=cls.stage, help=f"the private staging directory (default {cls.stage})"
        )
        p.add_argument(
            "--registration-endpoint",
            default=cls.registration,
            help="the plugin-registration socket served"
            " (default <kubelet-dir>/plugins_registry/offloadpool.io-reg.sock)",
        )
        a = p.parse_args(argv)
        return cls(
            node_id=a.node_id,
            endpoint=a.endpoint,
            root=a.root,
            kubelet_dir=a.kubelet_dir,
            registration=a.registration_endpoint,
            stage=a.stage,
        )
