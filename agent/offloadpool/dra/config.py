"""The DRA kubelet plugin's settings: every default written once, on a documented field (as
``CsiConfig`` does); the command line takes its defaults from here."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from offloadpool.api.agent_env import NODE_NAME_ENV
from offloadpool.api.constants import HOST_ROOT, KUBELET_DIR
from offloadpool.api.dra import DRA_DRIVER


@dataclass(frozen=True)
class DraConfig:
    node_id: str
    """This node's name: a claim is prepared only from this node's slices (``<pool>.<node>``)
    (flag ``--node-id``, else the environment's node name, else the host name)."""
    endpoint: str = ""
    """The unix socket the plugin serves ``dra.v1`` on, where its registration points the
    kubelet (a host path); empty: ``<kubelet_dir>/plugins/offloadpool.io/dra.sock``."""
    registration: str = ""
    """The unix socket the plugin serves the kubelet's plugin registration on (the CSI plugin's
    is ``offloadpool.io-reg.sock``: a name of its own); empty:
    ``<kubelet_dir>/plugins_registry/offloadpool.io-dra-reg.sock``."""
    root: str = HOST_ROOT
    """The host root the agents keep their pools under (the pools the plugin prepares)."""
    kubelet_dir: str = KUBELET_DIR
    """The kubelet's directory (its ``--root-dir``): each claim's tree is bound below its
    ``plugins/offloadpool.io/`` (root's alone, out of every pod's reach: the guard webhook
    refuses hostPaths into the kubelet's tree), where the CDI spec's mount source points."""
    cdi_dir: str = "/var/run/cdi"
    """Where the plugin writes each prepared claim's CDI spec (JSON) for the container runtime."""
    stage: str = "/run/offloadpool-dra/stage"
    """A directory of the plugin's own where it mounts a private tmpfs at start and builds each
    claim's tree before binding it (as the CSI plugin's ``stage``)."""
    kubeconfig: str = ""
    """The kubeconfig the plugin reads ResourceClaims with; empty: in-cluster (its pod's
    ServiceAccount), else the default kubeconfig."""

    def __post_init__(self) -> None:
        if not self.endpoint:
            object.__setattr__(self, "endpoint", f"{self.plugin_dir}/dra.sock")
        if not self.registration:
            registration = f"{self.kubelet_dir}/plugins_registry/{DRA_DRIVER}-dra-reg.sock"
            object.__setattr__(self, "registration", registration)

    @property
    def plugin_dir(self) -> str:
        """``<kubelet_dir>/plugins/offloadpool.io``: root's, 0700."""
        return f"{self.kubelet_dir}/plugins/{DRA_DRIVER}"

    @property
    def claims_dir(self) -> str:
        """Where each claim's tree is bound: ``<plugin_dir>/claims/<claim uid>/mount``."""
        return f"{self.plugin_dir}/claims"

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> DraConfig:
        """The settings from the command line; what is not given is the field's default."""
        env = os.environ if environ is None else environ
        p = argparse.ArgumentParser(
            prog="python3 -m offloadpool.dra", description="offloadpool's DRA kubelet plugin"
        )
        p.add_argument(
            "--node-id", default=env.get(NODE_NAME_ENV) or socket.gethostname(), help="this node's name"
        )
        p.add_argument(
            "--endpoint",
            default=cls.endpoint,
            help="the dra.v1 socket served (default <kubelet-dir>/plugins/offloadpool.io/dra.sock)",
        )
        p.add_argument(
            "--registration-endpoint",
            default=cls.registration,
            help="the plugin-registration socket served"
            " (default <kubelet-dir>/plugins_registry/offloadpool.io-dra-reg.sock)",
        )
        p.add_argument("--root", default=cls.root, help=f"the agents' host root (default {cls.root})")
        kubelet = f"the kubelet's directory (default {cls.kubelet_dir})"
        p.add_argument("--kubelet-dir", default=cls.kubelet_dir, help=kubelet)
        cdi = f"the CDI spec directory (default {cls.cdi_dir})"
        p.add_argument("--cdi-dir", default=cls.cdi_dir, help=cdi)
        p.add_argument(
            "--stage", default=cls.stage, help=f"the private staging directory (default {cls.stage})"
        )
        p.add_argument("--kubeconfig", default=cls.kubeconfig, help="kubeconfig (default: in-cluster)")
        a = p.parse_args(argv)
        return cls(
            node_id=a.node_id,
            endpoint=a.endpoint,
            registration=a.registration_endpoint,
            root=a.root,
            kubelet_dir=a.kubelet_dir,
            cdi_dir=a.cdi_dir,
            stage=a.stage,
            kubeconfig=a.kubeconfig,
        )
