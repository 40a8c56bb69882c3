#!/usr/bin/env python3
"""Install the pinned vLLM the tests drive, into a virtual environment cached outside the clone.

Why this exists: offloadpool's vLLM behaviour is tested by running vLLM's own code (pinned),
never a re-implementation of it. The full ``pip install vllm==0.33.0`` is about 9.4 GB; the
tests need only the subset in ``hack/vllm-requirements.txt`` (why that subset: the file's
header and docs/vllm.md), installed with ``--no-deps`` so pip cannot pull the rest back in.

    python3 hack/vllm_env.py ensure     install if missing or stale, verify, print what it did
    python3 hack/vllm_env.py python     print the environment's interpreter (exit 1 if absent)
    python3 hack/vllm_env.py paths      print the cache layout and the stamp as JSON

The environment lives in ``${OFFLOADPOOL_CACHE:-/var/cache/offloadpool}/vllm/<key>/venv``; the
key names vLLM's version, the Python it was built for and a hash of the requirements file, so
a change to any pin builds a new environment and a second clone reuses the first one's. A
stamp written only after a verified install makes ``ensure`` idempotent: an interrupted install
has no stamp and is rebuilt from scratch. A lock file serialises concurrent ``ensure`` calls.

offloadpool itself is not installed into the environment: the tests put the clone's ``agent/``
on ``PYTHONPATH``, so one cached environment serves every clone.

Standard library only: it runs before the project's own virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

VLLM_VERSION = "0.33.0"
DEFAULT_CACHE = "/var/cache/offloadpool"
REQUIREMENTS = Path(__file__).resolve().parent / "vllm-requirements.txt"
# Bump when the install recipe (flags, layout) changes, so old environments are not reused.
RECIPE_REVISION = 1

# What must import for the environment to count as installed: every vLLM module the tests
# drive. vLLM warns that its CUDA extension (vllm._C) is missing on a CPU machine; that is
# expected and harmless for these modules.
PROBE = """
import vllm, torch
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, pin_mmap_region
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
assert vllm.__version__ == %r, vllm.__version__
print("vllm", vllm.__version__, "torch", torch.__version__)
"""


def say(message: str) -> None:
    """Progress goes to stderr so that `python` and `paths` keep stdout for their answer."""
    print(f"vllm_env: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", DEFAULT_CACHE)) / "vllm"


def key() -> str:
    """Everything that goes into the environment: the pins, the recipe and the Python."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes())
    digest.update(f"recipe={RECIPE_REVISION}".encode())
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"vllm-{VLLM_VERSION}-{py}-{digest.hexdigest()[:12]}"


def env_dir() -> Path:
    return cache_root() / key()


def venv_dir() -> Path:
    return env_dir() / "venv"


def python_path() -> Path:
    return venv_dir() / "bin" / "python"


def stamp_path() -> Path:
    return env_dir() / "stamp.json"


def read_stamp() -> dict | None:
    try:
        stamp = json.loads(stamp_path().read_text())
    except (FileNotFoundError, ValueError):
        return None
    return stamp if stamp.get("key") == key() else None


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One installer per key at a time (two test runs may start together)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f"{key()}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def tree_bytes(path: Path) -> int:
    """Bytes the environment takes on disk (allocated blocks, like `du`)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def base_python() -> str:
    """The interpreter to build the venv from: the real one, also when run from a venv."""
    return getattr(sys, "_base_executable", None) or sys.executable


def probe() -> str:
    """Import every module the tests drive with the environment's Python; return its answer."""
    out = subprocess.run(
        [str(python_path()), "-c", PROBE % VLLM_VERSION],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def install() -> dict:
    """Build the environment from nothing; return the stamp that records it."""
    target = env_dir()
    if target.exists():
        say(f"removing incomplete environment {target}")
        shutil.rmtree(target)
    target.mkdir(parents=True)
    t0 = time.monotonic()
    say(f"creating venv {venv_dir()} from {base_python()}")
    subprocess.run([base_python(), "-m", "venv", str(venv_dir())], check=True)
    pins = [ln for ln in REQUIREMENTS.read_text().splitlines() if ln and not ln.startswith("#")]
    say(
        f"pip install --no-deps {len(pins)} pinned distributions from {REQUIREMENTS.name} "
        "(vllm, torch and the CUDA libraries libtorch links: several GB on a cold pip cache)"
    )
    subprocess.run(
        [
            str(python_path()),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--requirement",
            str(REQUIREMENTS),
        ],
        check=True,
    )
    seconds = time.monotonic() - t0
    versions = probe()
    stamp = {
        "key": key(),
        "vllm": VLLM_VERSION,
        "python": sys.version.split()[0],
        "distributions": len(pins),
        "install_seconds": round(seconds, 1),
        "venv_bytes": tree_bytes(venv_dir()),
        "probe": versions,
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stamp_path().write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def ensure() -> dict:
    with locked():
        stamp = read_stamp()
        if stamp is not None:
            try:
                probe()
            except subprocess.CalledProcessError as exc:
                say(f"cached environment no longer imports vLLM ({exc.stderr.strip()[-300:]}); rebuilding")
                stamp = None
        if stamp is None:
            stamp = install()
            say(
                f"installed {stamp['probe']} in {stamp['install_seconds']} s, "
                f"{stamp['venv_bytes'] / 2**30:.2f} GiB at {venv_dir()}"
            )
        else:
            say(f"up to date: {stamp['probe']} at {venv_dir()} (stamp {stamp_path()})")
        return stamp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["ensure", "python", "paths"])
    args = parser.parse_args(argv)
    if args.command == "ensure":
        ensure()
        print(python_path())
        return 0
    if args.command == "python":
        if read_stamp() is None:
            say(f"not installed: run `python3 hack/vllm_env.py ensure` (expected {venv_dir()})")
            return 1
        print(python_path())
        return 0
    print(
        json.dumps(
            {
                "cache": str(cache_root()),
                "key": key(),
                "venv": str(venv_dir()),
                "python": str(python_path()),
                "stamp": read_stamp(),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
