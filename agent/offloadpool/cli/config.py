"""The CLI's settings (``CliConfig``): each default written once, on the dataclass's fields.

Imported only once a subcommand other than ``hold-lease`` is chosen: the inference pods' lease
sidecar must load nothing but the standard library, and ``offloadpool.api`` loads pydantic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from offloadpool.api.agent_env import ROOT_ENV
from offloadpool.api.constants import HOST_ROOT


@dataclass(frozen=True)
class CliConfig:
    """Settings of one ``offloadpool`` command; flags override them."""

    root: str = HOST_ROOT
    """The host root holding the pools (``--root``; the agent's ``ROOT_ENV`` first): the agents'
    host root, so ``offloadpool status`` on a cluster node shows the pools the agents made."""
    demo_name: str = "demo"
    """The pool ``offloadpool demo`` provisions (``--name``)."""
    demo_capacity: str = "4Gi"
    """Its size (``--capacity``): enough to show a pre-fault, little enough for a laptop."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> CliConfig:
        """The defaults, with the host root from the environment when it names one."""
        env = os.environ if environ is None else environ
        return cls(root=env.get(ROOT_ENV) or cls.root)
