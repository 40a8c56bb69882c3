#!/usr/bin/env python3
"""Install the pinned vLLM, SGLang or LMCache the tests drive, in a venv cached outside the clone.

Why this exists: offloadpool's vLLM behaviour is tested by running vLLM's own code (pinned),
never a re-implementation of it. The full ``pip install vllm==0.33.0`` is about 9.4 GB; the
tests need only the subset in ``hack/vllm-requirements.txt`` (why that subset: the file's
header and docs/vllm.md), installed with ``--no-deps`` so pip cannot pull the rest back in.

    python3 hack/vllm_env.py ensure     install if missing or stale, verify, print what it did
    python3 hack/vllm_env.py python     print the environment's interpreter (exit 1 if absent)
    python3 hack/vllm_env.py paths      print the cache layout and the stamp as JSON
    python3 hack/vllm_env.py --engine sglang ensure|python|paths     the same for SGLang
    python3 hack/vllm_env.py --engine lmcache ensure|python|paths    the same for LMCache

One mechanism, one pin per engine (``PINS``): SGLang's environment is built the same way from
``hack/sglang-requirements.txt`` plus the torch block of ``hack/vllm-requirements.txt`` (every pin
above its import-chain section but vLLM itself), so both engines run on one torch and its CUDA
libraries come from pip's cache the second time (docs/sglang.md). A pin with a ``base`` engine
is a layer: LMCache's venv holds only ``hack/lmcache-requirements.txt`` (~350 MiB) and sees the
vLLM environment's site-packages (torch, numpy, pyzmq, fastapi, ...) through one ``.pth`` file;
``ensure`` builds the base first, and the layer's key names the base's key instead of the Python,
so a new vLLM environment builds a new layer (docs/lmcache.md).

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
SGLANG_VERSION = "0.5.23"
LMCACHE_VERSION = "0.5.6"
DEFAULT_CACHE = "/var/cache/offloadpool"
HACK = Path(__file__).resolve().parent
REQUIREMENTS = HACK / "vllm-requirements.txt"
#: where vllm-requirements.txt's torch block ends (the pins above it, but vLLM, are torch's)
TORCH_BLOCK_END = "# -- what the import chain"
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

# SGLang: its host pools and the plugin loader, the modules offloadpool.sglang hooks.
SGLANG_PROBE = """
import sglang, torch
from sglang.srt.mem_cache.pool_host import base, common
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
assert callable(common.alloc_with_host_register) and callable(base.host_memory_budget_bytes)
assert sglang.__version__ == %r, sglang.__version__
print("sglang", sglang.__version__, "torch", torch.__version__)
"""

# LMCache: the server's whole import chain (as `lmcache server` imports it) and the server-bench
# client the tests drive.
LMCACHE_PROBE = """
import lmcache, torch
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
from lmcache.v1.multiprocess.http_server import run_http_server
from lmcache.v1.memory_allocators.devdax_memory_allocator import DevDaxMemoryAllocator
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from importlib.metadata import version
assert version("lmcache") == %r, version("lmcache")
print("lmcache", version("lmcache"), "torch", torch.__version__)
"""


class Pin:
    """One engine's pinned environment: its name, version, requirements and import probe; with a
    ``base`` engine, a layer whose venv sees that engine's site-packages through a ``.pth`` file."""

    def __init__(
        self,
        name: str,
        version: str,
        requirements: Path,
        probe: str,
        torch_from_vllm: bool = False,
        base: str | None = None,
        probe_env: dict[str, str] | None = None,
    ):
        self.name, self.version, self.requirements = name, version, requirements
        self.probe, self.torch_from_vllm = probe, torch_from_vllm
        self.base, self.probe_env = base, probe_env or {}

    def pins(self) -> list[str]:
        """Every distribution to install, ``name==version``, in order."""
        own = _pin_lines(self.requirements.read_text())
        if not self.torch_from_vllm:
            return own
        head = REQUIREMENTS.read_text().split(TORCH_BLOCK_END, 1)[0]
        torch_block = [ln for ln in _pin_lines(head) if not ln.lower().startswith("vllm==")]
        return torch_block + own

    def sources(self) -> list[Path]:
        return [self.requirements, *([REQUIREMENTS] if self.torch_from_vllm else [])]


def _pin_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


