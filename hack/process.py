"""The processes of the dev cluster (control plane and node) and the ports they listen on.

Every process runs in its own session (process group), logs to a file, and dies with its
parent: ``setpriv --pdeathsig KILL`` makes the kernel kill it when the process that started it
dies without cleaning up (a SIGKILLed pytest or supervisor), so a crash leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Process:
    """One process in its own process group under a parent-death signal, logging to a file.

    ``argv`` is the command as given (without the ``setpriv`` prefix), so the same process can
    be started again (:meth:`hack.controlplane.ControlPlane.outage`).
    """

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            prefix + self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        """The process's id, which is also its process group's (it leads its own session)."""
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group, up to ``grace`` seconds, then SIGKILL to whatever is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        # Whatever is left in the group (children, a process that ignored SIGTERM).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._log.close()
