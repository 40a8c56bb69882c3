"""Hold a pool's shared lease for as long as this process lives: the webhook's lease sidecar.

Stock vLLM takes no lock on the region it maps, so the node side cannot tell it is attached.
The admission webhook therefore gives every pod that uses a pool a native sidecar (an init
container with ``restartPolicy: Always``) running ``offloadpool hold-lease <pool dir>``: the
kubelet starts it before the pod's own containers and stops it after them, so the pool's lease
is held for the pod's whole life and the agent reports the pool in use (and never releases or
reshapes it) until the pod is gone.

Choices, and why:

- the lease file is opened read-only and never created: ``flock`` needs no write access, and a
  pool directory without a lease is not provisioned yet (the sidecar waits for it, it does not
  make a stray file the agent would trip over);
- the shared lock is taken *blocking*: while the agent holds it exclusively (provisioning or
  applying a change) the sidecar waits, and its startup probe (the ready file) keeps the pod's
  containers from starting on a pool being reshaped;
- SIGTERM/SIGINT end it cleanly (exit 0): the kernel drops the lock when the descriptor closes,
  the ready file is removed. A SIGKILL drops the lock all the same.

Standard library only: it runs in the offloadpool image but imports nothing from the extras.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from offloadpool.region.files.manifest import LEASE_NAME


class Stop(Exception):
    """Raised from the signal handler: interrupts a blocking wait or flock."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise Stop(signal.Signals(signum).name)


def wait_for_lease_file(path: Path, poll_seconds: float, log: Callable[[str], None]) -> int:
    """Open ``path`` read-only, waiting (and saying so once) until the agent has created it."""
    said = False
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if not said:
                log(f"waiting for {path}: the pool is not provisioned on this node yet")
                said = True
            time.sleep(poll_seconds)


def hold(pool_dir: str, ready_file: str | None = None, poll_seconds: float = 1.0) -> int:
    """Take the shared lease of ``pool_dir`` and hold it until SIGTERM/SIGINT; returns 0."""

    def log(message: str) -> None:
        print(f"offloadpool hold-lease: {message}", flush=True)

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    path = Path(pool_dir) / LEASE_NAME
    fd = -1
    try:
        fd = wait_for_lease_file(path, poll_seconds, log)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{path} is held exclusively by the node agent (provisioning or applying a change); waiting")
            fcntl.flock(fd, fcntl.LOCK_SH)
        if ready_file:
            Path(ready_file).write_text(f"{os.getpid()}\n")
        log(f"holding the shared lease {path} (pid {os.getpid()}) until stopped")
        while True:
            signal.pause()
    except Stop as stop:
        log(f"{stop}: releasing {path}")
        return 0
    finally:
        if fd >= 0:
            os.close(fd)  # closing the only descriptor drops the flock
        if ready_file:
            try:
                os.unlink(ready_file)
            except FileNotFoundError:
                pass
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pool_dir", help="the pool directory (holds the lease file), e.g. /offloadpool/<pool>")
    p.add_argument(
        "--ready-file", help="written once the lease is held, removed on exit (for a startup probe)"
    )
    p.add_argument(
        "--poll-seconds", type=float, default=1.0, help="how often to look for a missing lease file"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="offloadpool hold-lease", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return hold(args.pool_dir, args.ready_file, args.poll_seconds)


if __name__ == "__main__":
    sys.exit(main())