PINS = {
    "vllm": Pin("vllm", VLLM_VERSION, REQUIREMENTS, PROBE),
    "sglang": Pin(
        "sglang", SGLANG_VERSION, HACK / "sglang-requirements.txt", SGLANG_PROBE, torch_from_vllm=True
    ),
    "lmcache": Pin(
        "lmcache",
        LMCACHE_VERSION,
        HACK / "lmcache-requirements.txt",
        LMCACHE_PROBE,
        base="vllm",
        probe_env={"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"},
    ),
}
#: the engine this process works on (``--engine``); the module's functions read it
PIN = PINS["vllm"]


def use(engine: str) -> Pin:
    """Make ``engine``'s pin the one the module's functions work on."""
    global PIN
    PIN = PINS[engine]
    return PIN


@contextlib.contextmanager
def using(engine: str) -> Iterator[Pin]:
    """Work on ``engine``'s pin for a while (a layer's base), then on the previous one again."""
    previous = PIN
    try:
        yield use(engine)
    finally:
        use(previous.name)


def say(message: str) -> None:
    """Progress goes to stderr so that `python` and `paths` keep stdout for their answer."""
    print(f"{PIN.name}_env: {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", DEFAULT_CACHE)) / PIN.name


def key() -> str:
    """Everything that goes into the environment: the pins, the recipe and the Python (a layer:
    its base's key instead, which names the Python)."""
    # vLLM's key is the hash of its file's bytes, as before SGLang's pin joined it (an
    # environment already cached keeps its key); SGLang's covers its pins and vLLM's torch block.
    digest = hashlib.sha256(PIN.requirements.read_bytes())
    if PIN.torch_from_vllm:
        digest.update("\n".join(PIN.pins()).encode())
    digest.update(f"recipe={RECIPE_REVISION}".encode())
    if PIN.base:
        with using(PIN.base):
            base = key()
        digest.update(f";base={base}".encode())
        return f"{PIN.name}-{PIN.version}-{base}-{digest.hexdigest()[:12]}"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{PIN.name}-{PIN.version}-{py}-{digest.hexdigest()[:12]}"


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


def site_packages(python: Path) -> str:
    """The purelib directory of the venv ``python`` belongs to."""
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def probe() -> str:
    """Import every module the tests drive with the environment's Python; return its answer."""
    out = subprocess.run(
        [str(python_path()), "-c", PIN.probe % PIN.version],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **PIN.probe_env},
    )
    return out.stdout.strip().splitlines()[-1]


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
    what = f"{PIN.name}, torch and the CUDA libraries libtorch links: several GB on a cold pip cache"
    if PIN.base:
        with using(PIN.base):
            base, base_key = python_path(), key()
        # the layer's one link to its base: the base venv's site-packages on sys.path
        Path(site_packages(python_path()), f"offloadpool_{PIN.base}_env.pth").write_text(
            site_packages(base) + "\n"
        )
        what = f"{PIN.name} over the {PIN.base} environment {base_key}"
    pins = PIN.pins()
    listing = target / "requirements.txt"
    listing.write_text("\n".join(pins) + "\n")
    say(
        f"pip install --no-deps {len(pins)} pinned distributions from "
        f"{', '.join(p.name for p in PIN.sources())} ({what})"
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
            str(listing),
        ],
        check=True,
    )
    seconds = time.monotonic() - t0
    versions = probe()
    stamp = {
        "key": key(),
        PIN.name: PIN.version,
        **({"base": base_key} if PIN.base else {}),
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
    if PIN.base:
        with using(PIN.base):
            ensure()
    with locked():
        stamp = read_stamp()
        if stamp is not None:
            try:
                probe()
            except subprocess.CalledProcessError as exc:
                say(
                    f"cached environment no longer imports {PIN.name} "
                    f"({exc.stderr.strip()[-300:]}); rebuilding"
                )
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
    parser.add_argument("--engine", choices=sorted(PINS), default="vllm")
    parser.add_argument("command", choices=["ensure", "python", "paths"])
    args = parser.parse_args(argv)
    use(args.engine)
    if args.command == "ensure":
        ensure()
        print(python_path())
        return 0
    if args.command == "python":
        if read_stamp() is None:
            say(
                f"not installed: run `python3 hack/vllm_env.py --engine {PIN.name} ensure` "
                f"(expected {venv_dir()})"
            )
            return 1
        print(python_path())
        return 0
    base = {}
    if PIN.base:
        with using(PIN.base):
            base = {"base": str(venv_dir())}
    print(
        json.dumps(
            {
                "cache": str(cache_root()),
                "key": key(),
                **base,
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
