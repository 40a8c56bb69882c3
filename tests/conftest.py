"""Test session wiring.

Fixture plugins live in ``tests/fixtures/`` (one concept per module). GPU tests (marked
``gpu``) are the only tests that may not run: they are deselected on machines without an
NVIDIA GPU, and run everywhere one exists. Nothing else skips: a test that cannot run here
(no root, no huge pages, no control plane) fails.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest

#: Every fixture plugin, with the third-party modules it imports. A plugin whose extras are
#: missing (a GPU machine with only the library, cuda-python, torch and pytest) is left out: a
#: test that needs one of its fixtures then errors with "fixture not found" — loudly, never a
#: skip. hack/test.sh installs everything, so in CI every plugin loads. (find_spec, not an
#: import: importing a plugin before pytest registers it would bypass assertion rewriting.)
_PLUGINS: dict[str, tuple[str, ...]] = {
    "fixtures.leak_guard": (),
    "fixtures.controlplane": (),
    "fixtures.crds": (),
    "fixtures.host": (),
    "fixtures.cluster": (),
    "fixtures.operator_process": ("yaml",),
    "fixtures.operator_world": ("kubernetes", "pydantic", "yaml"),
    "fixtures.pinning_pools": (),
    "fixtures.chaos": (),
    "fixtures.vllm_env": (),
}

pytest_plugins = [
    plugin
    for plugin, needs in _PLUGINS.items()
    if all(importlib.util.find_spec(module) is not None for module in needs)
]


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_present():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
