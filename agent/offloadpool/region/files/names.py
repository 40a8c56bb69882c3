"""The rule for a pool's name, written once for the engine, the CLI, the agent and the API.

A pool's name becomes a directory under the host root, a label key suffix, an extended resource
name and the prefix of ``<pool>.<node>``, so it must be a DNS label of at most
``MAX_POOL_NAME`` characters: no dots, no slashes, nothing that could name ``..``, ``/`` or the
node side's own ``.state`` directory. The engine library is standard-library only, so the rule
lives here and ``offloadpool.api.constants`` imports it (the CRD's CEL states it to the API
server; ``tests/test_crd_agreement.py`` holds the two together).
"""

from __future__ import annotations

import re

MAX_POOL_NAME = 40
POOL_NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Keywords that tools use in place of a pool name.
RESERVED_POOL_NAMES = frozenset({"all", "none"})
#: Kubernetes keeps ``kube-`` names for itself; so do we.
RESERVED_POOL_PREFIXES = ("kube-",)


def pool_name_error(name: object, field: str = "pool name") -> str | None:
    """Why ``name`` cannot name a pool, or None; ``field`` is how the message calls it."""
    if not isinstance(name, str):
        return f"{field} must be a string, got {type(name).__name__}"
    if len(name) > MAX_POOL_NAME:
        return f"{field} must be at most {MAX_POOL_NAME} characters, got {len(name)}"
    if not POOL_NAME_PATTERN.fullmatch(name):
        return (
            f"{field} {name!r} must be a DNS-1123 label: lower-case letters, digits and '-', "
            "starting and ending with a letter or digit, no dots"
        )
    if name in RESERVED_POOL_NAMES or name.startswith(RESERVED_POOL_PREFIXES):
        return f"{field} {name!r} is reserved ('all', 'none' and 'kube-*' cannot name a pool)"
    return None
