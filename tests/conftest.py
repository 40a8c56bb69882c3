"""Test session wiring.

Fixture plugins live in ``tests/fixtures/`` (one concept per module). GPU tests (marked
``gpu``) are the only tests that may not run: they are deselected on machines without an
NVIDIA GPU, and run everywhere one exists. Nothing else skips: a test that cannot run here
(no root, no huge pages, no control plane) fails.

What a test needs is declared by the fixtures it uses: a test that uses (directly or through
another fixture) one of ``FIXTURE_MARKERS`` carries that marker, so ``controlplane`` and
``root`` always mean what they say without anyone remembering to write them. The fast lane
(``bash hack/test.sh --fast``, docs/testing.md) deselects them by marker.
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
    "fixtures.cgroups": (),
    "fixtures.cluster": (),
    "fixtures.operator_process": ("yaml",),
    "fixtures.operator_world": ("kubernetes", "pydantic", "yaml"),
    "fixtures.pinning_pools": (),
    "fixtures.chaos": (),
    "fixtures.vllm_env": (),
    "fixtures.node": (),
    "fixtures.chart_node": (),
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


#: Fixtures that need something the fast lane does not have, and the marker a test using them
#: gets: the real control plane (built with Go), or root (mounts, the suite's huge pages, mlock).
FIXTURE_MARKERS: dict[str, str] = {
    "control_plane": "controlplane",
    "hugepage_reservation": "root",
    "region_root": "root",
    "make_pool": "root",
    "cgroups": "root",
    "vllm_python": "vllm",
    "lmcache_python": "vllm",
    "sglang_python": "sglang",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in set(getattr(item, "fixturenames", ())) & FIXTURE_MARKERS.keys():
            if item.get_closest_marker(FIXTURE_MARKERS[fixture]) is None:
                item.add_marker(FIXTURE_MARKERS[fixture])
    if _gpu_present():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config.hook.pytest_deselected(items=gpu)
