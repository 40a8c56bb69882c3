#!/usr/bin/env python3
"""``hack/vllm_env.py --engine lmcache``, by its older name (one mechanism: hack/vllm_env.py).

    python3 hack/lmcache_env.py ensure|python|paths

Standard library only, like hack/vllm_env.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: hack/ is a package of the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hack import vllm_env

if __name__ == "__main__":
    sys.exit(vllm_env.main(["--engine", "lmcache", *sys.argv[1:]]))
