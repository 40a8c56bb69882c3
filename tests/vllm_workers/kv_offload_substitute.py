"""A pytest plugin for vLLM 0.33.0's own ``tests/v1/kv_offload/``: offloadpool's spec in place.

Loaded with ``-p kv_offload_substitute`` by ``hack/vllm_kv_offload_tests.py`` (this folder and
the clone's ``agent/`` on PYTHONPATH), before vLLM's test modules are imported:

* one pool is provisioned by the node engine (flat, ``Memory``, 256 MiB) under a scratch root,
  and ``OFFLOADPOOL_POOL_DIR`` names it, as the admission webhook does in a pod;
* ``vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec`` is rebound to ``OffloadPoolOffloadingSpec``.
  vLLM's factory loads ``CPUOffloadingSpec`` by that module attribute, and the tests import the
  name from there, so every spec the tests build or ask the factory for is offloadpool's, and
  ``isinstance``/``is`` checks see it as ``CPUOffloadingSpec``.

The pool is released when the session ends.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from offloadpool.region.lifecycle.provision import provision
from offloadpool.region.lifecycle.release import release
from offloadpool.region.request import PoolRequest

POOL = "vllm-kv-offload-tests"
CAPACITY = 256 << 20

_root = Path(tempfile.mkdtemp(prefix="offloadpool-kvt-"))
_pool = provision(PoolRequest(name=POOL, capacity=CAPACITY, medium="Memory"), _root)
os.environ["OFFLOADPOOL_POOL_DIR"] = str(_pool.pool_dir)

import vllm.v1.kv_offload.cpu.spec as cpu_spec  # noqa: E402

from offloadpool.vllm.spec import OffloadPoolOffloadingSpec  # noqa: E402

cpu_spec.CPUOffloadingSpec = OffloadPoolOffloadingSpec  # type: ignore[misc]


def pytest_report_header() -> str:
    return f"offloadpool: CPUOffloadingSpec is OffloadPoolOffloadingSpec on pool {_pool.pool_dir}"


def pytest_unconfigure() -> None:
    release(_root, POOL, force=True)
    os.rmdir(_root)
